"""The hybrid engine (`--ray.colocate all`) and the weight-sync strategies it chooses from.

- Config: `rollout.async_train` with `ray.colocate all` is refused (the engines sleep while the
  learners train, so nothing can generate ahead).
- End to end on CPU (real CLI, Ray, DeepSpeed, the transformers engine): every step the engines
  sleep once generation is done and wake before the weight sync, and the learners offload after
  it (`time/sleep`, `time/wake`, `time/sync`, `time/offload` in the step's phases, in that
  order); the engines refuse to generate or receive weights while asleep
  (tests/rollout/test_hf_engine.py pins that), so a run that completes with matching checksums
  ran the phases in that order. The same run syncs through files
  (`--rollout.weight_sync file`).
- On a GPU (`gpu`): the same loop on one GPU picks CUDA IPC (auto) and the policy offloads its
  DeepSpeed states while the engine generates (tests/learner/test_offload.py checks the memory).
"""

from __future__ import annotations

import pytest

from rl_launch.cli import resolve_ppo_config
from rl_launch.config import ConfigError
from tests.launch.launching import launch, read_metrics, write_sum_prompts


def test_async_training_with_the_hybrid_engine_is_refused_naming_both_options():
    options = {
        "model.pretrain": "/models/never-loaded",
        "data.prompt_data": "/data/never-read.jsonl",
        "ray.colocate": "all",
        "rollout.async_train": "true",
    }
    with pytest.raises(
        ConfigError,
        match=r"^rollout\.async_train: True cannot be combined with ray\.colocate all while "
        r"ray\.engine_sleep and ray\.learner_offload are true: .*set ray\.engine_sleep false and "
        r"ray\.learner_offload false",
    ):
        resolve_ppo_config(None, options)
    with pytest.raises(
        ConfigError, match=r"while ray\.learner_offload is true: .*set ray\.learner_offload false"
    ):
        resolve_ppo_config(None, {**options, "ray.engine_sleep": "false"})
    resolve_ppo_config(None, {**options, "rollout.async_train": "false"})  # either alone is fine
    # both sides resident: nothing waits for the other, so the engines may generate ahead
    resolve_ppo_config(None, {**options, "ray.engine_sleep": "false", "ray.learner_offload": "false"})


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_sum_prompts(tmp_path_factory.mktemp("prompts") / "train.jsonl", 16)


@pytest.mark.slow
def test_hybrid_engine_on_cpu_sleeps_after_generation_wakes_before_a_file_sync(
    tiny_checkpoint, prompts, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "8",
        "--rollout.weight_sync", "file",
        "--ray.colocate", "all",
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", "2",
        "--train.actor_learning_rate", "1e-4",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
    ]  # fmt: skip
    result = launch(args, env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "hybrid engine (ray.colocate all): the engines sleep after generation" in output
    assert "DeepSpeed state offload is skipped on CPU" in output
    assert f"weight sync: files ({(run_dir / 'weight_sync').resolve()})" in output
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]
    for line in metrics:
        phases = [key for key in line if key.startswith("time/") and key != "time/step"]
        order = [
            phases.index(f"time/{name}")
            for name in ("generation", "sleep", "training", "wake", "sync", "offload")
        ]
        assert order == sorted(order), phases  # PhaseTimer lists phases in the order they first ran
        assert line["health/sync_checksum_match"] == 1.0
        assert line["policy_version"] == line["step"]
        assert line["sync/gigabytes"] > 0
    # the file strategy keeps the newest version only, under the run folder
    assert [path.name for path in (run_dir / "weight_sync").iterdir()] == ["version-00000002"]


# ---------------------------------------------------------------------------- GPU only


@pytest.mark.slow
@pytest.mark.gpu
def test_hybrid_engine_on_one_gpu_syncs_by_cuda_ipc_and_offloads_the_learners(
    tiny_checkpoint, prompts, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "8",
        "--ray.colocate", "all",
        "--ray.device", "cuda",
        "--train.zero_stage", "2",
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", "2",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
    ]  # fmt: skip
    result = launch(args, env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "weight sync: CUDA IPC" in output  # auto: the engine shares the policy's GPU
    assert "policy offloads: DeepSpeed offload_states (ZeRO-2)" in output
    for line in read_metrics(run_dir):
        assert line["health/sync_checksum_match"] == 1.0
        assert line["time/sleep"] > 0
        assert line["time/wake"] > 0
        assert line["time/offload"] > 0
