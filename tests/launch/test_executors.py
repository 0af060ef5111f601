"""The rollout executor as a component of `rl-launch ppo` (no Ray): `rollout.executor` picks it by
name, `rollout.executor_options` reach it verbatim, `rollout.agent_func_path` (an OpenRLHF agent
file) implies multi_turn (agent_server takes a `run_agent` file instead), and every wrong name,
option, value or file fails before anything starts, naming the dotted option. The rollout actor's
own code then runs the agent on a real engine."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from rl_data import PromptSample, Trajectory, decode, encode
from rl_launch.cli import main
from rl_launch.components import EXECUTORS, executor_name, executor_options
from rl_launch.config import ConfigError
from rl_launch.rollouts import rollout_metrics
from rl_rollout import SamplingParams
from tests.launch.agent_files import FEEDBACK, RUN_AGENT, TWO_TURN_AGENT
from tests.launch.configs import ppo_config

BASE = {
    "model.pretrain": "/models/never-loaded",
    "data.prompt_data": "/data/never-read.jsonl",
    "algo.advantage.estimator": "grpo",
    "rollout.rollout_batch_size": "4",
    "rollout.n_samples_per_prompt": "2",
}


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "two_turns.py"
    path.write_text(TWO_TURN_AGENT)
    return path


def config(**overrides: str):
    return ppo_config(BASE, **overrides)


def refused(pattern: str, **overrides: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        config(**overrides)


# ---------------------------------------------------------------------------------- choosing


def test_single_turn_is_the_default_and_an_agent_file_alone_means_multi_turn(agent_file):
    assert executor_name(config()) == "single_turn"
    cfg = config(rollout__agent_func_path=str(agent_file))
    assert cfg.rollout.executor is None
    assert executor_name(cfg) == "multi_turn"
    assert executor_name(
        config(rollout__executor="multi_turn", rollout__agent_func_path=str(agent_file))
    ) == ("multi_turn")


def test_the_executor_options_are_the_executor_classes_own():
    from rl_rollout import MultiTurnExecutor

    options = executor_options("multi_turn")
    assert (options["max_turns"], options["feedback"], options["on_error"]) == (8, "text", "raise")
    assert not {"env", "first_group_id", "engine", "sampling"} & set(options)
    assert set(options) < set(MultiTurnExecutor.__init__.__code__.co_varnames)
    assert executor_options("single_turn") == {"skip_special_tokens": False}


def test_the_options_and_the_agent_file_reach_the_executor_verbatim(agent_file):
    cfg = config(
        rollout__agent_func_path=str(agent_file),
        rollout__executor_options__max_turns="3",
        rollout__executor_options__on_error="fallback",
        rollout__executor_options__fallback="-1",
        rollout__executor_options__feedback="chat",
    )
    assert cfg.rollout.executor_options == {
        "max_turns": 3,
        "on_error": "fallback",
        "fallback": -1,
        "feedback": "chat",
    }
    from rl_launch.components import validation_engine

    executor = EXECUTORS["multi_turn"].build(
        engine=validation_engine(64),
        reward_fn=None,
        tokenizer=None,
        sampling=SamplingParams(n=2),
        first_group_id=5,
        agent_func_path=str(agent_file),
        **cfg.rollout.executor_options,
    )
    assert (executor.max_turns, executor.on_error, executor.fallback, executor.feedback) == (
        3,
        "fallback",
        -1.0,
        "chat",
    )
    assert executor.env_factory.__name__ == "AgentInstance"
    assert executor._groups.next == 5


# --------------------------------------------------------------------------------- refusals


def test_an_unknown_executor_is_refused_with_the_registered_names():
    refused(
        r"^rollout\.executor: 'multi_turns' is not one of agent_server, gym_text, multi_turn, single_turn",
        rollout__executor="multi_turns",
    )


def test_an_agent_file_with_the_single_turn_executor_is_refused(agent_file):
    refused(
        r"^rollout\.agent_func_path: .* rollout\.executor is single_turn",
        rollout__executor="single_turn",
        rollout__agent_func_path=str(agent_file),
    )


def test_multi_turn_without_an_agent_file_is_refused():
    refused(
        r"^rollout\.executor: 'multi_turn' runs the episodes of an agent file", rollout__executor="multi_turn"
    )


def test_a_missing_or_broken_agent_file_is_refused_naming_the_option(tmp_path):
    refused(
        r"^rollout\.agent_func_path: agent file '.*missing\.py' does not exist",
        rollout__agent_func_path=str(tmp_path / "missing.py"),
    )
    (tmp_path / "no_agent.py").write_text("class Something:\n    pass\n")
    refused(
        r"^rollout\.agent_func_path: agent file .*no_agent\.py' defines neither an AgentInstance",
        rollout__agent_func_path=str(tmp_path / "no_agent.py"),
    )
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    refused(
        r"^rollout\.agent_func_path: agent file .*broken\.py' failed to import",
        rollout__agent_func_path=str(tmp_path / "broken.py"),
    )
    (tmp_path / "agent.txt").write_text(TWO_TURN_AGENT)
    refused(
        r"^rollout\.agent_func_path: .* not a Python file",
        rollout__agent_func_path=str(tmp_path / "agent.txt"),
    )


def test_an_option_the_executor_does_not_take_is_refused_with_the_close_one(agent_file):
    refused(
        r"^rollout\.executor_options\.max_turnz: not an option of rollout executor 'multi_turn'; it takes "
        r".*max_turns.* \(did you mean max_turns\?\)",
        rollout__agent_func_path=str(agent_file),
        rollout__executor_options__max_turnz="2",
    )
    refused(
        r"^rollout\.executor_options\.max_turns: not an option of rollout executor 'single_turn'; it takes "
        r"skip_special_tokens",
        rollout__executor_options__max_turns="2",
    )


@pytest.mark.parametrize(
    ("option", "value", "pattern"),
    [
        ("feedback", "xml", r"feedback: 'xml' is not allowed"),
        ("max_turns", "0", r"max_turns"),
        ("on_error", "ignore", r"on_error: 'ignore' is not allowed"),
        ("episode_timeout_s", "0", r"episode_timeout_s: 0 is not allowed"),
    ],
)
def test_a_bad_option_value_fails_with_the_executors_own_message(agent_file, option, value, pattern):
    refused(
        rf"^rollout\.executor_options: rollout executor 'multi_turn' refused its options: .*{pattern}",
        rollout__agent_func_path=str(agent_file),
        **{f"rollout__executor_options__{option}": value},
    )


def test_a_reward_source_that_multi_turn_would_never_call_is_refused(agent_file):
    refused(
        r"^reward\.function: with rollout\.executor multi_turn the agent's own rewards are the reward",
        rollout__agent_func_path=str(agent_file),
        reward__function="numeric",
    )


def test_the_cli_refuses_a_bad_executor_option_with_exit_code_2(agent_file, capsys):
    code = main(
        [
            "ppo",
            *("--model.pretrain", "/models/x", "--data.prompt_data", "/data/x.jsonl"),
            *("--train.agent_func_path", str(agent_file)),  # OpenRLHF's flag
            *("--rollout.executor_options.max_turnz", "2", "--print-config"),
        ]
    )
    assert code == 2
    assert "rollout.executor_options.max_turnz: not an option of rollout executor 'multi_turn'" in (
        capsys.readouterr().err
    )


def test_rl_launch_components_lists_the_executors_with_their_options(capsys):
    assert main(["components"]) == 0
    out = capsys.readouterr().out
    assert "rollout executors  (rollout.executor, options: rollout.executor_options" in out
    assert "single_turn(skip_special_tokens=False)" in out
    assert "multi_turn(max_turns=8, max_length=None, feedback='text'" in out
    assert "agent_server(max_length=None, episode_timeout_s=600.0" in out


def test_agent_server_takes_a_run_agent_file_and_refuses_an_agent_class_file(tmp_path, agent_file):
    run_agent = tmp_path / "run_agent.py"
    run_agent.write_text(RUN_AGENT)
    cfg = config(rollout__executor="agent_server", rollout__agent_func_path=str(run_agent))
    assert executor_name(cfg) == "agent_server"
    refused(
        r"^rollout\.agent_func_path: agent file .*two_turns\.py' defines no run_agent.*"
        r"OpenRLHF agent file: rollout\.executor multi_turn runs those",
        rollout__executor="agent_server",
        rollout__agent_func_path=str(agent_file),
    )
    refused(
        r"^rollout\.executor: 'agent_server' runs the episodes of an agent file; set rollout\.agent_func_path "
        r"to a \.py file defining `async def run_agent",
        rollout__executor="agent_server",
    )
    refused(
        r"^rollout\.executor_options: rollout executor 'agent_server' refused its options: tool_parser: 'xml'",
        rollout__executor="agent_server",
        rollout__agent_func_path=str(run_agent),
        rollout__executor_options__tool_parser="xml",
    )
    # rewritten histories (thinking templates) as segments: an option of the executor, verbatim
    config(
        rollout__executor="agent_server",
        rollout__agent_func_path=str(run_agent),
        rollout__executor_options__history="segments",
    )
    refused(
        r"^rollout\.executor_options: rollout executor 'agent_server' refused its options: history: 'rewrite' "
        r"is not allowed; expected one of \('append', 'segments'\)",
        rollout__executor="agent_server",
        rollout__agent_func_path=str(run_agent),
        rollout__executor_options__history="rewrite",
    )


def test_the_agent_servers_key_and_queue_bound_reach_it_verbatim(tmp_path, monkeypatch):
    from rl_launch.components import validation_engine

    run_agent = tmp_path / "run_agent.py"
    run_agent.write_text(RUN_AGENT)
    monkeypatch.setenv("RL_AGENT_KEY", "k-1")
    options = {
        "rollout__executor_options__api_key_env": "RL_AGENT_KEY",
        "rollout__executor_options__max_queue": "8",
    }
    cfg = config(rollout__executor="agent_server", rollout__agent_func_path=str(run_agent), **options)
    assert cfg.rollout.executor_options == {"api_key_env": "RL_AGENT_KEY", "max_queue": 8}
    executor = EXECUTORS["agent_server"].build(
        engine=validation_engine(64), reward_fn=None, tokenizer=None, sampling=SamplingParams(),
        first_group_id=0, agent_func_path=str(run_agent), **cfg.rollout.executor_options,
    )  # fmt: skip
    assert (executor.server.api_key, executor.server.max_queue) == ("k-1", 8)
    monkeypatch.delenv("RL_AGENT_KEY")
    refused(
        r"^rollout\.executor_options: rollout executor 'agent_server' refused its options: api_key_env: "
        r"the environment variable RL_AGENT_KEY is not set or empty",
        rollout__executor="agent_server",
        rollout__agent_func_path=str(run_agent),
        **options,
    )
    refused(
        r"^rollout\.executor_options\.max_queu: not an option of rollout executor 'agent_server'; it takes .*max_queue",
        rollout__executor="agent_server",
        rollout__agent_func_path=str(run_agent),
        rollout__executor_options__max_queu="8",
    )


# ---------------------------------------------------------------- the rollout actor's own code


def _worker_episodes(
    tiny_checkpoint, executor: str, options: dict, agent, *, greedy_baseline: bool
) -> tuple[Any, list[Trajectory]]:
    """(tokenizer, records) of `RolloutWorker.generate` (no Ray: the class itself) on the hf engine
    with `executor` running `agent`: two prompts, n = 2, group ids from 10."""
    from transformers import AutoTokenizer

    from rl_launch.actors import EngineSpec, RolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    spec = EngineSpec(
        kind="hf",
        model_path=str(tiny_checkpoint),
        dtype="fp32",
        max_model_len=128,
        seed=0,
        executor=executor,
        executor_options=options,
        agent_func_path=None if agent is None else str(agent),
    )
    worker = RolloutWorker(spec)
    try:
        prompts = [
            PromptSample(prompt_ids=tokenizer(text)["input_ids"], prompt=text, label="1", index=i)
            for i, text in enumerate(["What is 1 + 0?", "Name a number."])
        ]
        sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
        generated = worker.generate(encode(prompts), sampling, 10, greedy_baseline)
        return tokenizer, decode(generated, list[Trajectory])
    finally:
        worker.close()


def test_the_rollout_worker_runs_the_agent_masks_feedback_and_takes_a_greedy_baseline(
    tiny_checkpoint, agent_file
):
    """`RolloutWorker.generate` (no Ray: the class itself) on the hf engine: two turns per episode,
    the feedback tokens in the response with action mask 0 and log-prob 0, the agent's reward, and
    ReMax's greedy baseline from one greedy episode per prompt."""
    tokenizer, records = _worker_episodes(
        tiny_checkpoint, "multi_turn", {"max_turns": 3}, agent_file, greedy_baseline=True
    )
    feedback = tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    assert [r.group_id for r in records] == [10, 10, 11, 11]
    for record in records:
        assert record.extra["turns"] == 2  # the agent says done after its second step
        (start, first_end), (second_start, end) = record.extra["action_ranges"]
        mask, response = record.action_mask.tolist(), record.response_ids.tolist()
        assert (start, end) == (0, len(response))
        assert response[first_end:second_start] == feedback
        assert mask == [True] * first_end + [False] * len(feedback) + [True] * (end - second_start)
        assert record.rollout_logprobs[first_end:second_start].eq(0).all()
        second = tokenizer.decode(response[second_start:end], skip_special_tokens=True)
        assert record.reward == float(any(c.isdigit() for c in second))
        assert record.extra["extra_logs"] == {"second_turn": 1.0}
        assert record.extra["baseline_reward"] in (0.0, 1.0)
    metrics = rollout_metrics(records)
    assert metrics["rollout/turns_mean"] == 2.0
    assert metrics["rollout/episode_failures"] == 0.0
    assert metrics["rollout/env_tokens_mean"] == len(feedback)
    assert metrics["rollout/agent/second_turn"] == 1.0
    lengths = torch.tensor([r.response_ids.numel() for r in records], dtype=torch.float)
    assert metrics["rollout/action_tokens_mean"] == pytest.approx(float(lengths.mean()) - len(feedback))


def test_the_rollout_worker_runs_an_openai_api_agent_through_the_agent_server(tiny_checkpoint, tmp_path):
    """The same agent as above written with the `openai` client (`rollout.executor agent_server`):
    the feedback message is a delta of the chat template with action mask 0, the reward is
    run_agent's, and the step's server is gone afterwards."""
    import threading

    agent = tmp_path / "run_agent.py"
    agent.write_text(RUN_AGENT)
    tokenizer, records = _worker_episodes(
        tiny_checkpoint, "agent_server", {"episode_timeout_s": 120}, agent, greedy_baseline=False
    )
    assert [r.group_id for r in records] == [10, 10, 11, 11]
    for record in records:
        (start, first_end), (second_start, end) = record.extra["action_ranges"]
        mask, response = record.action_mask.tolist(), record.response_ids.tolist()
        assert (start, end) == (0, len(response))
        delta = tokenizer.decode(response[first_end:second_start])
        assert delta.endswith(f"<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n")
        assert mask == [True] * first_end + [False] * (second_start - first_end) + [True] * (
            end - second_start
        )
        assert record.rollout_logprobs[first_end:second_start].eq(0).all()
        second = tokenizer.decode(response[second_start:end], skip_special_tokens=True)
        assert record.reward == float(any(c.isdigit() for c in second))
        assert record.extra["extra_logs"] == {"second_turn": 1.0}
    metrics = rollout_metrics(records)
    assert metrics["rollout/turns_mean"] == 2.0
    # the server's refusals reach the step's metrics (none here), carried by the call's first record
    assert records[0].extra["call_counters"]["rollout/server_busy"] == 0.0
    assert (metrics["rollout/server_busy"], metrics["rollout/server_unauthorized"]) == (0.0, 0.0)
    assert not any(t.name.startswith("rl-agent-server") for t in threading.enumerate())


def test_the_executors_call_counters_are_summed_over_a_steps_calls():
    first, second, third = (
        Trajectory(prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2])) for _ in range(3)
    )
    first.extra["call_counters"] = {"rollout/server_busy": 2.0, "rollout/server_unauthorized": 1.0}
    third.extra["call_counters"] = {"rollout/server_busy": 3.0, "rollout/loop_blocked": 1.0, "other": 9.0}
    metrics = rollout_metrics([first, second, third])
    assert metrics["rollout/server_busy"] == 5.0
    assert metrics["rollout/server_unauthorized"] == 1.0
    assert metrics["rollout/loop_blocked"] == 1.0
    assert "other" not in metrics


def test_rollout_metrics_count_failed_and_cut_episodes_and_single_turn_records():
    def record(mask, finish="stop", **extra):
        return Trajectory(
            prompt_ids=[1, 2],
            response_ids=list(range(3, 3 + len(mask))),
            action_mask=mask,
            reward=0.0,
            group_id=0,
            finish_reason=finish,
            extra=extra,
        )

    episodes = [
        record([1, 1, 0, 0, 1], turns=2, extra_logs={"hits": 1, "note": "text"}),
        record([1, 0, 0], finish="length", turns=3, extra_logs={"hits": 0}),
        record([1], finish="abort", turns=1, episode_error="timed out"),
    ]
    assert rollout_metrics(episodes) == {
        "rollout/action_tokens_mean": 5 / 3,
        "rollout/env_tokens_mean": 4 / 3,
        "rollout/truncated": 1.0,
        "rollout/turns_mean": 2.0,
        "rollout/episode_failures": 1.0,
        "rollout/agent/hits": 0.5,
        "reward/fallbacks": 1.0,  # the failed episode trains on the fallback reward
        "reward/fallback_fraction": 1 / 3,
        "reward/timeouts": 0.0,
        "reward/fallbacks/episode": 1.0,
    }
    single = [record([1, 1, 1], reward_fallback=True), record([1, 1], finish="length", reward_fallback=False)]
    assert rollout_metrics(single) == {
        "rollout/action_tokens_mean": 2.5,
        "rollout/env_tokens_mean": 0.0,
        "rollout/truncated": 1.0,
        "rollout/reward_fallbacks": 1.0,
        "reward/fallbacks": 1.0,
        "reward/fallback_fraction": 0.5,
        "reward/timeouts": 0.0,
        "reward/fallbacks/reward": 1.0,
    }
    sources = [
        record([1], reward_fallback_sources=["remote_0"], reward_timeout_sources=["remote_0"]),
        record([1]),
    ]
    assert rollout_metrics(sources)["reward/fallbacks/remote_0"] == 1.0
    assert rollout_metrics(sources)["reward/timeouts"] == 1.0


# ------------------------------------------------------------------------- the README example


def _readme_example() -> tuple[str, list[str]]:
    """(the agent file, the command's arguments) of README's "### Multi-turn agents"."""
    import re
    import shlex

    from tests.launch.test_readme_examples import section

    text = section("### Multi-turn agents")
    text = text[: text.index("\n### ")] if "\n### " in text else text
    (code,) = re.findall(r"```python\n(.+?)```", text, re.S)
    (shell,) = re.findall(r"```bash\n(.+?)```", text, re.S)
    return code, shlex.split(shell.replace("\\\n", " "))


def test_the_readme_agent_file_and_command_work(tmp_path, monkeypatch, capsys):
    import asyncio

    from rl_rollout import load_agent_class

    code, command = _readme_example()
    (tmp_path / "agent.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    agent = load_agent_class("agent.py")()
    first = asyncio.run(agent.step({"action_text": "hmm", "label": None}))
    second = asyncio.run(agent.step({"action_text": "it is 42", "label": None}))
    assert (first["done"], float(first["rewards"]), first["environment_feedback"] != "") == (False, 0.0, True)
    assert (second["done"], float(second["rewards"]), second["extra_logs"]) == (True, 1.0, {"digit": 1.0})
    assert command[:2] == ["rl-launch", "ppo"]
    assert main([*command[1:], "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "agent_func_path: agent.py" in out
    assert "max_turns: 2" in out


# --------------------------------------------------------------------------------- tool_call

TOOLS_FILE = "def add(a: int, b: int) -> int:\n    '''Add.'''\n    return a + b\n\nTOOLS = [add]\n"


def test_tool_call_options_reach_the_executor_verbatim(tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS_FILE)
    cfg = config(
        rollout__executor="tool_call",
        rollout__executor_options__tools=str(tools),
        rollout__executor_options__parser="hermes",
        rollout__executor_options__max_tool_calls="2",
        rollout__executor_options__tool_timeout_s="0.5",
    )
    assert cfg.rollout.executor_options == {
        "tools": str(tools),
        "parser": "hermes",
        "max_tool_calls": 2,
        "tool_timeout_s": 0.5,
    }
    from rl_launch.components import validation_engine

    executor = EXECUTORS["tool_call"].build(
        engine=validation_engine(64),
        reward_fn=lambda queries, prompts, labels: [0.0] * len(queries),
        tokenizer=None,
        sampling=SamplingParams(n=2),
        first_group_id=3,
        agent_func_path=None,
        **cfg.rollout.executor_options,
    )
    assert [tool.name for tool in executor.tools] == ["add"]
    assert (executor.max_tool_calls, executor.tool_timeout_s, executor.parser.name) == (2, 0.5, "hermes")
    assert executor.episodes._groups.next == 3
    assert {"tools", "parser", "tools_in_prompt", "tool_timeout_s", "max_tool_calls", "max_turns"} <= set(
        executor_options("tool_call")
    )


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({}, r"tools: none given"),
        ({"tools": "/nowhere/tools.py"}, r"tools: tools file '/nowhere/tools.py' does not exist"),
        (
            {"parser": "pythonic"},
            r"parser: 'pythonic' is not a registered tool parser; expected one of \['hermes'",
        ),
        ({"tools_in_prompt": "system"}, r"tools_in_prompt: 'system' is not allowed; expected one of"),
        ({"max_tool_calls": "0"}, r"max_tool_calls"),
    ],
)
def test_tool_call_refuses_a_bad_option_naming_it(tmp_path, options, pattern):
    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS_FILE)
    given = {"tools": str(tools), **options} if options else {}
    refused(
        rf"^rollout\.executor_options: rollout executor 'tool_call' refused its options: {pattern}",
        rollout__executor="tool_call",
        **{f"rollout__executor_options__{key}": value for key, value in given.items()},
    )


def test_rollout_metrics_carry_the_tool_counts():
    def record(calls, timeout):
        return Trajectory(
            prompt_ids=[1, 2],
            response_ids=[3, 4, 5],
            action_mask=[True, False, True],
            reward=0.0,
            extra={
                "turns": 2,
                "tools": {"calls": calls, "timeout": timeout, "malformed": 0, "limit_reached": 0},
            },
        )

    metrics = rollout_metrics([record(2, 1), record(0, 0)])
    assert metrics["rollout/tools/calls_mean"] == 1.0
    assert metrics["rollout/tools/call_rate"] == 0.5
    assert metrics["rollout/tools/errors/timeout"] == 1.0
    assert metrics["rollout/tools/errors/malformed"] == 0.0
    assert metrics["rollout/env_tokens_mean"] == 1.0


def test_the_readme_tool_calling_command_resolves(capsys):
    """README's "### Tool calling" command (run from the repository root) passes every check."""
    import pathlib
    import re
    import shlex

    from tests.launch.test_readme_examples import section

    (shell,) = re.findall(r"```bash\n(.+?)```", section("### Tool calling"), re.S)
    command = shlex.split(shell.replace("\\\n", " ").replace("<calculator>", "/models/calculator"))
    assert command[:2] == ["rl-launch", "ppo"]
    root = pathlib.Path(__file__).resolve().parents[2]
    tools = command[command.index("--rollout.executor_options.tools") + 1]
    assert (root / tools).is_file()
    command[command.index(tools)] = str(root / tools)
    assert main([*command[1:], "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "executor: tool_call" in out
    assert "parser: hermes" in out


# ------------------------------------------------------------- gym_text: Gymnasium-style envs

GUESS_NUMBER = (
    str(pathlib.Path(__file__).parents[1] / "rollout" / "fixtures" / "guess_number.py") + ":GuessNumber"
)


def test_gym_text_takes_an_env_spec_its_kwargs_and_multi_turns_options_and_refuses_bad_ones():
    resolved = config(
        rollout__executor="gym_text",
        rollout__executor_options__env=GUESS_NUMBER,
        rollout__executor_options__env_kwargs__max_guesses="2",
        rollout__executor_options__max_turns="2",
    )
    assert resolved.rollout.executor_options == {
        "env": GUESS_NUMBER,
        "env_kwargs": {"max_guesses": 2},
        "max_turns": 2,
    }
    assert set(executor_options("multi_turn")) < set(executor_options("gym_text"))
    prefix = r"^rollout\.executor_options: rollout executor 'gym_text' refused its options: "
    refused(prefix + "env is required", rollout__executor="gym_text")
    refused(
        prefix + r"env: 'no_such_pkg_q:Env': cannot import module",
        rollout__executor="gym_text",
        rollout__executor_options__env="no_such_pkg_q:Env",
    )
    refused(
        prefix + r"render: 'html' is not allowed",
        rollout__executor="gym_text",
        rollout__executor_options__env=GUESS_NUMBER,
        rollout__executor_options__render="html",
    )
    refused(
        r"^reward\.function: with rollout\.executor gym_text the environment's own rewards are the reward",
        rollout__executor="gym_text",
        rollout__executor_options__env=GUESS_NUMBER,
        reward__function="numeric",
    )


def test_the_rollout_worker_runs_a_gym_text_env_from_its_spec(tiny_checkpoint):
    """The actor's own code builds gym_text from the options as given: the environment's first
    observation is each record's prompt, its hints are feedback (mask 0), its rewards the reward."""
    options = {"env": GUESS_NUMBER, "env_kwargs": {"max_guesses": 2}, "render": "text"}
    tokenizer, records = _worker_episodes(tiny_checkpoint, "gym_text", options, None, greedy_baseline=False)
    first = tokenizer("Guess my number between 0 and 100.", add_special_tokens=False)["input_ids"]
    assert [r.group_id for r in records] == [10, 10, 11, 11]
    for record in records:
        assert record.prompt_ids.tolist() == first
        assert 1 <= record.extra["turns"] <= 2
        assert record.reward in (0.0, 1.0)
        text = tokenizer.decode(record.response_ids.tolist())
        if record.reward == 0.0:  # never right: both guesses answered with a hint, the last one ends it
            assert record.extra["turns"] == 2
            hints = [h for h in ("Higher.", "Lower.", "No number.") if h in text]
            assert hints
        assert not all(record.action_mask.tolist()) or record.extra["turns"] == 1
