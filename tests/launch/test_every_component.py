"""Every advantage estimator and policy loss the config accepts runs one step end to end on CPU:
real Ray, a transformers engine and DeepSpeed learners (policy, critic, reference), through the
launcher's own step (tests/launch/_component_sweep.py starts the actors once for all names).

The reward depends on the response's length, so groups mix 0s and 1s and the advantages are not
all 0: every loss trains on a real gradient. ReMax's step (the engines answer each prompt
greedily too, and that answer's reward is the baseline) is checked here rather than in a run of
its own; `rl-launch ppo` with ReMax runs in tests/launch/test_agents.py."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from rl_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

pytestmark = pytest.mark.slow

SWEEP = pathlib.Path(__file__).with_name("_component_sweep.py")

REWARD_FILE = """
def reward_func(queries, prompts, labels):
    # 1 when the response has a length divisible by 3: groups mix 0s and 1s, some are all 0 or all 1
    return [float((len(query) - len(prompt)) % 3 == 0) for query, prompt in zip(queries, prompts)]
"""


@pytest.fixture(scope="module")
def sweep(tiny_checkpoint, tmp_path_factory):
    import tempfile

    from tests.launch.launching import launcher_env, ray_processes

    folder = tmp_path_factory.mktemp("sweep")
    prompts = folder / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {n} + 1?", "label": str(n + 1)}) + "\n" for n in range(16))
    )
    reward = folder / "reward.py"
    reward.write_text(REWARD_FILE)
    ray_dir = tempfile.mkdtemp(prefix="rlt-", dir="/tmp")
    out = folder / "results.json"
    result = subprocess.run(
        [sys.executable, str(SWEEP), str(tiny_checkpoint), str(prompts), str(reward), ray_dir, str(out)],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert not ray_processes(ray_dir), "Ray processes outlived the sweep"
    assert out.exists(), result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "case",
    [f"estimator:{name}" for name in ADVANTAGE_ESTIMATORS] + [f"loss:{name}" for name in POLICY_LOSSES],
)
def test_one_step_of_every_estimator_and_loss(sweep, case):
    result = sweep[case]
    assert result["ok"], result.get("error")
    assert result["finite"]
    assert result["policy_loss"] is not None
    assert result["sync_match"] == 1.0
    assert result["samples"] == 8
    assert result["skipped"] == 0
    if case == "estimator:remax":  # the engines answered greedily; the reward of that is the baseline
        assert 0.0 <= result["baseline"] <= 1.0  # a length-based reward, in {0, 1}
        assert result["advantages_abs_mean"] > 0  # sampled rewards differ from the greedy one somewhere


def test_the_local_cluster_starts_one_worker_per_actor_and_no_idle_ones(sweep):
    assert sweep["_ray"]["actors"] == 4  # policy, critic, reference, engine
    assert sweep["_ray"]["workers"] == sweep["_ray"]["actors"], sweep["_ray"]
