"""DeepSpeed state offload for the hybrid engine (`rl_learner.Learner.offload_states`).

On CPU nothing moves (`offload_plan` says why). On a GPU (`gpu`) a ZeRO-2 / ZeRO-3 policy learner
frees at least its fp32 master weights and Adam moments (ZeRO-3 only with DeepSpeed's FusedAdam), refuses a forward until `reload_states`, and then computes exactly the
log-probs it computed before; one optimizer step after the round trip still works. The GPU part
runs in a subprocess, so its NCCL process group does not outlive the test.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent

SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[2])
from _helpers_core import experience
from rl_learner import DeepSpeedConfig, OptimizerConfig, PolicyLearner, load_causal_lm

learner = PolicyLearner(
    load_causal_lm(sys.argv[1], dtype=torch.bfloat16),
    deepspeed=DeepSpeedConfig(zero_stage=int(sys.argv[3]), dtype="bf16"),
    optimizer=OptimizerConfig(lr=1e-5),
)
batch = experience(4, vocab=300)
# one step first, so that the Adam moments exist (they are what offloading frees most of)
from rl_learner import PolicyLossConfig
old = learner.logprobs([batch])[0]
batch.old_logprobs = old.float().cpu()
batch.advantages = torch.ones_like(batch.old_logprobs)
learner.train_step([batch], PolicyLossConfig())
before = learner.logprobs([batch])[0]
torch.cuda.synchronize()
held = torch.cuda.memory_allocated()
numel = sum(p.numel() for p in learner.module.parameters())
plan = learner.offload_plan()
if plan[0] == "none":
    print(json.dumps({"plan": list(plan)}))
    sys.exit(0)
moved = learner.offload_states()
freed = torch.cuda.memory_allocated()
try:
    learner.logprobs([batch])
    refused = ""
except RuntimeError as error:
    refused = str(error)
reloaded = learner.reload_states()
after = learner.logprobs([batch])[0]
learner.train_step([batch], PolicyLossConfig())
print(json.dumps({"plan": list(plan), "numel": numel, "moved": moved, "reloaded": reloaded, "held": held, "freed": freed,
                  "refused": refused, "same": bool(torch.equal(before, after))}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_offload_frees_gpu_memory_and_reload_gives_identical_logprobs(tiny_checkpoint, stage):
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint), str(ROOT), str(stage)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if stage == 3 and result["plan"][0] == "none":  # DeepSpeed's FusedAdam kernel did not build here
        assert "only with its FusedAdam" in result["plan"][1]
        return
    assert result["plan"] == ["deepspeed", f"DeepSpeed offload_states (ZeRO-{stage})"]
    assert result["moved"] is True
    assert result["reloaded"] is True
    # at least the fp32 master weights and both Adam moments (3 x 4 bytes a parameter) left the GPU
    assert result["held"] - result["freed"] >= 12 * result["numel"], result
    assert "call reload_states() first" in result["refused"]
    assert result["same"] is True
