"""OptimizerConfig(name="muon"): DeepSpeed's own Muon on the hidden matrices, AdamW on the rest.

The config part checks the DeepSpeed dict; the worker part (`_worker_muon.py`, one process of
real DeepSpeed on CPU) takes one SFT step per ZeRO stage and compares every parameter's change
with the Muon update (a reference Newton–Schulz of the plain-torch gradient) or torch's AdamW.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from rl_learner.config import (
    DeepSpeedConfig,
    OptimizerConfig,
    build_optimizer,
    deepspeed_config,
)
from tests.learner.single_rank import single_rank_env

WORKER = pathlib.Path(__file__).resolve().parent / "_worker_muon.py"
STAGES = (0, 1, 2, 3)
# Largest relative error of a Muon update against the float64 Newton–Schulz, by the precision
# DeepSpeed ran it in (`_worker_muon.newton_schulz_dtype`).
NEWTON_SCHULZ_ERROR = {"float32": 0.01, "float16": 0.06, "bfloat16": 0.12}


def test_muon_is_deepspeeds_optimizer_section_with_both_learning_rates():
    optim = OptimizerConfig(name="muon", lr=1e-5, muon_lr=0.01, muon_momentum=0.9, weight_decay=0.1)
    config = deepspeed_config(DeepSpeedConfig(zero_stage=2, dtype="fp32"), optim, world_size=1)
    assert config["optimizer"] == {
        "type": "Muon",
        "params": {
            "lr": 0.01,
            "muon_lr": 0.01,
            "adam_lr": 1e-5,
            "momentum": 0.9,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "torch_adam": True,
        },
    }
    assert "reduce_scatter" not in config["zero_optimization"]
    zero3 = deepspeed_config(DeepSpeedConfig(zero_stage=3), optim, world_size=1)["zero_optimization"]
    assert zero3["reduce_scatter"] is False  # DeepSpeed's ZeRO-3 Muon refuses reduce-scatter
    offload = deepspeed_config(DeepSpeedConfig(zero_stage=2, offload_optimizer=True), optim, world_size=1)
    assert "torch_adam" not in offload["optimizer"]["params"]  # DeepSpeedCPUAdam for the AdamW half
    assert "optimizer" not in deepspeed_config(DeepSpeedConfig(), OptimizerConfig(), world_size=1)
    assert "optimizer" not in deepspeed_config(DeepSpeedConfig(), optim, world_size=1, train=False)


def test_muon_options_are_checked_and_build_optimizer_leaves_muon_to_deepspeed():
    with pytest.raises(ValueError, match=r"OptimizerConfig\.name: 'sgd' is not one of 'adamw', 'muon'"):
        OptimizerConfig(name="sgd")
    with pytest.raises(ValueError, match=r"muon_momentum: 1\.0 is not a finite number in \[0\.0, 1\.0\)"):
        OptimizerConfig(name="muon", muon_momentum=1.0)
    with pytest.raises(ValueError, match=r"muon_lr: 0\.0 is not a finite number in \(0"):
        OptimizerConfig(name="muon", muon_lr=0.0)
    with pytest.raises(ValueError, match="built by DeepSpeed from the config's optimizer section"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(name="muon"), DeepSpeedConfig())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("muon")
    env = single_rank_env()
    done = subprocess.run(
        [sys.executable, str(WORKER), str(folder), *map(str, STAGES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(f"worker failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return json.loads((folder / "muon.json").read_text())


@pytest.mark.slow  # `results`: a DeepSpeed worker process
@pytest.mark.parametrize("stage", STAGES)
def test_one_muon_step_orthogonalises_the_matrices_and_adamw_steps_the_rest(results, stage):
    run = results[str(stage)]
    assert run["basic_optimizer"] == "MuonWithAuxAdam"
    assert run["skipped"] == 0.0
    if not torch.cuda.is_available():  # on CPU the learner runs DeepSpeed's compiled Newton–Schulz eager
        assert run["compiled_graphs"] == 0
    assert run["lr"] == pytest.approx(0.02)  # DeepSpeed's first group: the Muon matrices
    params = run["params"]
    matrices = {name: p for name, p in params.items() if p["muon"]}
    rest = {name: p for name, p in params.items() if not p["muon"]}
    assert matrices
    assert rest
    assert any("embed" in name for name in rest)
    assert any(name.endswith("bias") for name in rest)
    # DeepSpeed's Newton–Schulz runs in float32, or in a 16-bit type where the accelerator has
    # one: within these of the float64 reference (0.028-0.033 measured in fp16 on a Sapphire
    # Rapids CPU); a learning rate or aspect-ratio scale 10 % off is 0.1 off
    bound = NEWTON_SCHULZ_ERROR[run["newton_schulz_dtype"]]
    for name, p in matrices.items():
        assert p["relative_error"] < bound, (name, p)
        # the gradient's singular values spread widely; the update's are all near 1
        assert p["gradient_singular_ratio"] > 3.0, (name, p)
        assert 0.5 < p["singular_min"] <= p["singular_max"] < 1.3, (name, p)
    for name, p in rest.items():
        # AdamW's first step moves each entry by about lr (1e-3) · sign(g); the k_proj biases, whose
        # gradient is zero up to rounding, differ most (packed vs per-sequence forwards)
        assert p["max_abs_error"] < 5e-5, (name, p)
