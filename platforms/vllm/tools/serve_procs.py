"""The processes `kvpush serve-pd` starts: each in its own session (process group), stopped by signalling
exactly that group (SIGTERM, then SIGKILL after a grace period), and waited for until /health answers.
Nothing else on the machine is touched.

Each process gets a private temporary directory (TMPDIR and VLLM_RPC_BASE_PATH), removed when it is
stopped: vLLM puts its ZeroMQ ipc:// sockets and its torch file stores (`vllm_dist_*`) in the temporary
directory, and an engine stopped by a signal leaves them behind (thousands a day of test runs).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


class Started:
    """A process we started, in its own process group."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log_path: Path, cpus: set[int] | None = None
    ):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"kvpush-{name}-"))  # removed in stop()
        env = private_tmp(env, self.tmp_dir)
        # cpus: set in the child before exec, so every process the engine starts inherits the mask
        confine = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=confine,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        # Engine children (EngineCore, workers) live in the same group; make sure none outlive us.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def private_tmp(env: dict[str, str], tmp_dir: Path) -> dict[str, str]:
    """env with its temporary directory (and vLLM's ipc:// socket directory) moved to tmp_dir; torch's
    compile cache stays where it was (shared between starts, it saves each engine a recompile)."""
    out = {**env, "TMPDIR": str(tmp_dir), "VLLM_RPC_BASE_PATH": str(tmp_dir)}
    try:
        user = getpass.getuser()  # as torch names its default cache directory
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    out.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
    return out


def wait_healthy(url: str, procs: list[Started], timeout_s: float = 300.0, any_answer: bool = False) -> None:
    """Until url/health answers 200 (any_answer: answers at all, e.g. a proxy reporting a refused
    pairing with 503), or one of procs exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(
                    f"{p.name} exited with code {p.proc.returncode} before {url}/health "
                    f"answered; last log lines ({p.log_path}):\n{p.tail()}"
                )
        try:
            with urllib.request.urlopen(url + "/health", timeout=20) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError:
            if any_answer:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f}s")
