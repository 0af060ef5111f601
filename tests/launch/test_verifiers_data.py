"""A verifiers environment in `rl-launch ppo` without Ray: `--data.prompt_data verifiers:<taskset>`
as the data pipeline resolves it, `--reward.function verifiers` and `--rollout.executor verifiers`
as the registries build them (bad ones refused before anything starts), and the rollout actor's
own code (`RolloutWorker`, the class itself, on the hf engine and the tiny model) playing a
multi-turn verifiers env whose rewards are its rubric's, recomputed here. The environments are
files (tests/rollout/fixtures/verifiers_*.py); the test environment holds `rl-launch[verifiers]`."""

from __future__ import annotations

import itertools
import json
import pathlib

import pytest

from rl_data import Trajectory, decode, encode
from rl_launch.components import REWARDS, executor_options
from rl_launch.preflight import PreflightError, resolve_inputs
from rl_launch.rollouts import rollout_metrics
from rl_rollout import SamplingParams
from tests.launch.test_data_eval import load, prepare
from tests.launch.test_executors import config, refused
from tests.rollout.fixtures.verifiers_guess import hint
from tests.rollout.fixtures.verifiers_say import rubric

FIXTURES = pathlib.Path(__file__).parents[1] / "rollout" / "fixtures"
SAY, GUESS = FIXTURES / "verifiers_say.py", FIXTURES / "verifiers_guess.py"


def test_a_taskset_is_a_source_whose_prompts_are_chat_messages_and_whose_labels_its_rubric_scores(
    tiny_checkpoint,
):
    train, evaluation = load(
        tiny_checkpoint,
        data__prompt_data=f"verifiers:{SAY}?limit=4",
        data__eval_dataset=f"verifiers:{SAY}?size=6&system=Digits.",
        reward__function="verifiers",
    )
    assert (len(train), len(evaluation)) == (4, 6)
    assert train.labels == {f"verifiers:{SAY}?limit=4": "verifiers_say"}
    sample = train[3]
    assert sample.prompt.startswith("<|im_start|>system\nAnswer with the number only.<|im_end|>\n")
    assert "<|im_start|>user\nSay the number 3.<|im_end|>" in sample.prompt
    assert "system\nDigits." in evaluation[5].prompt
    assert json.loads(sample.label)["data"]["answer"] == "3"
    output = REWARDS["verifiers"]()(["3", "The number is 4."], ["p", "p"], [sample.label] * 2)
    assert output.rewards == [rubric("3", "3"), rubric("3", "The number is 4.")] == [1.5, 0.0]


def test_a_taskset_that_does_not_load_or_refuses_its_options_stops_the_run_before_it_starts(tiny_checkpoint):
    with pytest.raises(
        PreflightError, match=r"^data\.prompt_data: verifiers:no_such_pkg_q: .*importable module"
    ):
        prepare(tiny_checkpoint, data__prompt_data="verifiers:no_such_pkg_q")
    with pytest.raises(
        PreflightError,
        match=r"^data\.eval_dataset: verifiers:.*verifiers_say.py: SayConfig refused the options",
    ):
        prepare(
            tiny_checkpoint,
            data__prompt_data=f"verifiers:{SAY}",
            data__eval_dataset=f"verifiers:{SAY}?sise=3",
        )
    relative = f"verifiers:{SAY.relative_to(pathlib.Path.cwd())}?limit=4"  # the suite runs in the repo
    config_, _, _ = prepare(tiny_checkpoint, data__prompt_data=relative)
    assert resolve_inputs(config_, None).prompt_data == (
        f"verifiers:{SAY}?limit=4",
    )  # resolved for the actors


def test_the_verifiers_executor_takes_multi_turns_options_and_refuses_a_reward_function():
    resolved = config(
        rollout__executor="verifiers",
        rollout__executor_options__max_turns="2",
        rollout__executor_options__scoring_timeout_s="5",
    )
    assert resolved.rollout.executor_options == {"max_turns": 2, "scoring_timeout_s": 5.0}
    assert set(executor_options("multi_turn")) < set(executor_options("verifiers"))
    refused(
        r"^reward\.function: with rollout\.executor verifiers the environment's own rewards are the reward",
        rollout__executor="verifiers",
        reward__function="verifiers",
    )
    refused(
        r"^rollout\.executor_options: rollout executor 'verifiers' refused its options: .*max_turns",
        rollout__executor="verifiers",
        rollout__executor_options__max_turns="0",
    )


def test_the_rollout_worker_plays_a_multi_turn_verifiers_env_scored_by_its_rubric(tiny_checkpoint):
    """The actor's own code builds the verifiers executor from its options: each record's prompt is
    the env's first observation, its hints are feedback (mask 0), its reward is the rubric's
    (solved when a reply names the target), recomputed from the replies the engine wrote."""
    from rl_launch.actors import EngineSpec, RolloutWorker

    train, _ = load(
        tiny_checkpoint, data__prompt_data=f"verifiers:{GUESS}?size=4", rollout__executor="verifiers"
    )
    spec = EngineSpec(
        kind="hf",
        model_path=str(tiny_checkpoint),
        dtype="fp32",
        max_model_len=256,
        seed=0,
        executor="verifiers",
        executor_options={"max_turns": 2},
    )
    worker = RolloutWorker(spec)
    try:
        prompts = [train[index] for index in range(len(train))]
        sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
        records = decode(worker.generate(encode(prompts), sampling, 10, False), list[Trajectory])
    finally:
        worker.close()
    tokenizer = worker.tokenizer
    assert [record.group_id for record in records] == [10, 10, 11, 11, 12, 12, 13, 13]
    for index, record in enumerate(records):
        target = index // 2  # the tasks' targets are their indexes
        assert record.prompt_ids.tolist() == prompts[index // 2].prompt_ids.tolist()
        response, mask = record.response_ids.tolist(), record.action_mask.tolist()
        ranges = record.extra["action_ranges"]
        replies = [tokenizer.decode(response[a:b], skip_special_tokens=True).strip() for a, b in ranges]
        answers = [hint(target, reply) for reply in replies]
        assert record.reward == float(None in answers)  # the rubric: solved once a reply names the target
        assert len(ranges) == (answers.index(None) + 1 if None in answers else 2)  # max_turns 2 ends it
        for turn, ((_, end), (start, _)) in enumerate(itertools.pairwise(ranges)):
            assert answers[turn] in tokenizer.decode(response[end:start])
            assert not any(mask[end:start])
        assert record.extra["extra_logs"]["guesses"] == float(len(ranges))
    metrics = rollout_metrics(records)
    assert metrics["rollout/episode_failures"] == 0.0
    assert metrics["rollout/agent/finalized"] == 1.0
