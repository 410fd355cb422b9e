"""`kvpush proxy`'s command line: the flags, the ProxyConfig they make, and serving it (the package
docstring says what the proxy does). Also `python -m kvpush.platforms.vllm.proxy`."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from kvpush.apps.cliutil import log_level, port, positive_float
from kvpush.config import key_from_file_or_env
from kvpush.errors import ConfigError

from ..params import check_pp_size
from .app import build_app
from .config import ProxyConfig, ProxyMode
from .pairing import PrefillBackend
from .server import TIMINGS_TOKEN_ENV, load_timings_token, run_server

log = logging.getLogger("kvpush.proxy")


def _expand(values: list[Any] | None, n: int, default: Any, name: str) -> list[Any]:
    if not values:
        return [default] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise SystemExit(f"--{name} was given {len(values)} times; give it once or once per --prefill ({n})")
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000)
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="prefill backend base URL (repeat for several; round robin)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode backend base URL (repeat for several; round robin)",
    )
    parser.add_argument(
        "--mode",
        type=ProxyMode,
        choices=list(ProxyMode),
        default=ProxyMode.PUSH,
        help="push: concurrent dispatch (kvpush, NixlPushConnector); pull: prefill first (NixlConnector)",
    )
    parser.add_argument("--prefill-engine-id", action="append", help="engine_id of each prefill")
    parser.add_argument("--prefill-kv-host", action="append", help="KV side-channel host of each prefill")
    parser.add_argument(
        "--prefill-kv-port", action="append", type=int, help="KV side-channel port of each prefill"
    )
    parser.add_argument(
        "--decode-pairing",
        action="append",
        metavar="URL",
        help="base URL of each kvpush decode's pairing check (its pairing_port); checked at start and on "
        "/health (give it once per --decode, '' for a decode without one)",
    )
    parser.add_argument(
        "--decode-engine-id",
        action="append",
        metavar="ID",
        help="engine_id of each decode (once per --decode, '' to learn it from its pairing check): sent "
        "with the prefill leg, so the prefill pushes only to the decode the request went to",
    )
    parser.add_argument(
        "--hmac-key-file",
        metavar="PATH",
        help="the decodes' shared key (base64, not world-readable), to sign --decode-pairing checks; "
        "or $KVPUSH_HMAC_KEY (never the key itself on the command line)",
    )
    parser.add_argument("--prefill-tp-size", action="append", type=int)
    parser.add_argument("--prefill-pp-size", action="append", type=int)
    parser.add_argument("--connect-timeout", type=positive_float, default=5.0)
    parser.add_argument("--request-timeout", type=positive_float, default=600.0)
    parser.add_argument(
        "--backend-keepalive",
        type=positive_float,
        default=ProxyConfig.backend_keepalive_s,
        help="seconds an idle connection to a backend is reused; keep it below the backends' own "
        "keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default) (default: %(default)s)",
    )
    parser.add_argument("--log-level", type=log_level, default="WARNING")
    d = ProxyConfig(prefill=[], decode=[])
    limits = parser.add_argument_group("client-facing limits (SECURITY.md, 'The proxy')")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body; larger ones get 413 (default: %(default)s)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        help="seconds a client has to send its whole body; then 408 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-json-depth",
        type=int,
        default=d.max_json_depth,
        help="deepest object/array nesting in a body; deeper gets 400 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-request-id-len",
        type=int,
        default=d.max_request_id_len,
        help="longest X-Request-Id kept (characters A-Z a-z 0-9 . _ : -); any other id is replaced by "
        "a fresh one, named in the response's X-Request-Id (default: %(default)s)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open client connections; beyond it the longest-idle one is closed (default: %(default)s)",
    )
    limits.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        help="seconds an idle connection (or one still sending headers) stays open (default: %(default)s)",
    )
    limits.add_argument(
        "--write-timeout",
        type=float,
        default=d.write_timeout_s,
        help="seconds a client may take to accept a chunk of a streamed answer before it is dropped and "
        "its request cancelled (default: %(default)s)",
    )
    timings = parser.add_argument_group("GET /kvpush/timings (off unless --timings)")
    timings.add_argument(
        "--timings",
        action="store_true",
        help="serve per-request timestamps to 'Authorization: Bearer <token>'; the token comes from "
        f"--timings-token-file or ${TIMINGS_TOKEN_ENV} (at least 16 characters), never the command line",
    )
    timings.add_argument("--timings-token-file", metavar="PATH", help="file holding the timings token")
    timings.add_argument(
        "--timings-max-records",
        type=int,
        default=d.timings_max_records,
        help="records kept, the oldest dropped first (default: %(default)s)",
    )


def _pairing_key(path: str | None) -> bytes | None:
    """The shared key for signing pairing checks, by the connector's own rules (kvpush.config)."""
    try:
        key, _source = key_from_file_or_env(path, os.environ)
    except ConfigError as exc:
        raise SystemExit(f"kvpush proxy: {exc}") from None
    return key


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    n = len(args.prefill)
    ids = _expand(args.prefill_engine_id, n, "", "prefill-engine-id")
    hosts = _expand(args.prefill_kv_host, n, "127.0.0.1", "prefill-kv-host")
    ports = _expand(args.prefill_kv_port, n, 0, "prefill-kv-port")
    tps = _expand(args.prefill_tp_size, n, 1, "prefill-tp-size")
    pps = _expand(args.prefill_pp_size, n, 1, "prefill-pp-size")
    for pp in pps:
        try:
            check_pp_size(pp, "kvpush proxy: --prefill-pp-size")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    mode = ProxyMode(args.mode)
    if mode is ProxyMode.PUSH and (not all(ids) or not all(ports)):
        raise SystemExit("push mode needs --prefill-engine-id and --prefill-kv-port for each --prefill")
    prefill = [
        PrefillBackend(u.rstrip("/"), i, h, p, t, q)
        for u, i, h, p, t, q in zip(args.prefill, ids, hosts, ports, tps, pps, strict=True)
    ]
    decode = [u.rstrip("/") for u in args.decode]
    pairing = list(args.decode_pairing or [])
    if pairing and len(pairing) != len(decode):
        raise SystemExit(f"--decode-pairing was given {len(pairing)} times; give it once per --decode")
    decode_ids = list(args.decode_engine_id or [])
    if decode_ids and len(decode_ids) != len(decode):
        raise SystemExit(f"--decode-engine-id was given {len(decode_ids)} times; give it once per --decode")
    return ProxyConfig(
        prefill=prefill,
        decode=decode,
        mode=mode,
        decode_pairing=pairing,
        decode_engine_ids=decode_ids,
        pairing_key=_pairing_key(args.hmac_key_file) if pairing else None,
        connect_timeout_s=args.connect_timeout,
        request_timeout_s=args.request_timeout,
        backend_keepalive_s=args.backend_keepalive,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
        max_json_depth=args.max_json_depth,
        max_request_id_len=args.max_request_id_len,
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout,
        write_timeout_s=args.write_timeout,
        timings_token=load_timings_token(args.timings_token_file) if args.timings else "",
        timings_max_records=args.timings_max_records,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.timings_token_file and not args.timings:
        raise SystemExit("--timings-token-file is given but --timings is not")
    cfg = config_from_args(args)
    try:
        app = build_app(cfg)
    except ValueError as exc:
        raise SystemExit(f"kvpush proxy: {exc}") from None
    # server.server_options: handler cancellation (a client that goes away cancels dispatch, which
    # cancels both backend requests), idle timeout, and the connection guard
    run_server(app, args.host, args.port, cfg.idle_timeout_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvpush.platforms.vllm.proxy` (the same as `kvpush proxy`)."""
    parser = argparse.ArgumentParser(prog="kvpush proxy")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
