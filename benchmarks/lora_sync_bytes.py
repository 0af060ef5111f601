"""Bytes per weight sync of a LoRA policy: adapter only (`model.lora_sync adapter`) vs merged.

Computed from the shapes alone: each model is built on the meta device (no weights, no download)
from its published config, wrapped with the LoRA `rl-launch` applies (`rl_learner.apply_lora`,
all-linear), and the two layouts the sender would use are planned (`rl_learner.adapter_layout`,
`rl_learner.sync_layout`) in the engine's dtype. The bytes are exactly what one sync moves over any
transport (bucket padding included).

    python benchmarks/lora_sync_bytes.py                       # tiny, Qwen2.5-0.5B, Qwen2.5-7B
    python benchmarks/lora_sync_bytes.py --ranks 8 16 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch

# Published configs (Hugging Face config.json) of the shapes compared; the tiny one is rl_data.tiny's.
SHAPES = {
    "tiny (rl_data.tiny)": dict(  # build_tiny_checkpoint's model, with its tokenizer's 485 ids
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=485, tie_word_embeddings=False, max_position_embeddings=2048,
    ),
    "Qwen2.5-0.5B": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "Qwen2.5-7B": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
    ),
}  # fmt: skip


def meta_model(name: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[name]))


def sync_bytes(name: str, rank: int, dtype: torch.dtype) -> tuple[int, int]:
    """(adapter bytes, merged bytes) of one sync of `name` with LoRA rank `rank` in `dtype`."""
    from rl_learner import LoraOptions, adapter_layout, apply_lora, sync_layout

    with torch.device("meta"):
        model = apply_lora(meta_model(name), LoraOptions(rank=rank))
    return adapter_layout(model, dtype=dtype).total_bytes, sync_layout(model, dtype=dtype).total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 64])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"| model | rank | adapter per sync | merged per sync | merged / adapter |  ({args.dtype})")
    print("| --- | --- | --- | --- | --- |")
    for name in args.shapes:
        for rank in args.ranks:
            adapter, merged = sync_bytes(name, rank, dtype)
            print(
                f"| {name} | {rank} | {adapter / 2**20:,.2f} MiB | {merged / 2**20:,.1f} MiB | {merged / adapter:.1f}x |"
            )


if __name__ == "__main__":
    main()
