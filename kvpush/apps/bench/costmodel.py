"""The cost model: how long an emulated engine step takes, and how the KV geometry is scaled.

Numbers live in a TOML file next to this module (with the source of each one written next to it);
this module only reads them and turns them into step times and KV layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from kvpush.protocol.layout import KVLayout

DEFAULT_MODEL = "qwen3_32b_tp8_h200.toml"


@dataclass(frozen=True)
class CostModel:
    raw: dict[str, Any] = field(repr=False)
    source: str = DEFAULT_MODEL

    # ---- loading --------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        if path is None:
            text = resources.files("kvpush.apps.bench").joinpath(DEFAULT_MODEL).read_text()
            return cls(tomllib.loads(text), DEFAULT_MODEL)
        p = Path(path)
        return cls(tomllib.loads(p.read_text()), str(p))

    @classmethod
    def from_spec(cls, spec: str | dict[str, Any] | None) -> CostModel:
        """spec: None (default file), a path, or {"path": ..., "overrides": {section: {key: value}}}."""
        if not isinstance(spec, dict):
            return cls.load(spec)
        base = cls.load(spec.get("path"))
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in base.raw.items()}
        for section, values in (spec.get("overrides") or {}).items():
            raw.setdefault(section, {}).update(values)
        return cls(raw, base.source + (" + overrides" if spec.get("overrides") else ""))

    def _get(self, section: str, key: str) -> Any:
        try:
            return self.raw[section][key]
        except KeyError:
            raise KeyError(f"cost model {self.source}: missing [{section}] {key}") from None

    # ---- compute ----------------------------------------------------------------------------------
    def prefill_step_s(self, chunks: list[tuple[int, int]]) -> float:
        """chunks: (start position, tokens) of each request's chunk in this step."""
        if not chunks:
            return 0.0
        tokens = sum(n for _, n in chunks)
        ctx = sum(n * (start + n / 2.0) for start, n in chunks)
        ms = (
            self._get("prefill", "step_fixed_ms")
            + self._get("prefill", "per_token_ms") * tokens
            + self._get("prefill", "per_token_ctx_ms") * ctx
        )
        return float(ms / 1e3)

    def prefill_alone_s(self, tokens: int) -> float:
        """Compute time of one prompt alone (for reports), chunked like the engine does."""
        budget = self.prefill_budget
        total, start = 0.0, 0
        while start < tokens:
            n = min(budget, tokens - start)
            total += self.prefill_step_s([(start, n)])
            start += n
        return total

    def decode_step_s(self, batch: int, ctx_tokens: int) -> float:
        if batch == 0:
            return float(self._get("decode", "empty_step_ms") / 1e3)
        ms = (
            self._get("decode", "step_fixed_ms")
            + self._get("decode", "per_seq_ms") * batch
            + self._get("decode", "per_ctx_token_ms") * ctx_tokens
        )
        return float(ms / 1e3)

    @property
    def prefill_budget(self) -> int:
        return int(self._get("prefill", "max_num_batched_tokens"))

    @property
    def prefill_max_seqs(self) -> int:
        return int(self._get("prefill", "max_num_seqs"))

    @property
    def decode_max_seqs(self) -> int:
        return int(self._get("decode", "max_num_seqs"))

    def aged_pool(self, role: str) -> Any:
        """The role's BlockPool, churned like a server that has run for a while ([emulation] aging)."""
        from kvpush.apps.blocks import BlockPool
        from kvpush.protocol.layout import blocks_for

        lay = self.layout(role)
        pool = BlockPool(lay.num_blocks)
        em = self.raw.get("emulation", {})
        wraps = float(em.get("pool_aging_wraps", 0))
        lens = [int(x) for x in em.get("age_input_lens", [1000, 4000, 8000, 16000])]
        out = int(em.get("age_output_len", 128)) if role == "decode" else 0
        if wraps > 0:
            pool.age(
                [blocks_for(n + out, lay.block_size) for n in lens],
                int(self._get(role, "max_num_seqs")),
                int(wraps * lay.num_blocks),
            )
        return pool

    # ---- network ----------------------------------------------------------------------------------
    def post_cost_s(self, num_descriptors: int) -> float:
        """CPU time a NIC's postXfer keeps the posting thread busy (not the copy itself)."""
        us = (
            self._get("network", "post_fixed_us")
            + self._get("network", "post_us_per_descriptor") * num_descriptors
        )
        return float(us / 1e6)

    def posted_descriptors(
        self, plan_descs: int, src_blocks: list[int], dst_blocks: list[int], layout: KVLayout
    ) -> int:
        """How many descriptors vLLM's pull posts for this block pairing.

        "in-order" (vLLM + NIXL): one descriptor per (K|V plane, block) in block-table order; NIXL merges
        a descriptor into the previous one only when both sides continue it (nixl issue #1514: ~160 merged
        vs 18,880 fragmented). "sorted": kvpush's planner, which sorts before merging (never more).
        """
        how = self.raw.get("pull", {}).get("descriptor_merge", "in-order")
        if how == "sorted":
            return plan_descs
        s, d = src_blocks, dst_blocks
        breaks = sum(1 for i in range(len(s) - 1) if not (s[i + 1] == s[i] + 1 and d[i + 1] == d[i] + 1))
        return (breaks + 1) * layout.num_layers * layout.kv_per_layer

    @staticmethod
    def sorted_descriptors(
        src_blocks: list[int], dst_blocks: list[int], num_tokens: int, layout: KVLayout
    ) -> int:
        """How many descriptors kvpush's planner (kvpush.protocol.plan.build_plan) posts for this pairing.

        It sorts the (source, destination) block pairs by source and merges runs contiguous on both
        sides, per (K|V) plane; a partial last block can only end a run. Counted on block ids in
        O(blocks) (the planner itself works on 128 planes x blocks pieces); tests check the two agree.
        """
        import numpy as np

        n = len(src_blocks)
        if n == 0:
            return 0
        s, d = np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks[:n], dtype=np.int64)
        partial = np.zeros(n, dtype=bool)
        partial[n - 1] = num_tokens % layout.block_size != 0
        order = np.argsort(s, kind="stable")
        s, d, partial = s[order], d[order], partial[order]
        breaks = int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1) | partial[:-1]))
        return (breaks + 1) * layout.num_layers * layout.kv_per_layer

    def reference_transfer_s(self, num_tokens: int) -> float:
        """What the real (unscaled) bytes would take on the reference per-rank link."""
        return float(
            num_tokens * self.real_bytes_per_token / (self._get("network", "per_rank_gbytes_s") * 1e9)
        )

    # ---- geometry ---------------------------------------------------------------------------------
    @property
    def real_bytes_per_token(self) -> int:
        m = self.raw["model"]
        heads_per_rank = max(1, m["total_kv_heads"] // m["tp_size"])
        return int(m["num_layers"] * 2 * heads_per_rank * m["head_dim"] * m["dtype_size"])

    @property
    def kv_bytes_scale(self) -> int:
        return int(self._get("emulation", "kv_bytes_scale"))

    def layout(self, role: str) -> KVLayout:
        """The emulated per-rank layout: real layers, K/V planes, block size, heads; bytes scaled.

        The scale shrinks head_dim (bytes of one (token, head) unit), never the number of planes or
        blocks, so descriptor counts equal the real model's.
        """
        m = self.raw["model"]
        scale = self.kv_bytes_scale
        unit = m["head_dim"] * m["dtype_size"]
        if unit % scale:
            raise ValueError(f"kv_bytes_scale {scale} must divide head bytes {unit}")
        head_dim = unit // scale // m["dtype_size"] or 1
        dtype = m["dtype_size"] if (unit // scale) % m["dtype_size"] == 0 else 1
        if dtype == 1:
            head_dim = unit // scale
        blocks = int(self._get("emulation", f"{role}_num_blocks"))
        return KVLayout(
            num_layers=m["num_layers"],
            block_size=m["block_size"],
            num_blocks=blocks,
            total_kv_heads=m["total_kv_heads"],
            head_dim=head_dim,
            dtype_size=dtype,
            tp_rank=0,
            tp_size=m["tp_size"],
            model_tag=f"{m['name']}/scaled1:{scale}",
        )

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "prefill_16k_ms": round(self.prefill_alone_s(16000) * 1e3, 1),
            "prefill_1k_ms": round(self.prefill_alone_s(1000) * 1e3, 1),
            "decode_step_b1_ms": round(self.decode_step_s(1, 1000) * 1e3, 2),
            "wire_16k_ms": round(self.reference_transfer_s(16000) * 1e3, 2),
            "pool_bytes": {
                r: self.layout(r).bytes_per_token * self.layout(r).block_size * self.layout(r).num_blocks
                for r in ("prefill", "decode")
            },
            "real_kv_bytes_per_token_per_rank": self.real_bytes_per_token,
            "kv_bytes_scale": self.kv_bytes_scale,
            **{k: v for k, v in self.raw.items()},
        }
