"""The plain vLLM engine of the fast tiny model that the real-vLLM tests compare P/D outputs with (no
connector; only its greedy outputs are used), started once per pytest session and shared by every
module that uses that model: five modules each started and stopped their own, ~26 s apiece on the idle
2-core box (vLLM on CPU starts three interpreters one after another, each importing vLLM and torch).

It keeps vLLM's default executor, like the engines under test. Running its model worker inside the
engine-core process instead (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `--distributed-executor-backend uni`)
starts 7 s sooner, but on vLLM 0.29 a bf16 model (gptoss-bf16) then answered a 511-token prompt with other
greedy tokens than the same engine with the default executor: a reference must be configured as the
engines it is compared with.
"""

from __future__ import annotations

from pathlib import Path

from kvpush.platforms.vllm.tools.serve_pd import Deployment, start_single


class SharedReference:
    """The session's reference engine, started by the first module that asks (after its own P/D pair is
    up: the start-ups share 2 cores) and again if it died. Idle between modules it costs no CPU (vLLM's
    engine core blocks on its input queue)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.dep: Deployment | None = None

    def get(self) -> Deployment:
        if self.dep is not None and not all(p.alive() for p in self.dep.procs):
            self.dep.stop()
            self.dep = None
        if self.dep is None:
            from kvpush.platforms.vllm.tools.tiny_model import build

            self.dep = start_single(str(build("fast")), self.log_dir, cores="0")
        return self.dep

    def stop(self) -> None:
        if self.dep is not None:
            self.dep.stop()
            self.dep = None
