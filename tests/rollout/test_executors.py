"""Single- and multi-turn executors: records, masks, no re-tokenisation, agent files, failures.

Bookkeeping tests use `ScriptedEngine`, a deterministic implementation of OUR `Engine` protocol
(not a stand-in for vLLM): the action for a prompt is chosen by the prompt's length, and every
call is logged so a test can check exactly which token ids the engine saw and returned. The
end-to-end tests run the real `HFEngine` on the tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys

import pytest
import torch

from rl_data import PromptSample, Trajectory
from rl_rollout.executors import (
    EpisodeError,
    MultiTurnExecutor,
    SingleTurnExecutor,
    load_agent_class,
)
from rl_rollout.protocol import Engine, Generation, SamplingParams
from rl_rollout.rewards import NumericAnswerReward, PerSampleReward

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ACTIONS = [" The answer is 4.", " I think 12", " maybe 7 or 8"]


class ScriptedEngine(Engine):
    """Answers a prompt of length L with ACTIONS[L % 3] + EOS; log-prob of token t is −(t+1)/10."""

    name = "ScriptedEngine"

    def __init__(self, tokenizer, *, max_model_len=512, eos=True, delay_s=0.0):
        self.tokenizer, self._max_model_len, self.eos, self.delay_s = tokenizer, max_model_len, eos, delay_s
        self.policy_version = 7
        self.calls: list[tuple[list[int], SamplingParams, list[int]]] = []
        self.in_flight = self.max_in_flight = 0

    @property
    def max_model_len(self):
        return self._max_model_len

    def _one(self, prompt, params):
        ids = self.tokenizer(ACTIONS[len(prompt) % 3], add_special_tokens=False)["input_ids"]
        ids = ids + ([self.tokenizer.eos_token_id] if self.eos else [])
        finish = "stop" if self.eos else "length"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        self.calls.append((list(prompt), params, ids))
        logprobs = [-(t + 1) / 10 for t in range(len(ids))] if params.logprobs else None
        return Generation(
            token_ids=ids, logprobs=logprobs, finish_reason=finish, policy_version=self.policy_version
        )

    def generate(self, prompts, params):
        return [[self._one(list(p), params) for _ in range(params.n)] for p in prompts]

    async def agenerate(self, prompt, params):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        return [self._one(list(prompt), params) for _ in range(params.n)]


def make_samples(tokenizer, texts, labels):
    samples = []
    for index, (text, label) in enumerate(zip(texts, labels, strict=True)):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        samples.append(
            PromptSample(
                prompt_ids=ids, prompt=prompt, label=label, index=index, source="toy.jsonl", row=index
            )
        )
    return samples


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_samples(tokenizer, ["What is 2 + 2?", "What is 3 * 4?"], [4, 12])


# ---------------------------------------------------------------------------------------------
# Single turn.


def test_single_turn_records_groups_rewards_and_logprobs(tokenizer, samples):
    engine = ScriptedEngine(tokenizer)
    seen = []

    def reward(query, prompt, label):
        seen.append((query, prompt, label))
        return NumericAnswerReward().score(query[len(prompt) :], label)

    executor = SingleTurnExecutor(
        engine, PerSampleReward(reward), tokenizer, SamplingParams(n=2, max_new_tokens=32)
    )
    records = executor.run(samples)
    assert len(records) == 4
    assert all(isinstance(r, Trajectory) for r in records)
    assert [r.group_id for r in records] == [0, 0, 1, 1]
    for record, (prompt, _, ids) in zip(records, engine.calls, strict=True):
        assert record.prompt_ids.tolist() == prompt
        assert record.response_ids.tolist() == ids
        assert record.action_mask.all()
        assert record.action_mask.numel() == len(ids)
        assert record.rollout_logprobs.tolist() == pytest.approx([-(t + 1) / 10 for t in range(len(ids))])
        assert record.policy_version == 7
        assert record.finish_reason == "stop"
    # queries are the prompt text followed by the decoded response (special tokens kept)
    query, prompt, label = seen[0]
    assert prompt == samples[0].prompt
    assert label == 4
    assert query == prompt + tokenizer.decode(engine.calls[0][2], skip_special_tokens=False)
    assert query.endswith("<|im_end|>")
    expected = [float(NumericAnswerReward().score(q[len(p) :], lab)) for q, p, lab in seen]
    assert [r.reward for r in records] == expected
    assert [r.extra["sample_index"] for r in records] == [0, 0, 1, 1]
    assert executor.run(samples[:1])[0].group_id == 2  # group ids never repeat across calls
    assert executor.last_metrics["rollout/responses"] == 2.0


def test_single_turn_explicit_group_ids_and_bad_input(tokenizer, samples):
    executor = SingleTurnExecutor(
        ScriptedEngine(tokenizer), NumericAnswerReward(), tokenizer, SamplingParams()
    )
    assert [r.group_id for r in executor.run(samples, group_ids=[40, 41])] == [40, 41]
    with pytest.raises(ValueError, match=r"group_ids must be 2 distinct integers"):
        executor.run(samples, group_ids=[1, 1])
    with pytest.raises(TypeError, match=r"samples\[1\] is a str, not a PromptSample"):
        executor.run([samples[0], "text"])


# ---------------------------------------------------------------------------------------------
# Multi turn, bookkeeping with the scripted engine and the OpenRLHF agent file.


def test_agent_file_loads_unchanged_without_leaving_a_fake_openrlhf():
    cls = load_agent_class(FIXTURES / "agent_openrlhf.py")
    assert cls.__name__ == "AgentInstance"
    assert "openrlhf" not in sys.modules
    assert "openrlhf.utils.agent" not in sys.modules


@pytest.mark.skipif(importlib.util.find_spec("gem") is not None, reason="gem is installed here")
def test_agent_file_needing_an_environment_library_names_the_package_to_install(tmp_path):
    # the shape of OpenRLHF's GEM example: an environment library imported next to the agent base
    agent = tmp_path / "agent_gem_like.py"
    agent.write_text(
        "import gem\n"
        "from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    async def __init__(self, *args, **kwargs):\n"
        "        self.env = gem.make('game:GuessTheNumber-v0')\n\n"
        "    async def step(self, states, **kwargs):\n"
        "        return {}\n"
    )
    with pytest.raises(
        ImportError,
        match=r"agent_gem_like\.py' failed to import: it imports 'gem', which is not "
        r"installed: GEM, .*pip install gem-llm",
    ):
        load_agent_class(agent)
    assert "openrlhf" not in sys.modules


@pytest.mark.skipif(importlib.util.find_spec("openrlhf") is not None, reason="openrlhf is installed here")
def test_agent_file_importing_more_of_openrlhf_than_the_stand_in_says_so(tmp_path):
    agent = tmp_path / "agent_grader.py"
    agent.write_text(
        "from openrlhf.utils import grade_answer\n"
        "from openrlhf.utils.agent import AgentInstanceBase\n\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    async def step(self, states, **kwargs):\n"
        "        return {}\n"
    )
    with pytest.raises(
        ImportError, match=r"imports from 'openrlhf\.utils' what its stand-in lacks .*grade_answer"
    ):
        load_agent_class(agent)


def test_agent_file_errors_name_the_file(tmp_path):
    empty = tmp_path / "agent_empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(AttributeError, match=r"agent_empty\.py' defines neither an AgentInstance class"):
        load_agent_class(empty)


def test_multi_turn_masks_logprobs_and_history_are_exact(tokenizer, samples):
    engine = ScriptedEngine(tokenizer)
    executor = MultiTurnExecutor(
        engine,
        tokenizer,
        SamplingParams(n=2, max_new_tokens=32),
        env=FIXTURES / "agent_openrlhf.py",
        max_turns=5,
    )
    records = executor.run(samples)
    assert len(records) == 4
    assert [r.group_id for r in records] == [0, 0, 1, 1]
    calls = {tuple(prompt): ids for prompt, _, ids in engine.calls}
    for record, sample in zip(records, [samples[0]] * 2 + [samples[1]] * 2, strict=True):
        prompt = record.prompt_ids.tolist()
        assert prompt == sample.prompt_ids.tolist()
        response, mask = record.response_ids.tolist(), record.action_mask.tolist()
        logprobs = record.rollout_logprobs.tolist()
        # Rebuild the expected response turn by turn from what the engine returned.
        expected, expected_mask, expected_logprobs, ranges = [], [], [], []
        for turn in range(3):
            action = calls[tuple(prompt + expected)]  # the engine saw exactly prompt + history
            ranges.append([len(expected), len(expected) + len(action)])
            expected += action
            expected_mask += [True] * len(action)
            expected_logprobs += [-(t + 1) / 10 for t in range(len(action))]
            if turn < 2:
                feedback = tokenizer(f"\nHint {turn + 1}: try again.\n", add_special_tokens=False)[
                    "input_ids"
                ]
                expected += feedback
                expected_mask += [False] * len(feedback)
                expected_logprobs += [0.0] * len(feedback)
        assert response == expected
        assert mask == expected_mask
        assert logprobs == pytest.approx(expected_logprobs)
        assert record.extra["action_ranges"] == ranges
        assert record.extra["turns"] == 3
        assert record.reward == pytest.approx(0.25 + 0.25 + 1.0)  # summed step rewards
        assert record.score == 1.0  # the last step's score
        assert record.finish_reason == "stop"
        assert record.policy_version == 7
        assert record.extra["extra_logs"] == {"step": 3.0}
    assert executor.last_metrics["rollout/turns_mean"] == 3.0


def test_episodes_run_concurrently(tokenizer, samples):
    engine = ScriptedEngine(tokenizer, delay_s=0.05)
    executor = MultiTurnExecutor(engine, tokenizer, SamplingParams(n=4), env=FIXTURES / "agent_openrlhf.py")
    executor.run(samples)
    assert engine.max_in_flight == 8  # all 2 x 4 episodes had a request in flight at once
    limited = MultiTurnExecutor(
        ScriptedEngine(tokenizer, delay_s=0.05),
        tokenizer,
        SamplingParams(n=4),
        env=FIXTURES / "agent_openrlhf.py",
        max_concurrency=3,
    )
    limited.run(samples)
    assert limited.engine.max_in_flight == 3


def test_old_agent_file_with_async_init_works(tokenizer, samples):
    executor = MultiTurnExecutor(
        ScriptedEngine(tokenizer),
        tokenizer,
        SamplingParams(),
        env=FIXTURES / "agent_async_init.py",
        max_turns=4,
    )
    record = executor.run(samples[:1])[0]
    assert record.extra["turns"] == 2
    assert record.reward == 1.0
    assert record.score == 1.0
    feedback = tokenizer(" again", add_special_tokens=False)["input_ids"]
    assert record.response_ids.tolist()[-len(feedback) :] == feedback


class NeverDone:
    async def reset(self, states):
        return {"observation": states["observation"]}

    async def step(self, states):
        return {"rewards": 0.5, "environment_feedback": " more", "done": False}


def test_environment_that_never_finishes_stops_at_max_turns(tokenizer, samples):
    executor = MultiTurnExecutor(
        ScriptedEngine(tokenizer), tokenizer, SamplingParams(), env=NeverDone, max_turns=3
    )
    record = executor.run(samples[:1])[0]
    assert record.finish_reason == "length"
    assert record.extra["turns"] == 3
    assert record.reward == 1.5
    assert record.score == 1.5


def test_max_length_truncates_and_ends_with_length(tokenizer, samples):
    prompt_length = samples[0].prompt_ids.numel()
    engine = ScriptedEngine(tokenizer)
    executor = MultiTurnExecutor(
        engine,
        tokenizer,
        SamplingParams(max_new_tokens=64),
        env=NeverDone,
        max_turns=50,
        max_length=prompt_length + 20,
    )
    record = executor.run(samples[:1])[0]
    assert record.finish_reason == "length"
    assert record.num_tokens == prompt_length + 20
    # each turn's budget is what is left of max_length
    for prompt, params, _ in engine.calls:
        assert params.max_new_tokens == min(64, prompt_length + 20 - len(prompt))


class Broken:
    def __init__(self):
        self.turn = 0

    def reset(self, states):  # synchronous methods work too
        return {"observation": states["observation"]}

    def step(self, states):
        self.turn += 1
        if self.turn == 2:
            raise RuntimeError("tool crashed")
        return {"rewards": 1.0, "environment_feedback": " ok", "done": False}


def test_environment_error_names_the_sample_or_falls_back(tokenizer, samples):
    executor = MultiTurnExecutor(ScriptedEngine(tokenizer), tokenizer, SamplingParams(), env=Broken)
    with pytest.raises(
        EpisodeError,
        match=r"episode 0 of sample \(index 1, toy.jsonl row 1\) failed: RuntimeError\('tool crashed'\)",
    ):
        executor.run(samples[1:])
    tolerant = MultiTurnExecutor(
        ScriptedEngine(tokenizer),
        tokenizer,
        SamplingParams(n=2),
        env=Broken,
        on_error="fallback",
        fallback=-1.0,
    )
    records = tolerant.run(samples)
    assert [r.finish_reason for r in records] == ["abort"] * 4
    assert [r.reward for r in records] == [-1.0] * 4
    assert all("tool crashed" in r.extra["episode_error"] for r in records)
    assert records[0].extra["turns"] == 2  # the trajectory so far is kept, masks consistent
    assert records[0].action_mask.numel() == records[0].response_ids.numel()
    assert tolerant.last_metrics["rollout/episode_failures"] == 4.0


class Hangs:
    async def reset(self, states):
        return {"observation": states["observation"]}

    async def step(self, states):
        await asyncio.sleep(3600)


def test_hanging_environment_hits_the_episode_timeout(tokenizer, samples):
    executor = MultiTurnExecutor(
        ScriptedEngine(tokenizer), tokenizer, SamplingParams(), env=Hangs, episode_timeout_s=0.2
    )
    with pytest.raises(
        EpisodeError, match=r"episode 0 of sample \(index 0, toy.jsonl row 0\) timed out after 0.2 s"
    ):
        executor.run(samples[:1])


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (
            {"rewards": 1.0, "done": True},
            r"step\(\) result lacks \['environment_feedback \(or environment_messages, not both\)'\]",
        ),
        (
            {"rewards": 1.0, "done": True, "environment_feedback": "", "environment_messages": []},
            r"lacks \['environment_feedback \(or environment_messages, not both\)'\]",
        ),
        (
            {"rewards": 1.0, "done": True, "environment_messages": "text"},
            r"environment_messages of type str; expected a list of chat messages",
        ),
        ({"rewards": float("nan"), "environment_feedback": "", "done": True}, r"'rewards' = nan"),
        ({"rewards": torch.ones(2), "environment_feedback": "", "done": True}, r"'rewards' with 2 values"),
    ],
)
def test_malformed_step_results_are_errors(tokenizer, samples, result, message):
    class Env:
        async def reset(self, states):
            return {"observation": states["observation"]}

        async def step(self, states):
            return result

    executor = MultiTurnExecutor(ScriptedEngine(tokenizer), tokenizer, SamplingParams(), env=Env)
    with pytest.raises(EpisodeError, match=message):
        executor.run(samples[:1])


def test_chat_feedback_is_a_templated_turn_after_the_end_of_turn_token(tokenizer, samples):
    class Env:
        async def reset(self, states):
            return {"observation": states["observation"]}

        async def step(self, states):
            return {
                "rewards": 0.0,
                "environment_feedback": "tool says 5",
                "done": "5" in states["observation_text"],
            }

    executor = MultiTurnExecutor(
        ScriptedEngine(tokenizer),
        tokenizer,
        SamplingParams(),
        env=Env,
        feedback="chat",
        feedback_role="tool",
        max_turns=2,
    )
    record = executor.run(samples[:1])[0]
    first, second = record.extra["action_ranges"]
    feedback = record.response_ids[first[1] : second[0]].tolist()
    assert tokenizer.decode(feedback) == "\n<|im_start|>tool\ntool says 5<|im_end|>\n<|im_start|>assistant\n"
    assert not record.action_mask[first[1] : second[0]].any()


def test_changed_observation_is_tokenised_as_the_prompt(tokenizer, samples):
    class Env:
        async def reset(self, states):
            return {"observation": "Solve: " + states["observation"]}

        async def step(self, states):
            assert states["observation_text"].startswith("Solve: ")
            return {"rewards": 1.0, "environment_feedback": "", "done": True}

    record = MultiTurnExecutor(ScriptedEngine(tokenizer), tokenizer, SamplingParams(), env=Env).run(
        samples[:1]
    )[0]
    expected = tokenizer("Solve: " + samples[0].prompt, add_special_tokens=False)["input_ids"]
    assert record.prompt_ids.tolist() == expected


# ---------------------------------------------------------------------------------------------
# End to end with the real HFEngine on the tiny model.


@pytest.fixture(scope="module")
def hf_engine(tiny_checkpoint):
    from rl_rollout.engines.hf import HFEngine

    engine = HFEngine(str(tiny_checkpoint), dtype="float32", device="cpu", max_model_len=256)
    yield engine
    engine.close()


def test_single_turn_end_to_end_with_hf_engine(hf_engine, tokenizer, samples):
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=1)
    executor = SingleTurnExecutor(hf_engine, NumericAnswerReward(), tokenizer, sampling)
    records = executor.run(samples)
    assert len(records) == 6
    assert [r.group_id for r in records] == [0, 0, 0, 1, 1, 1]
    again = hf_engine.generate([s.prompt_ids.tolist() for s in samples], sampling)  # seeded: reproducible
    for record, generation in zip(records, [g for row in again for g in row], strict=True):
        assert record.response_ids.tolist() == generation.token_ids
        assert record.rollout_logprobs.tolist() == pytest.approx(generation.logprobs, abs=1e-5)
        assert record.finish_reason == generation.finish_reason
        assert record.reward in (0.0, 1.0)


def test_multi_turn_end_to_end_with_hf_engine_and_agent_file(hf_engine, tokenizer, samples):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, n=2)
    executor = MultiTurnExecutor(
        hf_engine, tokenizer, sampling, env=FIXTURES / "agent_openrlhf.py", max_turns=3, max_concurrency=4
    )
    records = executor.run(samples)
    assert len(records) == 4
    for record in records:
        prompt = record.prompt_ids.tolist()
        response = record.response_ids.tolist()
        mask = record.action_mask.tolist()
        assert record.rollout_logprobs is not None
        for start, end in record.extra["action_ranges"]:
            # no re-tokenisation: replaying the exact history gives the same action tokens (greedy)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
            generation = hf_engine.generate([prompt + response[:start]], greedy)[0][0]
            assert response[start:end] == generation.token_ids
            assert record.rollout_logprobs[start:end].tolist() == pytest.approx(generation.logprobs, abs=1e-4)
            assert all(mask[start:end])
        action_positions = {t for start, end in record.extra["action_ranges"] for t in range(start, end)}
        assert [t for t, m in enumerate(mask) if m] == sorted(action_positions)
        off = [record.rollout_logprobs[t].item() for t in range(len(mask)) if not mask[t]]
        assert off == [0.0] * len(off)
        assert len(off) > 0


class SyncingEngine(ScriptedEngine):
    """A ScriptedEngine whose weights change mid-action: every call's first token is the current
    version's, the rest the next one's (partial rollout), and the next call starts there."""

    def _one(self, prompt, params):
        generation = super()._one(prompt, params)
        first, self.policy_version = self.policy_version, self.policy_version + 1
        generation.policy_version = first
        generation.token_versions = [first] + [first + 1] * (len(generation.token_ids) - 1)
        return generation


def test_records_carry_the_version_of_every_token_single_and_multi_turn(tokenizer, samples):
    [record, *_] = SingleTurnExecutor(
        SyncingEngine(tokenizer), NumericAnswerReward(), tokenizer, SamplingParams()
    ).run(samples[:1])
    assert record.policy_version == 7
    assert record.token_versions.tolist() == [7] + [8] * (record.response_ids.numel() - 1)

    executor = MultiTurnExecutor(
        SyncingEngine(tokenizer),
        tokenizer,
        SamplingParams(max_new_tokens=32),
        env=FIXTURES / "agent_openrlhf.py",
    )
    [episode, *_] = executor.run(samples[:1])
    versions, mask = episode.token_versions.tolist(), episode.action_mask.tolist()
    ranges = episode.extra["action_ranges"]
    assert episode.policy_version == 7  # its first token's
    for turn, (start, end) in enumerate(ranges):  # turn k: version 7 + k, then 8 + k
        assert versions[start:end] == [7 + turn] + [8 + turn] * (end - start - 1), turn
        if turn + 1 < len(ranges):  # the feedback after it: no action, the version before it
            assert not any(mask[end : ranges[turn + 1][0]])
            assert set(versions[end : ranges[turn + 1][0]]) == {8 + turn}
