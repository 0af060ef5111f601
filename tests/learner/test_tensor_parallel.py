"""Tensor parallelism's plan and refusals (`rl_learner.tensor_parallel`, `DeepSpeedConfig.tensor_parallel_size`).

The two-rank FSDP × TP = 1 × 2 step against one rank, and its weight sync, run in
tests/learner/test_fsdp2.py's slow two-rank test (`_worker_fsdp2.tensor_parallel_step`).
"""

from __future__ import annotations

import pytest
from transformers import Qwen2Config, Qwen2MoeConfig

from rl_learner import DeepSpeedConfig
from rl_learner.fsdp2 import fsdp2_refusals
from rl_learner.tensor_parallel import layer_plan, tensor_parallel_refusals


def test_the_plan_splits_q_k_v_gate_up_by_columns_and_o_down_by_rows():
    plan = {name: type(style).__name__ for name, style in layer_plan().items()}
    assert plan == {
        "self_attn.q_proj": "ColwiseParallel",
        "self_attn.k_proj": "ColwiseParallel",
        "self_attn.v_proj": "ColwiseParallel",
        "mlp.gate_proj": "ColwiseParallel",
        "mlp.up_proj": "ColwiseParallel",
        "self_attn.o_proj": "RowwiseParallel",
        "mlp.down_proj": "RowwiseParallel",
    }


QWEN2 = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, intermediate_size=512)


def test_refusals_name_the_head_count_that_does_not_divide():
    assert tensor_parallel_refusals(QWEN2, 1) == []
    assert tensor_parallel_refusals(QWEN2, 2) == []
    assert tensor_parallel_refusals(QWEN2, 4) == [
        "num_key_value_heads 2 is not divisible by tensor_parallel_size 4"
    ]
    assert tensor_parallel_refusals(QWEN2, 3) == [
        "num_attention_heads 4 is not divisible by tensor_parallel_size 3",
        "num_key_value_heads 2 is not divisible by tensor_parallel_size 3",
        "intermediate_size 512 is not divisible by tensor_parallel_size 3",
    ]
    # a config.json's dict, and a model without a separate kv head count (multi-head attention)
    llama = {
        "model_type": "llama",
        "num_attention_heads": 6,
        "num_key_value_heads": None,
        "intermediate_size": 96,
    }
    assert tensor_parallel_refusals(llama, 3) == []
    assert tensor_parallel_refusals(llama, 4) == [
        "num_attention_heads 6 is not divisible by tensor_parallel_size 4",
        "num_key_value_heads 6 is not divisible by tensor_parallel_size 4",
    ]


def test_a_model_outside_the_qwen2_llama_family_is_refused_by_its_type():
    assert tensor_parallel_refusals(Qwen2MoeConfig(), 2) == [
        "model_type 'qwen2_moe' has no tensor-parallel plan (plans exist for qwen2, llama)"
    ]


def test_tensor_parallelism_needs_fsdp2_and_is_refused_with_cpu_offload():
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 needs backend 'fsdp2'.*AutoTP"):
        DeepSpeedConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 0 is not an integer >= 1"):
        DeepSpeedConfig(backend="fsdp2", tensor_parallel_size=0)
    assert fsdp2_refusals(DeepSpeedConfig(backend="fsdp2", tensor_parallel_size=2)) == []
    refused = fsdp2_refusals(DeepSpeedConfig(backend="fsdp2", tensor_parallel_size=2, offload_optimizer=True))
    assert [field for field, _ in refused] == ["tensor_parallel_size"]
