"""What the learner benchmarks share (`sequence_parallel.py`, `fsdp2_vs_zero3.py`, run as scripts
from this folder): a process's memory peak read from /proc, and the Qwen2 model they train.

    before = reset_peak()                        # RSS now; VmHWM reset to it
    ...                                          # the work measured
    peak = status_kib("VmHWM") * 1024 - before   # bytes above the RSS before
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import re
from typing import Any

import torch


def status_kib(field: str) -> int:
    """A /proc/self/status field in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE).group(1))


def reset_peak() -> int:
    """Return freed memory to the OS, reset VmHWM to the current RSS; the RSS in bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return status_kib("VmRSS") * 1024


def qwen2_model(args: argparse.Namespace, **config: Any) -> torch.nn.Module:
    """An fp32 Qwen2 of the benchmark's `--vocab --hidden --intermediate --layers --heads --kv-heads`
    (untied embeddings, sdpa; `config` adds to or overrides that), seeded 0."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    settings = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**{**settings, **config}), dtype=torch.float32)
