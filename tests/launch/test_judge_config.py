"""The judge reward source of `rl-launch ppo` (reward.judge_*): checked before anything starts (its
options, template, parser, engine options, model folder), placed as a role of its own, and scored
in a rollout actor's reward as the source "judge". The run end to end: tests/launch/test_rewards_e2e.py."""

from __future__ import annotations

import shutil

import pytest

from rl_launch.actors import EngineSpec, build_reward
from rl_launch.cluster import plan_roles
from rl_launch.config import ConfigError, RewardConfig
from rl_launch.preflight import PreflightError, resolve_inputs
from rl_rollout.protocol import Generation
from tests.launch.configs import ppo_config

BASE = {
    "model.pretrain": "/models/never-loaded",
    "data.prompt_data": "/data/never-read.jsonl",
    "rollout.rollout_batch_size": "2",
    "rollout.n_samples_per_prompt": "2",
}


def config(**overrides: str):
    return ppo_config(BASE, **overrides)


def test_the_judge_is_a_reward_source_after_the_function_and_the_servers_with_its_own_weight():
    assert RewardConfig(judge_pretrain="/m/judge").sources == ["judge"]
    both = RewardConfig(function="numeric", remote_url="http://127.0.0.1:1/r", judge_pretrain="/m/judge")
    assert both.sources == ["function", "remote_0", "judge"]
    with pytest.raises(
        ConfigError, match=r"reward.weights: \[1.0, 2.0\] must have one weight per reward source, 3"
    ):
        RewardConfig(
            function="numeric", remote_url="http://127.0.0.1:1/r", judge_pretrain="/j", weights=[1.0, 2.0]
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"reward__judge_parser": "last_number"},
            r"reward.judge_parser: 'last_number' needs reward.judge_pretrain",
        ),
        (
            {"reward__judge_pretrain": "/m/j", "reward__judge_template": "{prompt} {answer}"},
            r"reward.judge_template: placeholder \{answer\} is not one of \{prompt\}, \{response\}, \{label\}",
        ),
        (
            {"reward__judge_pretrain": "/m/j", "reward__judge_template": "/no/such/judge.txt"},
            r"reward.judge_template: '/no/such/judge.txt' has no \{response\} placeholder and is not a file",
        ),
        ({"reward__judge_pretrain": "/m/j", "reward__judge_parser": "score"}, r"reward.judge_parser"),
        (
            {"reward__judge_pretrain": "/m/j", "reward__judge_engine": "sglang"},
            r"reward.judge_engine: 'sglang' is not one of .*hf.*vllm",
        ),
        (
            {"reward__judge_pretrain": "/m/j", "reward__judge_engine": "http"},
            r"reward.judge_engine_options.base_url: judge engine 'http' needs it",
        ),
        (
            {"reward__judge_pretrain": "/m/j", "reward__judge_engine_options__no_such_option": "1"},
            r"reward.judge_engine_options.*no_such_option",
        ),
    ],
)
def test_a_wrong_judge_option_is_refused_before_anything_starts_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(**overrides)


def test_the_judge_template_may_be_a_file(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Is {response} right for {prompt}? yes or no: ")
    cfg = config(
        reward__judge_pretrain="/m/j", reward__judge_template=str(template), reward__judge_parser="yes_no"
    )
    assert cfg.reward.judge_template == str(template)  # verbatim: read where the judge is built


def test_preflight_checks_the_judge_folder_and_chat_template_and_keeps_the_preset_function_off(
    tiny_checkpoint, tmp_path
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1?", "label": "2"}\n')
    own = {"model__pretrain": str(tiny_checkpoint), "data__prompt_data": str(prompts)}
    with pytest.raises(
        PreflightError, match=r"reward.judge_pretrain: model folder '/no/judge' does not exist"
    ):
        resolve_inputs(config(**own, reward__judge_pretrain="/no/judge"), None)
    assert (
        resolve_inputs(config(**own, reward__judge_pretrain=str(tiny_checkpoint)), None).reward_function
        is None
    )
    with_chat = config(**own, reward__judge_pretrain=str(tiny_checkpoint), reward__judge_chat_template="true")
    resolve_inputs(with_chat, None)  # the tiny tokenizer has a ChatML template
    plain = tmp_path / "plain"  # the same model without its chat template
    shutil.copytree(tiny_checkpoint, plain)
    (plain / "chat_template.jinja").unlink()
    without = config(**own, reward__judge_pretrain=str(plain), reward__judge_chat_template="true")
    with pytest.raises(
        PreflightError, match=r"reward.judge_chat_template: true, but the tokenizer of .* has no chat"
    ):
        resolve_inputs(without, None)


def test_the_judge_is_a_role_of_its_own_with_ray_judge_resources_never_colocated():
    cfg = config(
        reward__judge_pretrain="/m/j", ray__judge__num_actors="2", ray__judge__num_gpus_per_actor="0.5"
    )
    layouts = {layout.role: layout for layout in plan_roles(cfg, use_gpus=True)}
    assert layouts["judge"].num_actors == 2
    assert layouts["judge"].num_gpus == 0.5
    assert layouts["judge"].group == "judge"
    assert "judge" not in {layout.role for layout in plan_roles(config(), use_gpus=True)}
    hybrid = config(reward__judge_pretrain="/m/j", ray__colocate="all")
    assert {layout.role: layout.group for layout in plan_roles(hybrid, use_gpus=True)}["judge"] == "judge"


def test_a_rollout_actors_reward_scores_the_judge_source_from_the_judge_engine(tiny_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    answers = {"right": " <score>9</score>", "wrong": " <score>1</score>"}

    class Judge:
        def generate(self, prompts, params):
            assert params.temperature == 0.0
            assert params.max_new_tokens == 12
            texts = [tokenizer.decode(prompt) for prompt in prompts]
            return [
                [
                    Generation(
                        token_ids=tokenizer.encode(answers["right" if "|4|4" in text else "wrong"]),
                        logprobs=None,
                        finish_reason="stop",
                    )
                ]
                for text in texts
            ]

    cfg = config(
        reward__function="numeric",
        reward__judge_pretrain=str(tiny_checkpoint),
        reward__judge_template="{prompt}|{response}|{label}",
        reward__judge_max_new_tokens="12",
        reward__judge_scale="0.1",
        reward__weights="1.0,2.0",
    )
    spec = EngineSpec(
        kind="hf",
        model_path="/m",
        dtype="float32",
        max_model_len=64,
        seed=0,
        reward_function="numeric",
        reward=cfg.reward,
    )
    with pytest.raises(
        RuntimeError, match=r"reward\.judge_pretrain is set, but this rollout actor was given no judge"
    ):
        build_reward(spec)
    reward_fn = build_reward(spec, Judge())
    output = reward_fn(["Q4", "Q5"], ["Q", "Q"], ["4", "4"])
    # numeric: 1, 0; judge: 0.9, 0.1 weighted 2
    assert output.rewards == pytest.approx([1.0 + 2 * 0.9, 0.0 + 2 * 0.1])
    assert list(reward_fn.sources) == ["function", "judge"]
    assert reward_fn.sources["judge"].extra_logs["judge/parse_failed"] == [0.0, 0.0]


def test_a_hung_judge_actors_call_is_cancelled_after_the_deadline_and_raises(monkeypatch):
    import ray

    from rl_launch.judge import RemoteJudgeEngine

    asked, cancelled, waited = [], [], []

    class Method:
        def remote(self, prompts, params):
            asked.append(prompts)
            return "future"

    class Handle:
        generate = Method()

    def get(future, timeout):
        waited.append(timeout)
        raise ray.exceptions.GetTimeoutError("no answer")

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    with pytest.raises(TimeoutError, match=r"the judge did not answer within 35 s"):
        RemoteJudgeEngine(Handle(), 30.0).generate([(1, 2)], params=None)
    assert asked == [[[1, 2]]]
    assert waited == [35.0]  # past JudgeReward's own deadline: that one fires first and is counted
    assert cancelled == ["future"]


def test_the_judge_engine_gets_the_judge_models_own_context_and_one_device(tiny_checkpoint):
    from rl_launch.judge_worker import judge_engine_spec

    cfg = config(
        reward__judge_pretrain=str(tiny_checkpoint),
        reward__judge_engine="vllm",
        reward__judge_engine_options__gpu_memory_utilization="0.3",
    )
    spec = EngineSpec(
        kind="hf", model_path="/m/policy", dtype="bf16", max_model_len=64, seed=3, tensor_parallel_size=2,
        lora_rank=8, partial_rollout=True, reward=cfg.reward,
    )  # fmt: skip
    judge = judge_engine_spec(spec)
    assert (judge.kind, judge.model_path, judge.options) == (
        "vllm",
        str(tiny_checkpoint),
        {"gpu_memory_utilization": 0.3},
    )
    assert judge.max_model_len == 2048  # the tiny model's max_position_embeddings, not the rollout's 64
    assert (judge.tensor_parallel_size, judge.lora_rank, judge.partial_rollout) == (1, 0, False)
    assert (judge.dtype, judge.seed) == ("bf16", 3)


def test_a_run_stopped_by_judge_fallbacks_names_the_judge():
    from rl_launch.health import HealthError, HealthMonitor

    health = HealthMonitor(config(reward__judge_pretrain="/m/j", health__max_fallback_steps="1"))
    with pytest.raises(
        HealthError, match=r"the judge \(reward.judge_pretrain /m/j; reward.judge_timeout_s = 300"
    ):
        health.check(1, {"reward/fallback_fraction": 1.0, "reward/fallbacks/judge": 4.0})
