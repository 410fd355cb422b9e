"""Layer-group push on the prefill: which groups of layers a forward pass has finished writing.

vLLM calls the connector's save_kv_layer(layer_name, ...) right after each attention layer has written its
KV (vllm/model_executor/layers/attention/kv_transfer_utils.py, `maybe_transfer_kv_layer`, on CPU too).
The cache's layers are numbered in kv_caches' order (layout_probe.probe_layout); a group is
`per_group` consecutive layers of that numbering. A group is reported once every one of its layers has
been saved in this step, whatever order the calls come in, so a range never names a layer still being
computed.
"""

from __future__ import annotations

from collections.abc import Sequence


class LayerGroups:
    """Per-step completion of fixed-size layer groups (engine thread only)."""

    def __init__(self, layer_names: Sequence[str], per_group: int) -> None:
        if per_group <= 0:
            raise ValueError(f"per_group must be > 0, got {per_group}")
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(layer_names)
        self.per_group = per_group
        self.bounds = [
            (lo, min(lo + per_group, self.num_layers)) for lo in range(0, self.num_layers, per_group)
        ]
        self._saved = [False] * self.num_layers
        self._left = [hi - lo for lo, hi in self.bounds]

    def reset(self) -> None:
        """A new forward pass: nothing of it is saved yet."""
        self._saved = [False] * self.num_layers
        self._left = [hi - lo for lo, hi in self.bounds]

    def saved(self, layer_name: str) -> tuple[int, int] | None:
        """Layer `layer_name` is written; the layer range [l0, l1) of its group if that completes it.
        A name outside the cache (a layer sharing another's KV) and a repeated call complete nothing."""
        layer = self.index.get(layer_name)
        if layer is None or self._saved[layer]:
            return None
        self._saved[layer] = True
        g = layer // self.per_group
        self._left[g] -= 1
        return self.bounds[g] if self._left[g] == 0 else None
