"""The example of packages/rl-rollout/README.md's "Agents written against the OpenAI API" runs as
written: the agent file through `AgentServerExecutor` on a scripted engine, and the `rl-launch ppo`
command line that uses it, resolved and checked."""

from __future__ import annotations

import pathlib
import re
import shlex

from rl_data import PromptSample
from tests.rollout.test_agent_server import ScriptEngine

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-rollout" / "README.md"


def readme_example() -> tuple[str, str, str]:
    """(my_agent.py, the Python lines that run it, the rl-launch command) of the README's section."""
    text = README.read_text()
    start = text.index("## Agents written against the OpenAI API")
    section = text[start : text.index("\n## ", start + 1)]
    agent, usage = re.findall(r"```python\n(.+?)```", section, re.S)
    (command,) = re.findall(r"```bash\n(.+?)```", section, re.S)
    return agent, usage, command.replace("\\\n", " ").strip()


def test_the_readme_agent_runs_as_written(tokenizer, tmp_path, monkeypatch, in_process):
    agent, usage, command = readme_example()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_agent.py").write_text(agent)
    # the first answer misses the label "7", the second holds it: a retried episode, reward 0.5
    engine = ScriptEngine(tokenizer, [" no idea", " it is 7"])
    namespace = {
        "engine": engine,
        "tokenizer": tokenizer,
        "prompt_samples": [PromptSample(prompt_ids=[1, 2], prompt="What is 3 + 4?", label="7", index=0)],
    }
    exec(compile(usage, "README.md", "exec"), namespace)
    records = namespace["records"]
    assert len(records) == 4
    assert [r.extra["turns"] for r in records] == [2, 2, 2, 2]
    assert [r.reward for r in records] == [0.5] * 4
    assert records[0].extra["extra_logs"] == {"retried": 1.0}
    # the command line resolves with the agent file checked (model and data are placeholders)
    from rl_launch.cli import main

    args = shlex.split(command)
    assert args[:2] == ["rl-launch", "ppo"]
    assert main([*args[1:], "--print-config"]) == 0
