"""Real vLLM (CPU) + real NIXL behind vLLM's own router (`vllm-router`, PyPI) instead of kvpush's proxy.

One kvpush prefill and one decode (fast tiny model) behind `vllm-router --vllm-pd-disaggregation`
(its default `nixl` mode): the session's shared fast pair (tests/vllm/shared_engines.py, which
test_kvpush_vllm.py uses through the kvpush proxy; conftest.py runs this module's tests on it right after
those and checks that each test leaves it at rest), the session's single engine as the reference
(tests/vllm/reference.py); then the same prefill fanned out to a second decode (1P2D) behind a second
router, sharing the 1P1D engines (one more start-up; the idle reference stays up). Also: kvpush's figures
on vLLM's own /metrics (the connector-stats hooks), and a mismatched pair that never reaches the router.
Two engine start-ups of its own (the second decode, one refused decode; the shared pair and the
reference too when this module runs alone). Counters are compared before and after each test: the
shared pair has served other tests.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools import client
from kvpush.platforms.vllm.tools.serve_pd import Deployment, add_decode, add_router, start_pd
from kvpush.platforms.vllm.tools.tiny_model import build

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MAX_TOKENS = 8
LENGTHS = [5, 60, 129, 400, 900]


def _have_router() -> bool:
    return (Path(sys.executable).parent / "vllm-router").is_file() or shutil.which("vllm-router") is not None


@pytest.fixture(scope="module")
def model() -> str:
    assert _have_router(), "vllm-router is not installed (make router-tools, or pip install vllm-router)"
    return str(build("fast"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="module")
def pd(model: str, logs: Path, fast_pair: Deployment):
    """The session's shared fast pair (shared_engines.py: the same engines and settings this module once
    started for itself, lease 30 s) behind a vllm-router of this module's own: a deployment of its own
    whose url is the router's; what a test adds to it (a second decode, a router) is stopped here."""
    prefill, decode = fast_pair.engines
    dep = Deployment("kvpush", "", list(fast_pair.procs), list(fast_pair.engines))
    dep.url = add_router(dep, logs, [prefill.url], [decode.url], "vllm-router")
    dep.stats_dir = fast_pair.stats_dir  # type: ignore[attr-defined]
    yield dep
    for proc in reversed(dep.procs[len(fast_pair.procs) :]):
        proc.stop()


def _stats(dep, role: str) -> dict:
    return json.loads((Path(dep.stats_dir) / f"kvpush-{role}-rank0.json").read_text())


def _wait(pred, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.25)
    return pred()


def _kv_usage(url: str) -> float:
    return client.metric(client.metrics(url), "vllm:kv_cache_usage_perc")


def test_router_outputs_equal_a_single_engine_every_request_pushed_legs_concurrent(pd, single, model):
    prefill, decode = pd.engines
    prompts = client.make_prompts(10, LENGTHS, seed=5)
    want = client.complete_many(single.url, model, prompts, MAX_TOKENS, concurrency=4)
    p0, d0 = _stats(pd, "prefill"), _stats(pd, "decode")  # the shared pair's counters so far
    # the first request per prefill is sequential (the router learns the prefill's identity from it)
    first = client.complete_many(pd.url, model, prompts[:1], MAX_TOKENS, concurrency=1)
    rest = client.complete_many(pd.url, model, prompts[1:], MAX_TOKENS, concurrency=4)
    for i, (w, g) in enumerate(zip(want, first + rest, strict=True)):
        assert len(w) == MAX_TOKENS and g == w, f"prompt {i}: router P/D {g} != single {w}"
    n = len(prompts)
    assert _wait(
        lambda: (
            _stats(pd, "decode")["recv_ok"] - d0["recv_ok"] >= n
            and _stats(pd, "prefill")["sent_ok"] - p0["sent_ok"] >= n
        )
    )
    p, d = _stats(pd, "prefill"), _stats(pd, "decode")

    def more(now: dict, then: dict, *keys: str) -> int:
        for key in keys[:-1]:
            now, then = now.get(key, {}), then.get(key, {})
        return int(now.get(keys[-1], 0)) - int(then.get(keys[-1], 0))

    # every request went through kvpush: handed off on the prefill, received on the decode, none failed
    assert more(p, p0, "handoffs") == n and more(p, p0, "sent_ok") == n and more(p, p0, "sent_failed") == 0
    assert more(d, d0, "expects") == n and more(d, d0, "recv_ok") == n and more(d, d0, "recv_failed") == 0
    assert more(p, p0, "send_bytes") == more(d, d0, "recv_bytes") > 0
    # after the first request both legs run at once: the decode's registration often beats the prefill
    assert more(p, p0, "order_counts", "registration_first") >= 1, (p["order_counts"], p0["order_counts"])
    assert _wait(lambda: _kv_usage(prefill.url) == 0.0 and _kv_usage(decode.url) == 0.0), (
        f"blocks still held: prefill {_kv_usage(prefill.url)}, decode {_kv_usage(decode.url)}"
    )


def test_kvpush_figures_appear_on_vllms_own_metrics(pd, model):
    prefill, decode = pd.engines
    client.complete_many(pd.url, model, client.make_prompts(2, [300], seed=9), 4, concurrency=2)

    def figures(url: str) -> tuple[float, float, float]:
        m = client.metrics(url)
        return (
            client.metric(m, "vllm:kvpush_requests_total", outcome="ok"),
            client.metric(m, "vllm:kvpush_bytes_total"),
            client.metric(m, "vllm:kvpush_transfer_seconds_count"),
        )

    # vLLM publishes scheduler stats to its API server on its own cadence: wait for them to catch up
    def caught_up() -> bool:
        p, d = _stats(pd, "prefill"), _stats(pd, "decode")
        return figures(prefill.url)[:2] == (p["sent_ok"], p["send_bytes"]) and figures(decode.url)[:2] == (
            d["recv_ok"],
            d["recv_bytes"],
        )

    assert _wait(caught_up, 30), (figures(prefill.url), figures(decode.url))
    p_ok, p_bytes, p_seconds = figures(prefill.url)
    d_ok, d_bytes, d_seconds = figures(decode.url)
    assert p_ok >= 2 and p_bytes == d_bytes > 0 and p_seconds == p_ok and d_seconds == d_ok
    assert 'role="decode"' in "".join(k for k in client.metrics(decode.url) if k.startswith("vllm:kvpush"))


def test_router_fans_one_prefill_out_to_two_decodes(pd, single, model, logs):
    """1P2D: one prefill, two decodes behind one vllm-router (round robin): outputs equal a single
    engine's, every request pushed to whichever decode the router picked, both decodes used."""
    prompts = client.make_prompts(8, LENGTHS, seed=13)
    want = client.complete_many(single.url, model, prompts, MAX_TOKENS, concurrency=4)
    prefill, decode0 = pd.engines[:2]
    before = len(pd.procs)
    p0, d0 = _stats(pd, "prefill"), _stats(pd, "decode")
    started = time.monotonic()
    try:
        decode1 = add_decode(pd, logs)  # the same stats_dir: its file is named after its engine id
        url = add_router(pd, logs, [prefill.url], [decode0.url, decode1.url], "vllm-router-1p2d")
        up_s = time.monotonic() - started
        first = client.complete_many(url, model, prompts[:1], MAX_TOKENS, concurrency=1)
        got = first + client.complete_many(url, model, prompts[1:], MAX_TOKENS, concurrency=4)
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert len(w) == MAX_TOKENS and g == w, f"prompt {i}: router 1P2D {g} != single {w}"
        n = len(prompts)

        def d1() -> dict:
            path = Path(pd.stats_dir) / f"{decode1.engine_id}-rank0.json"
            return json.loads(path.read_text()) if path.exists() else {"recv_ok": 0, "recv_bytes": 0}

        def received() -> tuple[int, int]:
            return _stats(pd, "decode")["recv_ok"] - d0["recv_ok"], d1()["recv_ok"]

        assert _wait(lambda: sum(received()) >= n and _stats(pd, "prefill")["sent_ok"] - p0["sent_ok"] >= n)
        p, d = _stats(pd, "prefill"), _stats(pd, "decode")
        assert p["sent_ok"] - p0["sent_ok"] == n and p["sent_failed"] == p0["sent_failed"]
        assert sum(received()) == n and min(received()) >= 1, f"decodes received {received()}"
        assert d["recv_failed"] == d0["recv_failed"] and d1()["recv_failed"] == 0
        assert p["send_bytes"] - p0["send_bytes"] == d["recv_bytes"] - d0["recv_bytes"] + d1()["recv_bytes"]
        assert _wait(lambda: all(_kv_usage(e.url) == 0.0 for e in (prefill, decode0, decode1)))
        print(f"1P2D: second decode + router up in {up_s:.0f}s, {n} requests, received {received()}")
    finally:
        for proc in reversed(pd.procs[before:]):  # the second decode and router: not needed after this
            proc.stop()


def test_a_mismatched_pair_never_reaches_the_router(model, logs):
    """vllm-router has no pairing check: the decode's start-up handshake must refuse before traffic."""
    out = logs / "mismatch"
    with pytest.raises(RuntimeError, match="decode exited") as err:
        start_pd("kvpush", model, out, block_size=32, decode_block_size=64, router="vllm-router")
    log = (out / "kvpush-decode.log").read_text(errors="replace")
    assert "cannot receive KV from prefill" in log and "block_size=64" in log, str(err.value)[-2000:]
    assert not (out / "vllm-router.log").exists()  # the router was never started
