"""End to end through Ray and DeepSpeed: async mode two steps ahead, killed and resumed.

`--rollout.async_train true --rollout.async_depth 2`: once step t's records are in, the
generations of steps t+1 and t+2 are under way. A checkpoint keeps those in-flight prompts, so
the run killed with SIGKILL after a checkpoint and resumed trains every step on the prompts an
uninterrupted run would (the sampler's batches, in order, with the same group ids), the in-flight
ones generated again on the restored weights. `log.completions` writes what each step trained on.

The same run with `--rollout.partial_rollout true`: each weight sync reaches the engine while it
generates the steps ahead (its rows decoded one at a time and long enough that the engine is
always busy), so responses mix versions within one sample, every token counted in the per-token
staleness, and the token-level rollout correction (tis, async mode's default) weighs them; the
kill and resume keep the prompts exactly as in whole-step mode.
"""

from __future__ import annotations

import json

import pytest

from rl_data.datasets import ResumableSampler
from tests.launch.launching import kill_once_written, launch, read_metrics, write_sum_prompts

pytestmark = pytest.mark.slow

PROMPTS, BATCH, N, STEPS, DEPTH, SEED = 64, 4, 2, 8, 2, 3
PARTIAL_MAX_LEN = 48


@pytest.fixture
def prompts(tmp_path):
    return write_sum_prompts(tmp_path / "train.jsonl", PROMPTS)


def _completions(run_dir) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], []).append(row)
    return steps


@pytest.mark.parametrize("partial", [False, True], ids=["whole_steps", "partial_rollout"])
def test_an_async_run_killed_after_a_checkpoint_trains_on_the_prompts_of_an_uninterrupted_one(
    tiny_checkpoint, prompts, ray_temp, tmp_path, partial
):
    ray_dir, env = ray_temp
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", str(N),
        "--rollout.rollout_batch_size", str(BATCH),
        "--rollout.generate_max_len", "6",
        "--rollout.async_train", "true",
        "--rollout.async_depth", str(DEPTH),
        "--rollout.max_staleness", str(DEPTH),
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", str(STEPS),
        "--train.seed", str(SEED),
        "--ckpt.save_steps", "2",
        "--ckpt.save_hf_model", "false",
        "--log.completions", "100",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip
    if partial:
        args += [
            "--rollout.partial_rollout", "true",
            "--rollout.generate_max_len", str(PARTIAL_MAX_LEN),
            "--rollout.engine_options.max_batch_size", "1",
        ]  # fmt: skip
    latest = run_dir / "checkpoints" / "policy" / "latest"
    kill_once_written(args, env, latest, ray_dir)
    tag = latest.read_text().strip()
    saved = int(tag.removeprefix("step_"))
    assert saved < STEPS
    state = json.loads((run_dir / "checkpoints" / "policy" / tag / "training_state.json").read_text())
    in_flight = state["extra"]["in_flight"]
    assert [entry["step"] for entry in in_flight] == list(range(saved + 1, min(saved + DEPTH, STEPS) + 1))

    resumed = launch([*args, "--ckpt.load_checkpoint", "true"], env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    # An uninterrupted run trains step k on the sampler's k-th batch, with group ids 4(k-1)...
    batches = iter(ResumableSampler(PROMPTS, batch_size=BATCH, seed=SEED, shuffle=True))
    completions = _completions(run_dir)
    assert sorted(completions) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        rows = completions[step]
        assert len(rows) == BATCH * N
        assert sorted({row["index"] for row in rows}) == sorted(next(batches)), step
        assert sorted({row["group_id"] for row in rows}) == list(range(BATCH * (step - 1), BATCH * step))
        assert all("?" in row["prompt"] for row in rows)
    if saved + 1 <= STEPS:
        entry = in_flight[0]
        assert sorted({row["index"] for row in completions[saved + 1]}) == sorted(entry["indices"])

    metrics = read_metrics(run_dir)
    if partial:
        _check_partial_rollout(metrics, completions, saved)
        return
    # Staleness: step s trains on records min(s - 1, depth) versions behind, counted from the
    # start or from the resume (the in-flight steps are generated again on the restored weights).
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    for line in metrics:
        step = line["step"]
        expected = min(step - 1 if step <= saved else step - saved - 1, DEPTH)
        assert line["async/staleness_max"] == expected, step
        assert line["health/policy_lag"] == expected, step
        assert line["async/dropped_stale"] == 0.0
        assert line.get("health/sync_checksum_match", 1.0) == 1.0  # compared once the receipts are in
        assert [row["policy_version"] for row in completions[step]] == [step - 1 - expected] * (BATCH * N)
    assert metrics[-1]["health/sync_checksum_match"] == 1.0
    assert metrics[-1]["sync/unsettled_versions"] == 0.0


def _check_partial_rollout(metrics: list[dict], completions: dict[int, list[dict]], saved: int) -> None:
    """Versions mix within samples, never beyond what the learner held; the correction ran."""
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    for line in metrics:
        step = line["step"]
        assert line["async/dropped_stale"] == 0.0
        assert 0.0 <= line["async/token_staleness_mean"] <= line["async/token_staleness_max"]
        assert line["async/token_staleness_max"] <= line["async/staleness_max"] <= DEPTH, step
        assert line.get("health/sync_checksum_match", 1.0) == 1.0
        assert "policy/correction_clip_fraction" in line, sorted(line)  # token-level tis weighed them
        for row in completions[step]:  # the learner trains step s at version s - 1
            assert row["policy_version"] <= row["last_policy_version"] <= step - 1, (step, row)
    mixed = [
        row
        for rows in completions.values()
        for row in rows
        if row["policy_version"] < row["last_policy_version"]
    ]
    assert mixed, "no sample mixed versions: no sync landed while the engine generated"
    assert sum(line["async/mixed_version_records"] for line in metrics) >= len(mixed)
    assert metrics[-1]["sync/unsettled_versions"] == 0.0
