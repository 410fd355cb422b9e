"""The client side of tests/vllm/test_netns_vllm.py, run inside one of the two namespaces: the test's own
process lives in the root namespace, which has no route to 192.0.2.0/24, so a client on "host A" is a
process started there. Prints one JSON document on stdout.

    python netns_client.py health URL TIMEOUT_S             # until URL/health answers 200 -> true
    python netns_client.py complete URL MODEL MAX_TOKENS N  # prompts (JSON list) on stdin, N at a time
    python netns_client.py metrics URL                      # {"name{labels}": value}
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

from kvpush.platforms.vllm.tools import client


def healthy(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def main() -> None:
    cmd, url = sys.argv[1], sys.argv[2]
    if cmd == "health":
        out: object = healthy(url, float(sys.argv[3]))
    elif cmd == "complete":
        model, max_tokens, n = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        out = client.complete_many(url, model, json.load(sys.stdin), max_tokens, concurrency=n)
    elif cmd == "metrics":
        out = client.metrics(url)
    else:
        raise SystemExit(f"unknown command {cmd!r}: health, complete or metrics")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
