"""Learner config structs, the DeepSpeed dict they produce, the optimizer choice and the LR curve."""

from __future__ import annotations

import itertools
import math
import os
import sys

import msgspec
import pytest
import torch

from rl_learner.config import (
    DeepSpeedConfig,
    OptimizerConfig,
    build_optimizer,
    build_scheduler,
    deepspeed_config,
    lr_factor,
    torch_dtype,
)

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_defaults_follow_openrlhf():
    optim, ds = OptimizerConfig(), DeepSpeedConfig()
    assert optim.betas == (0.9, 0.95)
    assert (optim.scheduler, optim.warmup_ratio, optim.min_lr_ratio, optim.grad_clip) == (
        "cosine",
        0.03,
        0.1,
        1.0,
    )
    assert (ds.zero_stage, ds.dtype, ds.attn_implementation) == (2, "bf16", "sdpa")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DeepSpeedConfig(zero_stage=4), r"zero_stage: 4 is not one of 0, 1, 2, 3"),
        (lambda: DeepSpeedConfig(dtype="fp8"), r"dtype: 'fp8' is not one of 'bf16', 'fp16', 'fp32'"),
        (
            lambda: DeepSpeedConfig(attn_implementation="xformers"),
            r"attn_implementation: 'xformers' is not one of",
        ),
        (lambda: DeepSpeedConfig(offload_params=True), r"offload_params: True needs zero_stage 3"),
        (
            lambda: DeepSpeedConfig(zero_stage=0, offload_optimizer=True),
            r"offload_optimizer: True needs zero_stage >= 1",
        ),
        (lambda: DeepSpeedConfig(micro_batch_tokens=0), r"micro_batch_tokens: 0 is not an integer >= 1"),
        (
            lambda: DeepSpeedConfig(sequence_parallel_size=0),
            r"sequence_parallel_size: 0 is not an integer >= 1",
        ),
        (
            lambda: DeepSpeedConfig(sequence_parallel_size=2, attn_implementation="flash_attention_2"),
            r"sequence_parallel_size: 2 needs attn_implementation sdpa or eager, got 'flash_attention_2'",
        ),
        (lambda: OptimizerConfig(lr=0.0), r"OptimizerConfig.lr: 0.0 is not a finite number in \(0"),
        (
            lambda: OptimizerConfig(betas=(0.9, 1.0)),
            r"betas\[1\]: 1.0 is not a finite number in \[0.0, 1.0\)",
        ),
        (
            lambda: OptimizerConfig(scheduler="linear"),
            r"scheduler: 'linear' is not one of 'cosine', 'constant'",
        ),
        (lambda: OptimizerConfig(warmup_ratio=1.5), r"warmup_ratio: 1.5"),
        (lambda: OptimizerConfig(grad_clip=float("nan")), r"grad_clip: nan"),
    ],
)
def test_bad_values_name_the_field_the_value_and_the_allowed_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_configs_round_trip_through_json_and_reject_bad_values_on_decode():
    ds = DeepSpeedConfig(zero_stage=3, offload_params=True)
    assert msgspec.json.decode(msgspec.json.encode(ds), type=DeepSpeedConfig) == ds
    with pytest.raises(msgspec.ValidationError, match="zero_stage: 5"):
        msgspec.json.decode(b'{"zero_stage": 5}', type=DeepSpeedConfig)


def test_deepspeed_dict_for_zero2_bf16():
    assert deepspeed_config(DeepSpeedConfig(), OptimizerConfig(grad_clip=0.5), world_size=4) == {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 500_000_000,
            "contiguous_gradients": True,
            "overlap_comm": False,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "gradient_clipping": 0.5,
    }


def test_deepspeed_dict_for_zero3_offload_fp16():
    ds = DeepSpeedConfig(zero_stage=3, dtype="fp16", offload_optimizer=True, offload_params=True)
    config = deepspeed_config(ds, OptimizerConfig(), world_size=2)
    assert config["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": 500_000_000,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    assert "bf16" not in config


def test_inference_dict_keeps_zero3_and_drops_other_stages_and_training_keys():
    inference = deepspeed_config(DeepSpeedConfig(zero_stage=2, dtype="fp32"), None, world_size=1, train=False)
    assert inference["zero_optimization"] == {"stage": 0}
    assert "gradient_clipping" not in inference
    sharded = deepspeed_config(
        DeepSpeedConfig(zero_stage=3, offload_optimizer=True), None, world_size=1, train=False
    )
    assert sharded["zero_optimization"]["stage"] == 3
    assert "offload_optimizer" not in sharded["zero_optimization"]


@pytest.mark.parametrize(
    "ds",
    [
        DeepSpeedConfig(zero_stage=0, dtype="fp32"),
        DeepSpeedConfig(zero_stage=2),
        DeepSpeedConfig(zero_stage=3, dtype="fp16", offload_optimizer=True, offload_params=True),
    ],
    ids=["zero0-fp32", "zero2-bf16", "zero3-offload-fp16"],
)
def test_deepspeed_accepts_the_dict(ds):
    from deepspeed.runtime.config import DeepSpeedConfig as Parsed

    parsed = Parsed(deepspeed_config(ds, OptimizerConfig(), world_size=1))
    assert parsed.zero_optimization_stage == ds.zero_stage
    assert parsed.gradient_clipping == 1.0
    assert parsed.train_batch_size == 1
    assert parsed.bfloat16_config.enabled == (ds.dtype == "bf16")


def test_deepspeed_config_rejects_a_bad_world_size():
    with pytest.raises(ValueError, match="world_size: 0 is not an integer >= 1"):
        deepspeed_config(DeepSpeedConfig(), OptimizerConfig(), world_size=0)


def test_cpu_without_offload_gets_plain_adamw_with_the_configured_hyperparameters():
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer = build_optimizer(params, OptimizerConfig(lr=2e-5, weight_decay=0.1), DeepSpeedConfig())
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        2e-5,
        (0.9, 0.95),
        1e-8,
        0.1,
    )


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_cuda_below_zero3_gets_torch_fused_adamw_and_builds_no_deepspeed_op(stage, monkeypatch):
    # FusedAdam would be compiled by nvcc on a fresh machine's first learner start; below ZeRO-3
    # torch's own fused kernel serves, so DeepSpeed's op module must not even be imported
    monkeypatch.delitem(sys.modules, "deepspeed.ops.adam", raising=False)
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", None)  # any import of it raises
    params = [torch.nn.Parameter(torch.zeros(3))]
    optim = OptimizerConfig(lr=2e-5, weight_decay=0.1)
    optimizer = build_optimizer(params, optim, DeepSpeedConfig(zero_stage=stage), device="cuda")
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["fused"] is True
    assert (optimizer.defaults["lr"], optimizer.defaults["weight_decay"]) == (2e-5, 0.1)


def test_cuda_zero3_falls_back_to_torch_fused_adamw_where_fusedadam_cannot_load(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", None)
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer = build_optimizer(params, OptimizerConfig(), DeepSpeedConfig(zero_stage=3), device="cuda")
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["fused"] is True


def test_torch_dtype_names():
    assert [torch_dtype(n) for n in ("bf16", "fp16", "fp32")] == [
        torch.bfloat16,
        torch.float16,
        torch.float32,
    ]


def _curve(optim: OptimizerConfig, total_steps: int) -> list[float]:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=optim.lr)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_cosine_schedule_golden_values():
    # 100 steps, warmup ⌈3⌉ = 3 steps: 1/3, 2/3, 1; then 0.1 + 0.9·½(1 + cos(π·(s − 3)/97)).
    lrs = _curve(OptimizerConfig(lr=1.0), 100)
    assert lrs[:4] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert lrs[3 + 97 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 48 / 97)))
    assert lrs[99] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 96 / 97)))
    assert lr_factor(100, OptimizerConfig(), 100) == pytest.approx(0.1)  # the end of the curve
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))


def test_warmup_rounds_up_and_constant_schedule_holds():
    lrs = _curve(OptimizerConfig(lr=2.0, warmup_ratio=0.1, scheduler="constant"), 25)  # ⌈2.5⌉ = 3
    assert lrs[:5] == pytest.approx([2 / 3, 4 / 3, 2.0, 2.0, 2.0])
    assert lrs[-1] == 2.0
    # Without warmup: 0.1 + 0.45·(1 + cos(π·s/3)); the minimum is reached after the last update.
    assert _curve(OptimizerConfig(lr=1.0, warmup_ratio=0.0), 3) == pytest.approx([1.0, 0.775, 0.325])


def test_build_scheduler_rejects_non_positive_total_steps():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="total_steps: 0 is not an integer >= 1"):
        build_scheduler(optimizer, OptimizerConfig(), 0)


def test_extra_deepspeed_keys_merge_into_the_built_config_key_by_key():
    from rl_learner import DeepSpeedConfig, deepspeed_config

    extra = {"zero_optimization": {"overlap_comm": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    config = deepspeed_config(DeepSpeedConfig(zero_stage=2, dtype="fp32", extra=extra), world_size=1)
    assert config["zero_optimization"]["overlap_comm"] is True
    assert config["zero_optimization"]["stage"] == 2  # kept beside the merged key
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
