"""End to end through Ray and DeepSpeed: async mode two steps ahead, killed and resumed.

`--rollout.async_train true --rollout.async_depth 2` (whole-step mode's resume, run here with
partial rollout on top; the toy loop pins it alone): once step t's records are in, the
generations of steps t+1 and t+2 are under way. A checkpoint keeps those in-flight prompts, so
the run killed with SIGKILL after a checkpoint and resumed trains every step on the prompts an
uninterrupted run would (the sampler's batches, in order, with the same group ids), the in-flight
ones generated again on the restored weights. `log.completions` writes what each step trained on.

With `--rollout.partial_rollout true`: each weight sync reaches the engine while it
generates the steps ahead (its rows decoded one at a time and long enough that the engine is
always busy), so responses mix versions within one sample, every token counted in the per-token
staleness, and the token-level rollout correction (tis, async mode's default) weighs them; the
kill and resume keep the prompts exactly as in whole-step mode.

The same run with `--rollout.streaming true` (and partial rollout, depth 1, rounds of 6 prompts
for steps of 4: oversampling): a pool of 12 groups in flight, one generate call each, a step
trains on the first 4 to finish and the rest stay in flight. Which step trains which group is
up to the engine, but the checkpoint keeps every group not yet trained, so across the kill and
the resume no prompt is lost and none is trained twice, and every group id still names its
position in the sampler's stream.
"""

from __future__ import annotations

import json

import pytest

from rl_data.datasets import ResumableSampler
from tests.launch.launching import kill_once_written, launch, read_metrics, write_sum_prompts

pytestmark = pytest.mark.slow

PROMPTS, BATCH, N, STEPS, DEPTH, SEED = 64, 4, 2, 6, 2, 3
PARTIAL_MAX_LEN = 48
ROUND, STREAM_STALENESS = 6, 4  # streaming: prompts per round (> BATCH), staleness bound


@pytest.fixture
def prompts(tmp_path):
    return write_sum_prompts(tmp_path / "train.jsonl", PROMPTS)


def _completions(run_dir) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for line in (run_dir / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], []).append(row)
    return steps


# Whole-step async mode resumes through the same code (the checkpoint's in-flight steps submitted
# again): its own e2e case gave way to the partial-rollout one, which runs it plus the syncs landing
# mid-request; the toy loop pins its resume (test_preemption, async_train True).
@pytest.mark.parametrize("mode", ["partial_rollout", "streaming"])
def test_an_async_run_killed_after_a_checkpoint_trains_on_the_prompts_of_an_uninterrupted_one(
    tiny_checkpoint, prompts, ray_temp, tmp_path, mode
):
    partial = mode == "partial_rollout"
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
    if mode == "streaming":
        args += [
            "--rollout.streaming", "true",
            "--rollout.partial_rollout", "true",
            "--rollout.async_depth", "1",
            "--rollout.max_staleness", str(STREAM_STALENESS),
            "--rollout.generate_batch_size", str(ROUND),
        ]  # fmt: skip
    latest = run_dir / "checkpoints" / "policy" / "latest"
    kill_once_written(args, env, latest, ray_dir)
    tag = latest.read_text().strip()
    saved = int(tag.removeprefix("step_"))
    assert saved < STEPS
    state = json.loads((run_dir / "checkpoints" / "policy" / tag / "training_state.json").read_text())
    in_flight = state["extra"]["in_flight"]
    if mode == "streaming":
        resumed = launch([*args, "--ckpt.load_checkpoint", "true"], env)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        _check_streaming(run_dir, state, saved)
        return
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


def _check_streaming(run_dir, state: dict, saved: int) -> None:
    """No prompt lost or trained twice across the kill; group ids name stream positions."""
    stream = [index for batch in _sampler_batches(ROUND, 64) for index in batch]
    pool = {entry["group_id"]: entry["indices"] for entry in state["extra"]["in_flight"]}
    drawn = state["extra"]["next_group_id"]
    assert pool
    assert all(stream[group] == indices[0] for group, indices in pool.items())
    completions = _completions(run_dir)
    assert sorted(completions) == list(range(1, STEPS + 1))
    trained: dict[int, int] = {}  # group id -> step
    for step, rows in completions.items():
        groups = {row["group_id"] for row in rows}
        assert len(rows) == BATCH * N, step
        assert len(groups) == BATCH, step
        for group in groups:
            assert group not in trained, (group, step, trained.get(group))  # never trained twice
            trained[group] = step
            assert {row["index"] for row in rows if row["group_id"] == group} == {stream[group]}
    before = {group for group, step in trained.items() if step <= saved}
    after = {group for group, step in trained.items() if step > saved}
    # the checkpoint's prompts: each trained before it, or in its pool (none lost)
    assert before | set(pool) == set(range(drawn))
    assert not before & set(pool)
    # after the resume: the pool's groups and newly drawn ones only
    assert all(group in pool or group >= drawn for group in after)
    policy = run_dir / "checkpoints" / "policy"
    final = json.loads((policy / (policy / "latest").read_text().strip() / "training_state.json").read_text())
    assert final["step"] == STEPS
    left = {entry["group_id"] for entry in final["extra"]["in_flight"]}
    # every group of the pool was trained, is still in flight, or was dropped as stale (a group
    # that waited past rollout.max_staleness: how many depends on the machine's speed; counted)
    lines = [line for line in read_metrics(run_dir) if line["step"] > saved]
    dropped = sum(line.get("async/dropped_stale_groups", 0.0) for line in lines)
    assert len(set(pool) - after - left) <= dropped
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == list(range(1, STEPS + 1))
    for line in metrics:
        # a group dropped as stale drops its n records (and none of them was trained: above)
        assert line["async/dropped_stale"] == N * line["async/dropped_stale_groups"]
        if not line["async/dropped_stale_groups"]:  # staleness_max counts the dropped records too
            assert line["async/staleness_max"] <= STREAM_STALENESS
        # what step s trained on (after s - 1 syncs) is at most max_staleness versions behind
        assert all(
            line["step"] - 1 - row["policy_version"] <= STREAM_STALENESS for row in completions[line["step"]]
        )
        assert 0.0 <= line["time/engine_idle_fraction"] <= 1.0
        assert line["async/pool_groups"] >= BATCH
    assert metrics[-1]["sync/unsettled_versions"] == 0.0


def _sampler_batches(batch_size: int, rounds: int) -> list[list[int]]:
    batches = iter(ResumableSampler(PROMPTS, batch_size=batch_size, seed=SEED, shuffle=True))
    return [next(batches) for _ in range(rounds)]
