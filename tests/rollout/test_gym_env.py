"""rl_rollout.gym_env: a Gymnasium-style text environment (duck-typed, no gymnasium) driven by
MultiTurnExecutor: its first observation is the prompt, later ones are feedback, its rewards the
episode's reward; bad results follow the executor's error policy. Scripted engine: fast."""

from __future__ import annotations

import pathlib

import pytest

from rl_rollout import MultiTurnExecutor, SamplingParams
from rl_rollout.gym_env import GymTextEnv, gym_env_factory, load_env_factory
from tests.rollout.fixtures.guess_number import GuessNumber
from tests.rollout.test_executors import ScriptedEngine, make_samples

FILE = pathlib.Path(__file__).parent / "fixtures" / "guess_number.py"


@pytest.fixture
def log(monkeypatch):
    monkeypatch.setattr(GuessNumber, "log", [])
    return GuessNumber.log


def test_guess_the_number_episodes_through_the_multi_turn_executor(tokenizer, log):
    # ScriptedEngine answers a history of L tokens with " The answer is 4." / " I think 12" /
    # " maybe 7 or 8" by L % 3; the label is the episode's seed, here the number to guess
    samples = make_samples(tokenizer, ["ignored", "ignored too"], [4, "12"])
    engine = ScriptedEngine(tokenizer)
    factory = gym_env_factory(
        "tests.rollout.fixtures.guess_number:GuessNumber", env_kwargs={"max_guesses": 2}, tokenizer=tokenizer
    )
    records = MultiTurnExecutor(engine, tokenizer, SamplingParams(n=1, max_new_tokens=16), env=factory).run(
        samples
    )
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Guess my number between 0 and 100."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    first_ids = tokenizer(first, add_special_tokens=False)["input_ids"]
    assert [record.prompt_ids.tolist() for record in records] == [first_ids, first_ids]
    assert engine.calls[0][0] == first_ids  # the model saw the environment's observation, not the dataset's
    assert sorted(event for event in log if event[0] == "reset") == [("reset", 4, 4), ("reset", 12, "12")]
    for record in records:
        response, mask = record.response_ids.tolist(), record.action_mask.tolist()
        text = tokenizer.decode(response)
        ranges = record.extra["action_ranges"]
        for start, end in ranges:  # actions are the engine's tokens, everything between is feedback
            assert all(mask[start:end])
        assert sum(mask) == sum(end - start for start, end in ranges)
        guesses = [event[1] for event in log if event[0] == "step"]
        assert record.reward in (0.0, 1.0)
        assert record.extra["turns"] == len(ranges) <= 2
        assert ("Higher." in text or "Lower." in text) == (record.extra["turns"] == 2 or record.reward == 0.0)
        assert record.extra["extra_logs"] == {"guesses": float(record.extra["turns"])}  # numbers of info only
    assert log.count(("close",)) == 2  # once each, when done
    assert len(guesses) == sum(record.extra["turns"] for record in records)


def test_an_empty_first_observation_keeps_the_prompt_and_text_render_keeps_it_raw():
    class Quiet:
        def reset(self, *, seed=None, options=None):
            return "", {}

        def step(self, action):
            return "", 0.5, True, False, None

    assert GymTextEnv(Quiet()).reset({"observation": "P", "label": None}) == {"observation": "P"}
    loud = GuessNumber()
    assert GymTextEnv(loud, render="text").reset({"observation": "P", "label": "x"}) == {
        "observation": "Guess my number between 0 and 100."
    }
    assert loud.target == 50  # a label that is no integer: no seed
    assert GymTextEnv(Quiet()).step({"action_text": "a"}) == {
        "rewards": 0.5,
        "scores": 0.5,
        "environment_feedback": "",
        "done": True,
        "extra_logs": {},
    }


def test_a_bad_environment_is_an_episode_error_or_the_fallback(tokenizer, log):
    class BadStep(GuessNumber):
        def step(self, action):
            return "obs", 1.0, False  # three values, not five

    samples = make_samples(tokenizer, ["q"], [3])
    engine = ScriptedEngine(tokenizer)
    run = lambda **kw: MultiTurnExecutor(  # noqa: E731
        engine,
        tokenizer,
        SamplingParams(n=1, max_new_tokens=16),
        env=gym_env_factory(BadStep, tokenizer=tokenizer),
        **kw,
    ).run(samples)
    with pytest.raises(
        Exception, match=r"env\.step\(\) returned \('obs', 1\.0, False\); expected \(observation"
    ):
        run()
    [record] = run(on_error="fallback", fallback=-1.0)
    assert (record.reward, record.finish_reason) == (-1.0, "abort")
    with pytest.raises(TypeError, match=r"a object has no reset\(\) method"):
        GymTextEnv(object())
    with pytest.raises(ValueError, match="render: 'html' is not allowed"):
        gym_env_factory(GuessNumber, render="html")


def test_env_specs_name_a_module_or_a_file_and_errors_name_the_spec():
    assert load_env_factory(f"{FILE}:GuessNumber")().high == 100
    assert load_env_factory("tests.rollout.fixtures.guess_number:GuessNumber") is GuessNumber
    for spec, error, says in [
        ("GuessNumber", ValueError, "expected 'package.module:NAME'"),
        ("no_such_module_x:Env", ImportError, "cannot import module 'no_such_module_x'"),
        (f"{FILE.parent}/missing.py:Env", FileNotFoundError, "env file .*missing.py. does not exist"),
        (f"{FILE}:Nope", AttributeError, "has no attribute 'Nope'"),
        (f"{FILE}:re", TypeError, "is a module, not a class or function"),
    ]:
        with pytest.raises(error, match=says):
            load_env_factory(spec)


def test_close_ends_every_episode_also_at_max_turns_and_after_an_error(tokenizer, log):
    # label 99: the scripted guesses (4, 12, 7) are never right, so the env never says done
    samples = make_samples(tokenizer, ["q"], [99])

    class BadSecondStep(GuessNumber):
        def step(self, action):
            if self.guesses:
                raise RuntimeError("the env broke")
            return super().step(action)

    def run(env, **options):
        factory = gym_env_factory(env, env_kwargs={"max_guesses": 5}, tokenizer=tokenizer)
        sampling = SamplingParams(n=1, max_new_tokens=16)
        return MultiTurnExecutor(ScriptedEngine(tokenizer), tokenizer, sampling, env=factory, **options).run(
            samples
        )

    [record] = run(GuessNumber, max_turns=2)
    assert (record.extra["turns"], record.finish_reason) == (2, "length")  # max_turns ended it
    assert log.count(("close",)) == 1
    [record] = run(BadSecondStep, on_error="fallback", fallback=-1.0)
    assert (record.reward, record.finish_reason) == (-1.0, "abort")
    assert log.count(("close",)) == 2
