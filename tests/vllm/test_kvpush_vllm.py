"""Real vLLM (CPU) + real NIXL: kvpush's connector end to end.

The kvpush prefill/decode pair behind the kvpush proxy, with the fast tiny model (2 layers), is the
session's shared fast pair (tests/vllm/shared_engines.py; test_router_vllm.py puts a vllm-router in front
of it too), each test leaving it at rest (conftest.py checks); the reference single engine is the
session's (tests/vllm/reference.py). A third decode with another model checks that a layout mismatch
stops the engine at start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvpush.platforms.vllm.tools import client, disconnect_stress
from kvpush.platforms.vllm.tools.serve_pd import EngineSpec, free_port
from kvpush.platforms.vllm.tools.serve_procs import Started
from kvpush.platforms.vllm.tools.tiny_model import build
from tests.vllm.shared_engines import FAST_PAIR_LEASE_S

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

MAX_TOKENS = 16
LEASE_S = FAST_PAIR_LEASE_S
# 24 prompts from 3 to ~1500 words (about 5 to 3000 tokens): within one block, across blocks, many blocks.
LENGTHS = [3, 17, 60, 127, 128, 129, 250, 400, 700, 1000, 1500, 40]


@pytest.fixture(scope="module")
def model() -> str:
    return str(build("fast"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def pd(fast_pair):
    """The session's shared fast pair (shared_engines.py, lease LEASE_S), left at rest by every test."""
    return fast_pair


def _stats(dep, role: str) -> dict:
    path = Path(dep.stats_dir) / f"kvpush-{role}-rank0.json"
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return json.loads(path.read_text())


def _wait(pred, timeout: float = 20.0, step: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    return pred()


def _complete_or_say_why(dep, model: str, prompt: str, max_tokens: int) -> list[int]:
    """client.complete through the proxy; an error status fails with its body and the processes' logs."""
    try:
        return client.complete(dep.url, model, prompt, max_tokens)
    except urllib.error.HTTPError as exc:
        logs = "\n".join(f"--- {p.name} ({p.log_path}):\n{p.tail(15)}" for p in dep.procs)
        pytest.fail(f"the proxy answered {exc.code}: {exc.read()[:1000]!r}\n{logs}")


def test_outputs_equal_single_engine_token_for_token(pd, single, model: str) -> None:
    prompts = client.make_prompts(24, LENGTHS, seed=7)
    want = client.complete_many(single.url, model, prompts, MAX_TOKENS, concurrency=4)
    got = client.complete_many(pd.url, model, prompts, MAX_TOKENS, concurrency=4)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert len(w) == MAX_TOKENS
        assert g == w, f"prompt {i} ({len(prompts[i].split())} words): P/D {g} != single {w}"


def test_decode_received_kv_and_did_not_recompute_the_prompt(pd, model: str) -> None:
    decode = pd.engines[1]
    before = client.metrics(decode.url)
    prompts = client.make_prompts(4, [300, 900], seed=11)
    client.complete_many(pd.url, model, prompts, 4, concurrency=2)
    after = client.metrics(decode.url)

    def delta(source: str) -> float:
        name = "vllm:prompt_tokens_by_source_total"
        return client.metric(after, name, source=source) - client.metric(before, name, source=source)

    assert delta("external_kv_transfer") > 1000
    assert delta("local_compute") <= len(prompts)  # at most the last prompt token, recomputed
    # the stats files are rewritten at most 4 times a second: wait until both sides caught up
    _wait(lambda: _stats(pd, "prefill")["send_bytes"] == _stats(pd, "decode")["recv_bytes"])
    d, p = _stats(pd, "decode"), _stats(pd, "prefill")
    assert d["recv_ok"] >= 4 and d["recv_bytes"] > 0 and d["endpoint"]["bytes"] > 0
    assert p["send_bytes"] == d["recv_bytes"]
    assert d["recv_failed"] == 0 and p["sent_failed"] == 0
    # arm_writes (default): every prompt was named before the forward pass that completed it
    assert p["named"] >= len(prompts), p
    print("prefill named", p["named"], "armed posts", p["endpoint"].get("armed"))


def _direct(
    url: str, model: str, prompt: str, params: dict, rid: str, max_tokens: int, timeout: float = 120.0
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "kv_transfer_params": params,
        "return_token_ids": True,
    }
    return client.post_json(url + "/v1/completions", body, timeout, {"X-Request-Id": rid})


def test_both_event_orders_occur(pd, single, model: str) -> None:
    prefill, decode = pd.engines
    push = {
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.kv_port,
        "tp_size": 1,
        "pp_size": 1,
    }
    prompt = client.make_prompts(1, [500], seed=3)[0]
    want = client.complete(single.url, model, prompt, 8)
    before = _stats(pd, "prefill")["order_counts"]

    # prefill first: the prefill finishes and holds its blocks; the decode registers later.
    rid = f"order-p-{uuid.uuid4().hex[:8]}"
    _direct(prefill.url, model, prompt, {"do_remote_decode": True}, rid, 1)
    out = _direct(decode.url, model, prompt, dict(push, remote_request_id=rid), rid, 8)
    assert out["choices"][0]["token_ids"] == want

    # registration first: the decode registers, then the prefill runs.
    rid = f"order-r-{uuid.uuid4().hex[:8]}"
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            _direct(decode.url, model, prompt, dict(push, remote_request_id=rid), rid, 8)
        )
    )
    t.start()
    time.sleep(1.5)
    _direct(prefill.url, model, prompt, {"do_remote_decode": True}, rid, 1)
    t.join(60)
    assert result["choices"][0]["token_ids"] == want

    # the stats file is rewritten every 0.5 s: wait until it shows both orders (or time out)
    after = _wait(
        lambda: (
            (c := _stats(pd, "prefill")["order_counts"])["prefill_first"] > before.get("prefill_first", 0)
            and c.get("registration_first", 0) > before.get("registration_first", 0)
            and c
        )
    )
    assert after["prefill_first"] > before.get("prefill_first", 0)
    assert after["registration_first"] > before.get("registration_first", 0)


def _kv_usage(url: str) -> float:
    return client.metric(client.metrics(url), "vllm:kv_cache_usage_perc")


def test_abort_mid_flight_releases_blocks_on_both_sides(pd, model: str) -> None:
    prefill, decode = pd.engines
    # A long prompt through the proxy; the client gives up mid-flight (2000 output tokens take seconds
    # even when the prefill is quick, so the 0.3 s timeout always fires before the answer).
    prompt = client.make_prompts(1, [1800], seed=5)[0]
    t0 = time.monotonic()
    try:
        answer = client.complete(pd.url, model, prompt, 2000, timeout=0.3)
    except (TimeoutError, urllib.error.URLError, OSError):
        pass
    else:  # seen once in CI (2026-12-06), not reproduced: say what came back, and how fast
        pytest.fail(
            f"the client did not give up: {len(answer)} tokens answered in {time.monotonic() - t0:.3f} s "
            f"(a 0.3 s read timeout; 2000 tokens take ~5 s on one core)"
        )
    # A decode whose prefill never comes: the client gives up while the decode waits for KV.
    push = {
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.kv_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": "never",
    }
    with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
        _direct(decode.url, model, prompt, push, f"abort-{uuid.uuid4().hex[:8]}", 8, timeout=1.0)
    assert _wait(lambda: _kv_usage(prefill.url) == 0.0 and _kv_usage(decode.url) == 0.0, timeout=30), (
        f"blocks still held: prefill {_kv_usage(prefill.url)}, decode {_kv_usage(decode.url)}"
    )
    assert _wait(
        lambda: _stats(pd, "decode")["outstanding"] == 0 and _stats(pd, "prefill")["outstanding"] == 0,
        timeout=30,
    )
    # and the pair still serves
    assert len(_complete_or_say_why(pd, model, "import os", 4)) == 4


# waves of 8 early disconnects in CI (a few seconds each on 2 cores); KVPUSH_STRESS_WAVES=10 for a longer run,
# or `python -m kvpush.platforms.vllm.tools.disconnect_stress --waves 50` on a pair of its own
STRESS_WAVES = int(os.environ.get("KVPUSH_STRESS_WAVES", "3"))


def test_waves_of_early_disconnects_leave_nothing_held(pd, model: str) -> None:
    """Issue 16 finding 8: clients closing their sockets 0.05-0.5 s into requests of ~300-1,500 tokens
    through the proxy. After every wave both engines are back to rest within 20 s (KV usage 0, nothing
    running or waiting, kvpush outstanding 0 on both sides), far inside the decode's fence (51 s here).
    One exception, by design: a client that leaves before the decode's API server passed its request to
    the engine (vLLM cancels the handler on disconnect) leaves a decode that never heard of it, so the
    prefill holds that prompt's blocks until its lease (30 s here). Such a wave must have the decode at rest
    at 20 s, the prefill's lease must have ended a push (failed_expired), and everything must be back by the
    lease's bound (a CI run on a quiet box and loaded local runs hit this in 1-3 waves of 10)."""
    prefill, decode = pd.engines
    target = disconnect_stress.Target(pd.url, prefill.url, decode.url, Path(pd.stats_dir), model)
    waves = disconnect_stress.run_waves(
        target, STRESS_WAVES, 8, seed=16, bound_s=20.0, lease_bound_s=disconnect_stress.lease_bound(LEASE_S)
    )
    held = [
        (w.index, w.closed_after_s, w.settled_s, w.lease_expiries, w.at_bound, w.state)
        for w in waves
        if not disconnect_stress.settled_in_bound(w, 20.0)
    ]
    assert not held, (
        f"held past 20 s after a wave of disconnects, the prefill's lease not explaining it: {held}"
    )
    # the waves must have made the decode hold blocks for requests the clients then left
    assert max(w.peak_decode_kv for w in waves) > 0.0
    assert len(client.complete(pd.url, model, "import os", 4)) == 4


def test_a_release_frees_a_prompt_whose_decode_never_had_it_before_the_lease(pd, model: str) -> None:
    """The disconnect race, made on purpose: the prefill computes a prompt for a decode that never hears of
    it (as when a client leaves before the decode's API server passed the request on). The proxy's release
    (GET /kvpush/release on the decode's pairing server, what `kvpush proxy` sends when a client leaves
    before the decode answered) makes the decode tell the prefill, which frees the blocks at once, not at
    its lease (30 s here); the push fails by name as aborted by the decode."""
    prefill, decode = pd.engines
    tid = f"kvp-release-{uuid.uuid4().hex[:12]}"
    params = {"do_remote_decode": True, "transfer_id": tid, "decode_engine_id": decode.engine_id}
    prompt = client.make_prompts(1, [600], seed=41)[0]
    before = _stats(pd, "prefill")
    _direct(prefill.url, model, prompt, params, f"rel-{uuid.uuid4().hex[:8]}", 1, timeout=60)
    assert _kv_usage(prefill.url) > 0.0, "the prefill should hold the prompt's blocks for its push"
    t0 = time.monotonic()
    target = (
        f"/kvpush/release?engine_id={prefill.engine_id}&host=127.0.0.1&port={prefill.kv_port}"
        f"&tp_size=1&pp_size=1&key={tid}-0"
    )
    port = decode.extra_config["pairing_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{target}", timeout=10) as r:
        answer = json.loads(r.read())
    assert answer["cancelled"] == [f"{tid}-0"], answer
    assert _wait(lambda: _kv_usage(prefill.url) == 0.0, timeout=10), "blocks still held after the release"
    assert time.monotonic() - t0 < LEASE_S / 2  # not the lease
    after = _wait(lambda: (s := _stats(pd, "prefill"))["sent_failed"] > before["sent_failed"] and s)
    assert after["endpoint"]["failed_expired"] == before["endpoint"]["failed_expired"]


def test_same_x_request_id_through_the_proxy_both_complete(pd, single, model: str) -> None:
    """Clients may reuse X-Request-Id: the proxy's per-dispatch transfer_id keeps the two transfer keys
    apart, so both requests complete with the right tokens and no block stays held (before, the first
    was never reported on either engine and held its blocks for good)."""
    prefill, decode = pd.engines
    prompts = client.make_prompts(2, [400, 700], seed=21)
    want = [client.complete(single.url, model, p, 8) for p in prompts]
    rid = f"dup-{uuid.uuid4().hex[:8]}"
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            got[i] = client.complete(pd.url, model, prompts[i], 8, timeout=90, headers={"X-Request-Id": rid})
        except (OSError, ValueError, KeyError) as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got.get(0), got.get(1)] == want
    assert _wait(lambda: _kv_usage(prefill.url) == 0.0 and _kv_usage(decode.url) == 0.0, timeout=30), (
        f"blocks still held: prefill {_kv_usage(prefill.url)}, decode {_kv_usage(decode.url)}"
    )
    assert _wait(
        lambda: _stats(pd, "decode")["outstanding"] == 0 and _stats(pd, "prefill")["outstanding"] == 0,
        timeout=30,
    )


def test_colliding_transfer_key_fails_the_newcomer_and_keeps_the_first(pd, single, model: str) -> None:
    """Without a transfer_id (not through kvpush's proxy) two live requests with one X-Request-Id share a
    transfer key: the decode refuses the second at once (its blocks freed) and the first still gets its KV."""
    prefill, decode = pd.engines
    push = {
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.kv_port,
        "tp_size": 1,
        "pp_size": 1,
    }
    prompt = client.make_prompts(1, [300], seed=23)[0]
    want = client.complete(single.url, model, prompt, 8)
    rid = f"clash-{uuid.uuid4().hex[:8]}"
    first: dict = {}
    t = threading.Thread(target=lambda: first.update(_direct(decode.url, model, prompt, push, rid, 8, 90)))
    t.start()
    assert _wait(lambda: _stats(pd, "decode")["outstanding"] >= 1, timeout=20)
    failed_before = _stats(pd, "decode")["recv_failed"]
    t0 = time.monotonic()
    # kv_load_failure_policy "fail": vLLM answers with an error (how it words it is vLLM's business)
    with contextlib.suppress(urllib.error.HTTPError):
        _direct(decode.url, model, prompt, push, rid, 8, timeout=30)
    assert time.monotonic() - t0 < 20, "the colliding request was not refused at once"
    assert _wait(lambda: _stats(pd, "decode")["recv_failed"] > failed_before)
    assert first == {}, "the first request must still be waiting for its KV"
    _direct(prefill.url, model, prompt, {"do_remote_decode": True}, rid, 1)
    t.join(60)
    assert first["choices"][0]["token_ids"] == want
    assert _wait(lambda: _kv_usage(prefill.url) == 0.0 and _kv_usage(decode.url) == 0.0, timeout=30), (
        f"blocks still held: prefill {_kv_usage(prefill.url)}, decode {_kv_usage(decode.url)}"
    )


def test_a_transfer_the_decode_refuses_itself_fails_the_request_on_every_vllm(pd, single, model: str) -> None:
    """kv_transfer_params without the prefill's address: the decode's scheduler side fails the transfer
    before any KV can arrive. The request must end failed (kv_load_failure_policy "fail", vLLM's default
    and this fixture's) or recomputed with the right tokens, never decoded on blocks nobody wrote: before,
    on vLLM < 0.32 (whose only failure channel is get_block_ids_with_load_errors) this failure carried no
    blocks, counted as a successful load and answered 200 with wrong tokens."""
    prefill, decode = pd.engines
    prompt = client.make_prompts(1, [600], seed=31)[0]
    want = client.complete(single.url, model, prompt, 8)
    failed_before = _stats(pd, "decode")["recv_failed"]
    no_host = {"do_remote_prefill": True, "remote_port": prefill.kv_port, "tp_size": 1, "pp_size": 1}
    try:
        out = _direct(decode.url, model, prompt, no_host, f"noaddr-{uuid.uuid4().hex[:8]}", 8, timeout=60)
    except urllib.error.HTTPError:
        out = None  # failed, as the "fail" policy asks
    if out is not None:
        assert out["choices"][0]["token_ids"] == want, "decoded on KV that never arrived"
    assert _wait(lambda: _stats(pd, "decode")["recv_failed"] > failed_before)
    assert _wait(lambda: _kv_usage(decode.url) == 0.0, timeout=30), f"decode holds {_kv_usage(decode.url)}"
    assert client.complete(pd.url, model, prompt, 8) == want  # and the pair still serves


def test_layout_mismatch_fails_at_startup(pd, logs: Path) -> None:
    prefill = pd.engines[0]
    other = str(build("realistic"))  # 32 layers, 1 KV head x 128: cannot take the fast model's KV
    spec = EngineSpec(
        "decode",
        other,
        free_port(),
        "1",
        "kvpush",
        "kvpush-mismatch",
        free_port(),
        max_model_len=4096,
        extra_config={
            "prefill_addresses": [
                {"engine_id": prefill.engine_id, "host": "127.0.0.1", "port": prefill.kv_port}
            ],
            "connect_timeout_s": 60,
        },
    )
    argv, env = spec.command()
    log_path = logs / "mismatch-decode.log"
    proc = Started("mismatch-decode", argv, env, log_path)  # its group, temporary files and /dev/shm: stop()
    try:
        rc = proc.proc.wait(240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"decode with a mismatched layout kept running; log {log_path}")
    finally:
        proc.stop()
    text = log_path.read_text(errors="replace")
    assert rc != 0
    assert "cannot receive KV from prefill" in text and "layout mismatch" in text, text[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
