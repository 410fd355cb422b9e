"""The processes `kvpush serve-pd` starts: each in its own session (process group), stopped by signalling
exactly that group (SIGTERM, then SIGKILL after a grace period), and waited for until /health answers.
Nothing else on the machine is touched.

Each process gets a private temporary directory (TMPDIR and VLLM_RPC_BASE_PATH), removed when it is
stopped: vLLM puts its ZeroMQ ipc:// sockets and its torch file stores (`vllm_dist_*`) in the temporary
directory, and an engine stopped by a signal leaves them behind (thousands a day of test runs). Its named
shared memory in /dev/shm cannot be moved: what the group mapped is unlinked once the group is gone.
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
        """SIGTERM to the group, the grace period for all of it to exit (vLLM's engine cores and workers
        shut down after the API server does), then SIGKILL to what is left. Named shared memory the group
        had mapped and left behind (vLLM's message queues; a SIGKILLed engine never unlinks them) is
        removed once the group is gone, and so is the process's temporary directory."""
        pgid = self.proc.pid
        shm = group_shm(pgid)
        deadline = time.monotonic() + grace_s
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Engine children (EngineCore, workers) live in the same group; make sure none outlive us.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        gone_by = time.monotonic() + 5
        while group_members(pgid) and time.monotonic() < gone_by:
            time.sleep(0.05)
        for path in shm:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._log.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group pgid, from /proc."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def group_shm(pgid: int) -> set[str]:
    """Files under /dev/shm that the processes of group pgid map (deleted ones aside)."""
    found = set()
    for pid in group_members(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                found.add(path)
    return found


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
