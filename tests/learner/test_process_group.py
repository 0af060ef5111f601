"""A learner in a process whose earlier world ended: DeepSpeed's cached clone of the old world
group is dropped, so the new learner builds (the suite's in-process vLLM engine tests left a
pytest worker's process group destroyed, and a learner after them in the same worker failed with
"Group ... is not registered"). Runs in a subprocess: the process-group state must not stay in the pytest worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import sys
import torch
import torch.distributed as dist
from rl_learner import DeepSpeedConfig, OptimizerConfig, PolicyLearner, load_causal_lm

def learner():
    return PolicyLearner(load_causal_lm(sys.argv[1]), deepspeed=DeepSpeedConfig(zero_stage=2),
                         optimizer=OptimizerConfig(lr=1e-5))

learner()  # makes the world; DeepSpeed clones its group
dist.destroy_process_group()  # the world ends
learner()  # a new world in the same process
print("SECOND LEARNER BUILT")
"""


def test_a_learner_after_the_process_group_was_destroyed_builds_in_a_new_world(tiny_checkpoint):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SECOND LEARNER BUILT" in done.stdout
