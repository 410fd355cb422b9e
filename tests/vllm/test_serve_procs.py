"""The processes serve-pd starts leave nothing behind once stopped: vLLM binds its ZeroMQ ipc:// sockets
under VLLM_RPC_BASE_PATH, its torch file stores under the temporary directory and its message queues in
/dev/shm, and an engine stopped by a signal never unlinks them (2,300 such files in /tmp and 13 segments
of 160-240 MiB in /dev/shm after a day's test runs here)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from kvpush.platforms.vllm.tools.serve_procs import Started

# the child stands in for a vLLM engine: a socket where vLLM binds its ipc:// paths, a file where torch's
# file store goes; it ignores SIGTERM, as an engine busy shutting down does, so stop() must SIGKILL it
CHILD = """
import json, os, signal, socket, tempfile, time
from multiprocessing import resource_tracker, shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
shm.buf[:4] = b"kvps"
resource_tracker.unregister(shm._name, "shared_memory")  # as vLLM's queues: nobody unlinks it at exit
sock_path = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "engine-core.ipc")
s = socket.socket(socket.AF_UNIX)
s.bind(sock_path)
store = os.path.join(tempfile.gettempdir(), "vllm_dist_store")
open(store, "w").close()
print(json.dumps({"sock": sock_path, "store": store, "tmp": tempfile.gettempdir(), "shm": shm.name,
                  "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}), flush=True)
time.sleep(600)
"""


def test_a_stopped_process_leaves_no_socket_file_or_shared_memory(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = Started("engine", [sys.executable, "-c", CHILD], {"PATH": "/usr/bin:/bin"}, log)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not log.read_text().strip():
            time.sleep(0.05)
        seen = json.loads(log.read_text().strip().splitlines()[-1])
        sock, store, tmp = Path(seen["sock"]), Path(seen["store"]), Path(seen["tmp"])
        assert tmp != Path(tempfile.gettempdir()), "the child used the shared temporary directory"
        assert sock.parent == tmp and store.parent == tmp, seen
        assert sock.is_socket() and store.is_file()
        shm = Path("/dev/shm") / seen["shm"]
        assert shm.read_bytes()[:4] == b"kvps"
        # torch's compile cache stays where torch puts it by default, shared between engine starts
        assert Path(seen["inductor"]).parent == Path(tempfile.gettempdir()), seen
    finally:
        proc.stop(grace_s=0.5)
    assert not proc.alive()
    assert not sock.exists() and not store.exists() and not tmp.exists(), sorted(
        tmp.parent.glob(tmp.name + "*")
    )
    assert not shm.exists(), f"{shm} outlived the process that mapped it"
    # the socket path stays short enough for AF_UNIX (108 bytes) with vLLM's 36-character names
    assert len(str(tmp / ("x" * 36)).encode()) < 108
