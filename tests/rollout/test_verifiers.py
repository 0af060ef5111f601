"""rl_rollout.verifiers_env and rl_rollout.verifiers_episode on real verifiers 0.4 environments
written to files (tests/rollout/fixtures/verifiers_*.py and small ones here): a taskset's tasks
become prompt rows whose labels rebuild them, its rubric scores our response, and its own
`Env.run` plays multi-turn episodes with our engine in its seat. A scripted engine: fast, no
model. The test environment holds `rl-rollout[verifiers]` (pyproject.toml): without it this fails."""

from __future__ import annotations

import itertools
import json
import pathlib
import textwrap

import pytest

from rl_data import PromptSample
from rl_rollout import EpisodeError, MultiTurnExecutor, RewardError, SamplingParams, VerifiersReward
from rl_rollout.protocol import Engine, Generation
from rl_rollout.verifiers_env import (
    LOAD_ERRORS,
    load_verifiers_environment,
    parse_verifiers_source,
    task_of_label,
    verifiers_rows,
)
from rl_rollout.verifiers_episode import verifiers_env_factory
from tests.rollout.fixtures.verifiers_guess import hint
from tests.rollout.fixtures.verifiers_say import rubric

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
SAY, GUESS = FIXTURES / "verifiers_say.py", FIXTURES / "verifiers_guess.py"


class TurnEngine(Engine):
    """Answers the k-th model turn of a conversation (k: assistant turns in its history) with
    `replies[k]` and EOS."""

    name = "TurnEngine"

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.histories = tokenizer, replies, []

    @property
    def max_model_len(self):
        return 1024

    def generate(self, prompts, params):
        raise NotImplementedError

    async def agenerate(self, prompt, params):
        self.histories.append(list(prompt))
        turn = self.tokenizer.decode(list(prompt)).count("<|im_start|>assistant") - 1
        ids = self.tokenizer(self.replies[turn], add_special_tokens=False)["input_ids"]
        ids.append(self.tokenizer.eos_token_id)
        return [Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")]


def samples_of(tokenizer, rows):
    samples = []
    for index, row in enumerate(rows):
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        samples.append(PromptSample(prompt_ids=ids, prompt=prompt, label=row["label"], index=index))
    return samples


def play(tokenizer, source, replies, *, max_turns=8, factory=None, **options):
    """(records, engine) of the verifiers episodes of `source`'s tasks, our engine answering
    `replies`; `factory`: options of `verifiers_env_factory`, `options`: the executor's."""
    engine = TurnEngine(tokenizer, replies)
    env = verifiers_env_factory(tokenizer, max_turns=max_turns, **(factory or {}))
    sampling = SamplingParams(n=1, max_new_tokens=16)
    executor = MultiTurnExecutor(engine, tokenizer, sampling, env=env, max_turns=max_turns, **options)
    return executor.run(samples_of(tokenizer, verifiers_rows(source))), engine


def write_taskset(tmp_path, body, name="extra_env"):
    """A taskset module file: verifiers imported as vf, then `body`."""
    path = tmp_path / f"{name}.py"
    path.write_text("import asyncio\nimport time\n\nimport verifiers.v1 as vf\n\n" + textwrap.dedent(body))
    return path


ECHO = """
class EchoTask(vf.Task):
    @vf.reward
    async def said(self, trace) -> float:
        return float(len(trace.last_reply))

class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        yield EchoTask(vf.TaskData(prompt="Say something."), self.config.task)
"""


def test_a_source_names_a_taskset_and_its_options_and_bad_sources_are_named():
    assert parse_verifiers_source("verifiers:envs/a.py") == ("envs/a.py", {})
    assert parse_verifiers_source("verifiers:my.envs?limit=8&size=64&mode=hard&p=0.5") == (
        "my.envs",
        {"limit": 8, "size": 64, "mode": "hard", "p": 0.5},
    )
    for bad, message in [
        ("verifiers:", "expected verifiers:<module or path/to/file.py>"),
        ("verifiers:a.py?limit=0", "limit=0; expected an integer >= 1"),
        ("verifiers:a.py?limit=x", "limit='x'; expected an integer >= 1"),
        ("verifiers:a.py?size", "bad query field"),
        ("reasoning_gym:a", "does not start with 'verifiers:'"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_verifiers_source(bad)


def test_rows_give_each_tasks_prompt_messages_and_a_label_that_rebuilds_the_task():
    rows = verifiers_rows(f"verifiers:{SAY}?size=4&limit=3&system=Digits.", input_key="q", label_key="y")
    assert [row["q"] for row in rows] == [
        [{"role": "system", "content": "Digits."}, {"role": "user", "content": f"Say the number {n}."}]
        for n in range(3)
    ]
    label = json.loads(rows[2]["y"])
    assert label["verifiers"] == str(SAY)
    assert label["options"] == {"size": 4, "limit": 3, "system": "Digits."}
    environment, task = task_of_label(rows[2]["y"])
    assert (task.data.answer, task.data.idx, task.data.prompt) == ("2", 2, "Say the number 2.")
    assert environment.seat == "agent"
    assert not environment.drives_episodes
    assert environment is load_verifiers_environment(str(SAY), {"size": 4, "limit": 3, "system": "Digits."})


def test_the_reward_is_the_tasks_rubric_on_the_response_and_bad_labels_follow_the_error_policy():
    rows = verifiers_rows(f"verifiers:{SAY}")
    responses = ["3", " It is 3, surely.", "five", "The number 5."]
    labels = [rows[3]["label"], rows[3]["label"], rows[5]["label"], rows[5]["label"]]
    output = VerifiersReward()(responses, ["p"] * 4, labels)
    assert output.rewards == [rubric(answer, reply) for answer, reply in zip("3355", responses)]
    assert output.rewards == [1.5, 1.0, 0.5, 1.0]
    with pytest.raises(
        RewardError, match=r"label '7' is not a verifiers label \(data.prompt_data verifiers:"
    ):
        VerifiersReward()(["3"], ["p"], ["7"])
    assert VerifiersReward(on_error="fallback", fallback=-1.0)(["3"], ["p"], ["7"]).rewards == [-1.0]
    with pytest.raises(
        RewardError, match=r"GuessEnv.run\(\) drives the episode; .*--rollout.executor verifiers"
    ):
        VerifiersReward()(["3"], ["p"], [verifiers_rows(f"verifiers:{GUESS}?size=1")[0]["label"]])


def test_an_async_rubric_past_its_deadline_follows_the_error_policy(tmp_path, tokenizer):
    slow = write_taskset(
        tmp_path,
        """
        class SlowTask(vf.Task):
            @vf.reward
            async def forever(self, trace) -> float:
                await asyncio.sleep(60)
                return 1.0

        class SlowTaskset(vf.Taskset[SlowTask, vf.TasksetConfig]):
            def load(self):
                yield SlowTask(vf.TaskData(prompt="Wait."), self.config.task)

        __all__ = ["SlowTaskset"]
        """,
        name="slow_env",
    )
    [row] = verifiers_rows(f"verifiers:{slow}")
    with pytest.raises(RewardError, match=r"SlowTask's scoring ran past its 0.2 s deadline"):
        VerifiersReward(scoring_timeout_s=0.2)(["ok"], ["p"], [row["label"]])
    fallback = VerifiersReward(scoring_timeout_s=0.2, on_error="fallback", fallback=-2.0)
    assert fallback(["ok"], ["p"], [row["label"]]).rewards == [-2.0]
    with pytest.raises(EpisodeError, match=r"SlowTask's scoring ran past its 0.2 s deadline"):
        play(tokenizer, f"verifiers:{slow}", ["ok"], factory={"scoring_timeout_s": 0.2})
    [record], _ = play(
        tokenizer,
        f"verifiers:{slow}",
        ["ok"],
        factory={"scoring_timeout_s": 0.2},
        on_error="fallback",
        fallback=-2.0,
    )
    assert (record.reward, record.finish_reason) == (-2.0, "abort")


@pytest.mark.parametrize(
    ("body", "options", "message"),
    [
        (None, {}, r"verifiers:.*missing\.py: taskset file .* does not exist"),
        ("X = 1\n", {}, r"the module defines no __all__; it must export its vf.Taskset subclass"),
        (
            ECHO + "__all__ = []\n",
            {},
            r"__all__ exports 0 vf.Taskset subclasses \(none\); expected exactly one",
        ),
        (
            ECHO + "__all__ = ['EchoTaskset']\n",
            {"sise": 3},
            r"TasksetConfig refused the options \{'sise': 3\}: sise: Extra inputs are not permitted \(its "
            r"fields: system_prompt; and limit=N\)",
        ),
        (
            ECHO
            + """
class TwoConfig(vf.EnvConfig):
    a: vf.AgentConfig = vf.AgentConfig()
    b: vf.AgentConfig = vf.AgentConfig()

class TwoEnv(vf.Env[TwoConfig]):
    async def run(self, task, agents):
        pass

__all__ = ["EchoTaskset", "TwoEnv"]
""",
            {},
            r"TwoEnv declares the seats \['a', 'b'\]; rl-rollout plays exactly one seat",
        ),
        (
            ECHO.replace("class EchoTaskset(", "class Forever(")
            + "class EchoTaskset(Forever):\n    INFINITE = True\n__all__ = ['EchoTaskset']\n",
            {},
            r"EchoTaskset is infinite; give \?limit=N",
        ),
    ],
)
def test_loading_errors_name_the_taskset_and_what_is_wrong(tmp_path, body, options, message):
    path = tmp_path / "missing.py" if body is None else write_taskset(tmp_path, body, name=f"env_{len(body)}")
    query = "&".join(f"{key}={value}" for key, value in options.items())
    with pytest.raises(LOAD_ERRORS, match=message):
        verifiers_rows(f"verifiers:{path}" + (f"?{query}" if query else ""))


def test_what_rl_rollout_does_not_run_is_refused_by_name(tmp_path):
    needy = write_taskset(
        tmp_path,
        """
        class NeedyTask(vf.Task):
            async def setup(self, trace, runtime):
                pass

            @vf.stop
            async def long_request(self, request: vf.Request) -> bool:
                return False

        class NeedyTaskset(vf.Taskset[NeedyTask, vf.TasksetConfig]):
            def load(self):
                yield NeedyTask(vf.TaskData(prompt="Hi."), self.config.task)

        __all__ = ["NeedyTaskset"]
        """,
        name="needy_env",
    )
    with pytest.raises(
        ValueError,
        match=r"task NeedyTask needs setup\(\), @vf.stop long_request on a Request or Response, which "
        r"rl-rollout does not run",
    ):
        verifiers_rows(f"verifiers:{needy}")


def test_a_multi_turn_env_plays_its_episodes_with_our_engine_in_its_seat(tokenizer):
    # targets 0..3; the engine guesses 5, then 3, then 2: target 3 is found on turn 2, target 2 on
    # turn 3, targets 0 and 1 never (the seat's max_turns, 3, refuses a fourth turn)
    records, engine = play(tokenizer, f"verifiers:{GUESS}", ["5", "3", "2", "1"])
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Guess my number between 0 and 9."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert [record.reward for record in records] == [0.0, 0.0, 1.0, 1.0]
    assert [record.extra["turns"] for record in records] == [3, 3, 3, 2]
    for target, record in enumerate(records):
        assert record.prompt_ids.tolist() == tokenizer(first, add_special_tokens=False)["input_ids"]
        response, mask = record.response_ids.tolist(), record.action_mask.tolist()
        ranges = record.extra["action_ranges"]
        replies = [tokenizer.decode(response[start:end], skip_special_tokens=True) for start, end in ranges]
        assert replies == ["5", "3", "2"][: len(ranges)]
        for turn, ((_, end), (start, _)) in enumerate(itertools.pairwise(ranges)):  # between actions: a hint
            feedback = tokenizer.decode(response[end:start])
            assert hint(target, replies[turn]) in feedback
            assert "<|im_start|>user" in feedback
            assert not any(mask[end:start])
        assert sum(mask) == sum(end - start for start, end in ranges)
        logs = record.extra["extra_logs"]
        assert logs == {"solved": record.reward, "guesses": float(len(ranges)), "finalized": 1.0}
    assert len(engine.histories) == 3 + 3 + 3 + 2


def test_the_executors_max_turns_and_a_stop_on_the_trace_end_a_scored_episode(tokenizer):
    records, _ = play(tokenizer, f"verifiers:{GUESS}?size=3&limit=3", ["5", "3", "2"], max_turns=2)
    assert [(r.reward, r.extra["turns"], r.finish_reason) for r in records] == [(0.0, 2, "stop")] * 3
    records, _ = play(tokenizer, f"verifiers:{GUESS}?size=1", ["I give up", "3"])
    [record] = records
    assert (record.reward, record.extra["turns"], record.extra["extra_logs"]["guesses"]) == (0.0, 1, 1.0)


def test_a_single_turn_taskset_plays_one_turn_scored_by_its_rubric(tokenizer):
    records, engine = play(tokenizer, f"verifiers:{SAY}?limit=2", ["0"])
    assert [record.reward for record in records] == [rubric("0", "0"), rubric("1", "0")] == [1.5, 0.5]
    assert [record.extra["turns"] for record in records] == [1, 1]
    system = "<|im_start|>system\nAnswer with the number only.<|im_end|>"
    assert tokenizer.decode(engine.histories[0]).startswith(system)
    assert records[0].extra["extra_logs"] == {"words": 1.0, "correct": 1.0, "brief": 1.0}


def test_an_env_that_raises_or_blocks_follows_the_executors_error_policy(tmp_path, tokenizer):
    broken = write_taskset(
        tmp_path,
        ECHO
        + """
class BrokenConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()

class BrokenEnv(vf.Env[BrokenConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if "block" in segment.last_reply:
                time.sleep(30)
            raise RuntimeError(f"the board broke after {segment.last_reply!r}")

__all__ = ["EchoTaskset", "BrokenEnv"]
""",
        name="broken_env",
    )
    source = f"verifiers:{broken}"
    with pytest.raises(EpisodeError, match=r"RuntimeError\(\"the board broke after 'ok'\"\)"):
        play(tokenizer, source, ["ok"])
    [record], _ = play(tokenizer, source, ["ok"], on_error="fallback", fallback=-1.0)
    assert (record.reward, record.finish_reason) == (-1.0, "abort")
    with pytest.raises(
        EpisodeError, match=r"timed out after 0.5 s; abandoned, the environment was at .*broken_env"
    ):
        play(tokenizer, source, ["block"], episode_timeout_s=0.5)
