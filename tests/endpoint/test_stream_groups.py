"""Streamed ranges (kv_ready) and KV-cache groups: a range moves one full-attention group's table; a layout
with several groups or a window is refused by name, and the single-table forms are the same request."""

from __future__ import annotations

import pytest

from kvpush.endpoint.base import stream_table
from kvpush.errors import LayoutError
from kvpush.protocol.groups import single_table
from kvpush.protocol.layout import KVLayout


def _layout(**kw: object) -> KVLayout:
    base: dict[str, object] = dict(
        num_layers=4, block_size=4, num_blocks=32, total_kv_heads=2, head_dim=8, dtype_size=2
    )
    base.update(kw)
    return KVLayout(**base)  # type: ignore[arg-type]


def test_one_group_tables_in_either_form_stream_as_one_table() -> None:
    layout = _layout()
    assert stream_table(layout, "r", [3, 4, 5], 10) == (3, 4, 5)
    assert stream_table(layout, "r", [[3, 4, 5]], 10) == (3, 4, 5)
    assert single_table(((1, 2), (3, 4))) is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(layer_group=(0, 0, 1, 1), group_window=(0, 0)), "2 group"),
        (dict(group_window=(8,)), "windows"),
    ],
)
def test_kv_ready_refuses_groups_and_windows_by_name(kw: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        stream_table(_layout(**kw), "r", [[3, 4, 5], [6, 7, 8]] if "layer_group" in kw else [3, 4, 5], 10)
