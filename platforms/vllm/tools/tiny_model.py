"""Build tiny models offline, with a per-rank KV geometry like a real model's.

No model can be downloaded on CI machines, so tests and benchmarks build one: a byte-level BPE tokenizer
trained on text that ships with Python, and a config with random weights. Compute stays cheap (small
hidden size) while the KV cache keeps a realistic shape: many layers and one or two KV heads of 128 dims,
so bytes and descriptors per request look like one TP rank of a large model.

Besides Llama, one family per KV-cache kind kvpush must move (issue 19), each the smallest model that
makes vLLM build that cache:
  * `deepseek_v2`: MLA, one 576-wide latent per token and layer (kv_lora_rank 512 + 64 rope dims), dense
    MLPs (no MoE: MLA is what matters);
  * `gemma3`: local (sliding-window) and global layers, so vLLM's hybrid manager makes several KV-cache
    groups;
  * `mistral`: a sliding window on every layer (one window group);
  * `gpt_oss`: alternating window / full layers, attention sinks and a tiny MoE.

The build is deterministic (fixed seeds) and cached: the directory name encodes the geometry, and a
finished build leaves a `.complete` marker, so concurrent builders and interrupted builds are safe.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

DEFAULT_CACHE = Path(os.environ.get("KVPUSH_MODEL_CACHE", Path.home() / ".cache" / "kvpush" / "models"))


@dataclass(frozen=True)
class TinyModelSpec:
    num_layers: int = 32
    hidden_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 128
    intermediate_size: int = 256
    vocab_size: int = 4096
    max_position: int = 16384
    dtype: str = "float32"
    init_std: float = 0.2  # peaked logits keep greedy decoding far from ties
    seed: int = 0
    family: str = "llama"  # llama | deepseek_v2 | gemma3 | mistral | gpt_oss
    sliding_window: int = 0  # tokens; gemma3 / mistral / gpt_oss
    global_every: int = 0  # gemma3: every n-th layer is global (full attention), the others local
    kv_lora_rank: int = 0  # deepseek_v2: the latent's width (+ rope_dim = what the cache holds per token)
    rope_dim: int = 0
    num_experts: int = 0  # gpt_oss: experts per MoE layer (2 of them per token)

    @property
    def name(self) -> str:
        shape = f"l{self.num_layers}-h{self.hidden_size}-kv{self.num_kv_heads}x{self.head_dim}"
        tail = f"-{self.dtype}-v{self.vocab_size}-s{self.seed}"
        if self.family == "llama":
            return f"tiny-llama-{shape}{tail}"
        extra = f"-w{self.sliding_window}" if self.sliding_window else ""
        if self.global_every:
            extra += f"-g{self.global_every}"
        if self.kv_lora_rank:
            extra += f"-mla{self.kv_lora_rank}+{self.rope_dim}"
        if self.num_experts:
            extra += f"-e{self.num_experts}"
        return f"tiny-{self.family.replace('_', '')}-{shape}{extra}{tail}"


# Named variants: "fast" for correctness tests, "realistic" (32 KiB/token, like Qwen3-32B per TP8 rank).
VARIANTS: dict[str, TinyModelSpec] = {
    "fast": TinyModelSpec(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64),
    "realistic": TinyModelSpec(num_layers=32, dtype="float32"),
    "realistic-bf16": TinyModelSpec(num_layers=64, dtype="bfloat16"),
    # issue 19's cache kinds, small enough for a 2-core CI box (block sizes are vLLM's choice per kind)
    "mla": TinyModelSpec(
        family="deepseek_v2",
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        kv_lora_rank=512,
        rope_dim=64,
    ),
    "hybrid": TinyModelSpec(
        family="gemma3",
        num_layers=6,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        sliding_window=64,
        global_every=3,
    ),
    "window": TinyModelSpec(
        family="mistral",
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        sliding_window=64,
    ),
    "gptoss": TinyModelSpec(
        family="gpt_oss",
        num_layers=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        sliding_window=64,
        num_experts=4,
    ),
}
# vLLM 0.29's CPU attention with sinks runs bf16 only ("expected scalar type BFloat16 but found Float" from
# cpu_attention_with_kv_cache on the float32 model): the same weights, stored in bf16, for the 0.29 runs
VARIANTS["gptoss-bf16"] = replace(VARIANTS["gptoss"], dtype="bfloat16")
# On a CPU with AMX tiles vLLM's default MLA backend is AMX_MLA, which loads bf16/fp16/int8 weights only
VARIANTS["mla-bf16"] = replace(VARIANTS["mla"], dtype="bfloat16")


def _training_text(limit_bytes: int = 4_000_000) -> list[str]:
    """Text that exists on every machine with Python: the standard library's sources and docstrings."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def _build_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": spec.max_position,
                "clean_up_tokenization_spaces": False,
                # A plain chat template so /v1/chat/completions works.
                "chat_template": (
                    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}"
                ),
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


def _hf_config(spec: TinyModelSpec, vocab_size: int) -> Any:
    """The transformers config of a spec's family (the fields every family shares, then its own)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position,
        "initializer_range": spec.init_std,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
    }
    if spec.family == "llama":
        return transformers.LlamaConfig(head_dim=spec.head_dim, **common)
    if spec.family == "mistral":
        return transformers.MistralConfig(
            head_dim=spec.head_dim, sliding_window=spec.sliding_window, **common
        )
    if spec.family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.rope_dim,
            qk_nope_head_dim=spec.head_dim,
            v_head_dim=spec.head_dim,
            q_lora_rank=None,
            first_k_dense_replace=spec.num_layers,  # every layer dense: the MLA cache is the point
            n_routed_experts=1,
            n_shared_experts=1,
            moe_intermediate_size=spec.intermediate_size,
            **common,
        )
    if spec.family == "gemma3":
        kinds = [
            "full_attention" if (i + 1) % spec.global_every == 0 else "sliding_attention"
            for i in range(spec.num_layers)
        ]
        return transformers.Gemma3TextConfig(
            head_dim=spec.head_dim,
            sliding_window=spec.sliding_window,
            layer_types=kinds,
            query_pre_attn_scalar=spec.head_dim,
            **common,
        )
    if spec.family == "gpt_oss":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)]
        return transformers.GptOssConfig(
            head_dim=spec.head_dim,
            sliding_window=spec.sliding_window,
            layer_types=kinds,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=2,
            **common,
        )
    raise ValueError(f"unknown tiny model family {spec.family!r}")


def _build_weights(spec: TinyModelSpec, out: Path, vocab_size: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    config = _hf_config(spec, vocab_size)
    torch.manual_seed(spec.seed)
    # Llama as before the other families existed (the same weights); the others by their config
    make = LlamaForCausalLM if spec.family == "llama" else AutoModelForCausalLM.from_config
    model = make(config)
    with torch.no_grad():
        # Keep the residual stream from blowing up with large init: scale output projections down.
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                param.mul_(0.1)
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.save_pretrained(str(out), safe_serialization=True)
    # EOS never sampled: outputs always run to max_tokens, so lengths are exactly comparable.
    gen = {"bos_token_id": 0, "eos_token_id": 1}
    (out / "generation_config.json").write_text(json.dumps(gen))


def build(spec: TinyModelSpec | str = "fast", cache_dir: Path | str | None = None) -> Path:
    """Return the directory of the model, building it first if needed."""
    if isinstance(spec, str):
        spec = VARIANTS[spec]
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    target = cache / spec.name
    if (target / ".complete").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=spec.name + ".", dir=cache))
    try:
        _build_tokenizer(spec, tmp)
        vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
        _build_weights(spec, tmp, vocab_size=max(len(vocab), 8))
        (tmp / "kvpush_spec.json").write_text(json.dumps(asdict(spec)))
        (tmp / ".complete").write_text("ok\n")
        try:
            tmp.rename(target)
        except OSError:  # another builder won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="fast", choices=sorted(VARIANTS))
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args(argv)
    print(build(args.variant, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
