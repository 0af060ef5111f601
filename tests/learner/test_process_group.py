"""A learner in a process whose earlier world ended: DeepSpeed's cached clone of the old world
group is dropped, so the new learner builds, in a world it makes or one its caller made (the suite's in-process vLLM engine tests left a
pytest worker's process group destroyed, and a learner after them in the same worker failed with
"Group ... is not registered"); and a learner's start on CPU compiles no DeepSpeed op (its
shared-memory allreduce serves only AutoTP inference). Runs in a subprocess: the process-group
state must not stay in the pytest worker."""

from __future__ import annotations

import os
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
dist.destroy_process_group()
from rl_data.sync.broadcast import free_port  # the caller makes the next world itself (a team's own loop, tests)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
learner()
print("THIRD LEARNER BUILT")
"""


def test_a_learner_after_the_process_group_was_destroyed_builds_in_a_new_world(tiny_checkpoint):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SECOND LEARNER BUILT" in done.stdout
    assert "THIRD LEARNER BUILT" in done.stdout  # in a world its caller made, not rl_learner


def test_a_learner_start_on_cpu_builds_no_torch_extension(tiny_checkpoint, tmp_path):
    # DeepSpeed's CPU backend compiled its shared-memory allreduce op (deepspeed_shm_comm) into
    # TORCH_EXTENSIONS_DIR on every fresh machine, 35-55 s of a learner's start, for a path that
    # training never calls.
    extensions = tmp_path / "torch_extensions"
    script = (
        "import sys\n"
        "from rl_learner import DeepSpeedConfig, OptimizerConfig, PolicyLearner, load_causal_lm\n"
        "PolicyLearner(load_causal_lm(sys.argv[1]), deepspeed=DeepSpeedConfig(zero_stage=2),\n"
        "              optimizer=OptimizerConfig(lr=1e-5))\n"
        "print('LEARNER BUILT')\n"
    )
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LEARNER BUILT" in done.stdout
    built = (
        sorted(str(path.relative_to(extensions)) for path in extensions.rglob("*"))
        if extensions.exists()
        else []
    )
    assert built == [], f"torch extensions built while a CPU learner started: {built}"
