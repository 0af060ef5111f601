"""End to end through Ray and DeepSpeed on CPU: `rl-launch ppo` with model.sequence_parallel_size 2
(two policy ranks sharing every micro-batch) trains like the same run on one policy rank.

Both runs are long-context runs: a tiny model with a 32k context, rollout.generate_max_len 16384
(the engine's max_model_len is data.prompt_max_len + that), rollout.min_new_tokens 160, and a
token budget (train.micro_batch_tokens 80, x 2 under SP) below every sequence's length, so each
sequence trains in a micro-batch of its own. Long responses cost generation time (the HF engine
decodes every token of the longest response of a step), so the batch is 2 prompts x 4 samples,
and the engine ends a response at any of `STOP_IDS` (its EOS and 32 ordinary tokens, ~7 % of the
tiny model's near-uniform vocabulary): past min_new_tokens a response ends within tens of tokens,
where EOS alone let them run to ~1000 tokens on average (at 640 / 320: generation 9-15 s of a
10-21 s step at load 7-8)."""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics, write_sum_prompts

pytestmark = pytest.mark.slow

REWARD_FILE = """
def reward_func(queries, prompts, labels):
    # the tiny model's text decides: groups mix 0s and 1s, so GRPO's advantages are not all 0
    return [float(sum(map(ord, query)) % 2 == 0) for query in queries]
"""

# Metrics that measure time, or depend on it, differ between any two runs.
_TIMING = ("time", "time/", "throughput/", "sync/seconds", "sync/gigabytes")


CONTEXT = 32768
# 2048 / 1024, 1280 / 640, 640 / 320, then 320 / 160 until the suite needed the time: the same
# over-budget case (a sequence longer than both ranks' budgets together)
MIN_RESPONSE = 160
BUDGET = 80  # train.micro_batch_tokens: below every sequence of these runs
STOP_IDS = [2, *range(100, 132)]  # the tiny tokenizer's EOS and 32 ordinary token ids


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory):
    """The tiny model with max_position_embeddings (and its tokenizer's model_max_length) 32768."""
    from rl_data.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "qwen2-32k", max_position_embeddings=CONTEXT
    )


def _args(checkpoint, prompts, reward, run_dir, ray_args, *extra: str) -> list[str]:
    return [
        "--preset", "none",
        "--model.pretrain", str(checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", str(reward),
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.rollout_batch_size", "2",
        "--rollout.generate_max_len", "16384",
        "--rollout.min_new_tokens", str(MIN_RESPONSE),
        "--rollout.engine_options.eos_token_ids", str(STOP_IDS),
        "--train.micro_batch_tokens", str(BUDGET),
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", "2",
        "--train.zero_stage", "0",
        "--train.actor_learning_rate", "1e-4",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        *extra,
    ]  # fmt: skip


def test_sequence_parallel_two_ranks_train_long_rollouts_like_one_rank(
    long_context_checkpoint, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    prompts = write_sum_prompts(tmp_path / "train.jsonl", 16)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    runs = {}
    for name, extra in (
        ("one", ()),
        ("sp2", ("--model.sequence_parallel_size", "2", "--ray.policy.num_actors", "2")),
    ):
        run_dir = tmp_path / name
        args = _args(long_context_checkpoint, prompts, reward, run_dir, ray_args, *extra)
        result = launch(args, env)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = (read_metrics(run_dir), result.stdout + result.stderr)
    words = "sequence parallel: 2 ranks share each micro-batch (Ulysses; data-parallel groups: policy 1)"
    assert f"{words}; a micro-batch holds up to 2 x {BUDGET} tokens" in runs["sp2"][1]
    assert "sequence parallel" not in runs["one"][1]
    for _, console in runs.values():  # the engine's context: data.prompt_max_len 1024 + 16384
        assert "hf engine x1 (max_model_len 17408)" in console
    one, sp2 = runs["one"][0], runs["sp2"][0]
    assert [line["step"] for line in sp2] == [1, 2]
    # every response is long, so every prompt + response is over both budgets (alone in its
    # micro-batch), and the runs train on them
    assert MIN_RESPONSE >= 2 * BUDGET
    assert all(MIN_RESPONSE <= line["response_length/mean"] < 2 * MIN_RESPONSE for line in one)
    assert all(line["policy/grad_norm"] > 0 for line in one)
    for ours, theirs in zip(sp2, one, strict=True):
        keys = {key for key in theirs if not key.startswith(_TIMING)}
        assert keys == {key for key in ours if not key.startswith(_TIMING)}
        for key in sorted(keys):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), key
