"""End to end through the real CLI, Ray, a transformers engine and DeepSpeed: rewards from a rule file, two
reward servers, a reward model served by `rl-launch serve-rm` and a judge model served by the run
(reward.judge_pretrain: a transformers engine in an actor of its own), weighted, with an Authorization
header read from an environment variable, the sources' extra_logs in metrics.jsonl, and OpenRLHF's
overlong / stop-properly shaping. The judge's rewards in completions.jsonl are the judge model's own
greedy answers to the rendered template, computed here again (a golden check that the score is the
judge's, not a constant).

The served reward model is the real `rl-launch serve-rm --port 0` in a subprocess (its own tests,
tests/launch/test_serve_rm.py, run it in-process): the run scores every sample on it, and it
exits 0 on SIGTERM after. One run for both: a run of its own cost a Ray start-up and its actors."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import torch

from rl_rollout.judge import JUDGE_PARSERS, render_judge_prompt
from tests.launch.launching import launch, read_metrics
from tests.launch.reward_servers import reward_server, served_health, served_reward_model

pytestmark = pytest.mark.slow

REWARD_FILE = """
def reward_func(queries, prompts, labels):
    rewards = [1.0 if str(label) in query[len(prompt):] else 0.0
               for query, prompt, label in zip(queries, prompts, labels)]
    return {"rewards": rewards, "extra_logs": {"file_hits": rewards}}
"""


JUDGE_TEMPLATE = "Task: {prompt}\nReference: {label}\nAnswer: {response}\nScore:"
JUDGE_FALLBACK = 0.25  # the tiny judge writes a number now and then: the rest follow reward.on_error
# (>= 0: the shaping checks below need rewards >= 0 before the stop-properly penalty)


def _judge_rewards_computed_again(
    checkpoint: Path, completions: list[dict], labels: list[str]
) -> list[float]:
    """What the judge gives each completion, without the run: render, one greedy answer, parse, scale."""
    from transformers import AutoTokenizer

    from rl_rollout import SamplingParams
    from rl_rollout.engines import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    engine = HFEngine(str(checkpoint), device="cpu", dtype=torch.float32, max_model_len=2048, seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, n=1, logprobs=False)
    expected = []
    for row in completions:
        response = row["response"]  # as the executor decoded it: without special tokens
        for token in tokenizer.all_special_tokens:
            response = response.replace(token, "")
        text = render_judge_prompt(JUDGE_TEMPLATE, row["prompt"], response, labels[row["row"]])
        ((answer,),) = engine.generate([tokenizer.encode(text)], params)
        score = JUDGE_PARSERS["last_number"](tokenizer.decode(answer.token_ids, skip_special_tokens=True))
        expected.append(JUDGE_FALLBACK if score is None else 0.5 * score)
    return expected


def _files_containing(root: Path, text: str) -> list[str]:
    needle = text.encode()
    return [str(path) for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]


def test_two_reward_servers_a_served_reward_model_and_a_file_weighted_with_a_header_extra_logs_and_shaping(
    tiny_checkpoint, ray_temp, tmp_path
):
    ray_dir, env = ray_temp
    token = f"Bearer rl-test-{secrets.token_hex(8)}"
    env = {**env, "RL_TEST_REWARD_TOKEN": token}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {a} + 1?", "label": str(a + 1)}) + "\n" for a in range(16))
    )
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    run_dir = tmp_path / "run"
    with (
        reward_server("a", 1.0) as first,
        reward_server("b", 0.25) as second,
        served_reward_model(tiny_checkpoint, env) as served,
    ):
        args = [
            "--preset", "none",
            "--model.pretrain", str(tiny_checkpoint),
            "--data.prompt_data", str(prompts),
            "--reward.function", str(reward_file),
            # OpenRLHF's way of giving several servers
            "--reward.remote_url", f"{first.url},{second.url},{served}",
            "--reward.weights", "1.0,0.5,2.0,1.0,2.0",
            "--reward.judge_pretrain", str(tiny_checkpoint),
            "--reward.judge_template", JUDGE_TEMPLATE,
            "--reward.judge_parser", "last_number",
            "--reward.judge_max_new_tokens", "32",
            "--reward.judge_scale", "0.5",
            "--reward.on_error", "fallback",  # the judge's unparsable answers; the other sources' values are pinned
            "--reward.fallback", str(JUDGE_FALLBACK),
            "--health.max_fallback_fraction", "none",
            "--log.completions", "8",
            "--reward.batch_size", "3",
            "--reward.retries", "1",
            "--reward.timeout_s", "30",
            "--reward.headers_env.Authorization", "RL_TEST_REWARD_TOKEN",
            # every response of more than 8 − 6 = 2 tokens is penalised; one cut at 8 tokens gets −0.5
            "--reward.overlong_buffer_len", "6",
            "--reward.stop_properly_penalty_coef", "-0.5",
            "--rollout.n_samples_per_prompt", "2",
            "--rollout.rollout_batch_size", "4",
            "--rollout.generate_max_len", "8",
            "--algo.advantage.estimator", "grpo",
            "--train.max_steps", "2",
            "--ckpt.save_hf_model", "false",
            "--log.output_dir", str(run_dir),
            "--log.progress_bar", "false",
            "--ray.temp_dir", ray_dir,
            "--rollout.engine", "hf",  # transformers generation: starts in a second, vLLM in ~25 s
        ]  # fmt: skip
        result = launch(args, env)
        assert result.returncode == 0, result.stderr[-4000:]
        # 8 samples a step in batches of 3: 3 requests per server and step
        assert sorted(request["size"] for request in first.requests) == [2, 2, 3, 3, 3, 3]
        assert len(second.requests) == 6
        assert {request["authorization"] for request in first.requests + second.requests} == {token}
        status, health = served_health(served)
        assert status == 200
        assert health["samples"] == 2 * 4 * 2  # every sample of the 2 steps, scored once

    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]
    for line in metrics:
        assert line["reward/remote_0_mean"] == 1.0
        assert line["reward/remote_1_mean"] == 0.25
        assert 0.0 <= line["reward/function_mean"] <= 1.0
        # the served model's fresh score head on the tiny backbone: small nonzero scores, never exactly 0
        assert line["reward/remote_2_mean"] != 0.0
        assert abs(line["reward/remote_2_mean"]) < 10.0
        # the outcome reward is Σ w_k r_k in the order function, remote_0, remote_1, remote_2, judge
        assert line["reward/mean"] == pytest.approx(
            line["reward/function_mean"]
            + 0.5 * 1.0
            + 2.0 * 0.25
            + 1.0 * line["reward/remote_2_mean"]
            + 2.0 * line["reward/judge_mean"]
        )
        # the judge's unparsable answers are its fallbacks, and no other source failed
        fallbacks = line.get("reward/fallbacks/judge", 0.0)
        assert line["reward/fallbacks"] == fallbacks
        assert line["reward/extra/judge/parse_failed"] == pytest.approx(fallbacks / 8)
        # extra_logs: per-sample lists (file_hits, a_response_chars) and one value per request (b_requests)
        assert line["reward/extra/file_hits"] == pytest.approx(line["reward/function_mean"])
        assert line["reward/extra/a_response_chars"] > 0
        assert line["reward/extra/b_requests"] == 1.0
        # the tiny model rambles: its responses run into the overlong buffer
        assert line["reward/overlong_penalty_mean"] < 0
        assert line["reward/overlong_fraction"] > 0
        if line["response/truncated"] > 0:  # shaped rewards are >= 0 before this penalty
            assert line["reward/stop_properly_penalty_mean"] < 0
        assert line["reward/shaped_mean"] < line["reward/mean"]
    # the judge: its own actor and log, and its scores are the judge model's greedy answers
    assert (run_dir / "logs" / "judge-0.log").is_file()
    completions = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 16
    judged = [row["reward_sources"]["judge"] for row in completions]
    labels = [str(a + 1) for a in range(16)]
    assert judged == pytest.approx(_judge_rewards_computed_again(tiny_checkpoint, completions, labels))
    assert any(value != JUDGE_FALLBACK for value in judged), judged  # a parsed score, not the fallback
    # the token went in a header only: not into the config, the metrics, the actors' logs or Ray's files
    assert (run_dir / "config.yaml").read_text().count("RL_TEST_REWARD_TOKEN") == 1
    assert _files_containing(run_dir, token) == []
    assert _files_containing(Path(ray_dir), token) == []
    assert token not in result.stdout + result.stderr
