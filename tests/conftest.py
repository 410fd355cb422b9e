"""Tests run on one host: UCX stays on loopback unless a test (or the environment) says otherwise.

kvpush itself leaves UCX_NET_DEVICES alone by default (a cross-host deployment must not be pinned to
loopback); the two-host tests (tests/e2e/test_netns*.py) set their own environment for their processes.
"""

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
