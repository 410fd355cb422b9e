"""The public surface (kvpush/__init__.py): every name it lists resolves, the error tree is listed once
(errors.__all__) and whole, Failure is public, and importing kvpush stays light."""

from __future__ import annotations

import inspect
import subprocess
import sys

import kvpush
from kvpush import errors
from kvpush.protocol.reasons import Failure


def test_every_public_name_resolves():
    for name in kvpush.__all__:
        assert getattr(kvpush, name) is not None, name
    assert len(set(kvpush.__all__)) == len(kvpush.__all__)


def test_every_error_class_is_public_and_listed_once():
    tree = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.KVPushError)
    }
    assert set(errors.__all__) == tree
    assert tree <= set(kvpush.__all__)
    assert kvpush.PeerGone is errors.PeerGone


def test_failure_kinds_are_public():
    assert kvpush.Failure is Failure and "Failure" in kvpush.__all__


def test_importing_kvpush_pulls_in_no_endpoint_or_transport():
    code = "import sys, kvpush; kvpush.Failure; print(' '.join(sorted(sys.modules)))"
    mods = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert not [m for m in mods.split() if m.startswith(("kvpush.endpoint", "kvpush.transport", "zmq"))]
