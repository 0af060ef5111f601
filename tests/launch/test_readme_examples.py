"""The worked example of packages/rl-launch/README.md runs as written: the plugin file, the
`rl-launch components` listing it, and the command line that uses it."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-launch" / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(title)
    return text[start : text.index("\n## ", start + 1)]


def example() -> tuple[str, list[str]]:
    """(the plugin file's code, the shell lines of the example)."""
    text = section("### Adding one: a plugin")
    (code,) = re.findall(r"```python\n(.+?)```", text, re.S)
    (shell,) = re.findall(r"```bash\n(.+?)```", text, re.S)
    lines = shell.replace("\\\n", " ").strip().splitlines()
    return code, [line.split("#")[0].strip() for line in lines]


def run_cli(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl_launch.cli", *args], cwd=cwd, capture_output=True, text=True, check=False
    )


def test_the_plugin_example_registers_a_working_estimator(tmp_path):
    code, _ = example()
    namespace: dict = {}
    exec(
        compile(
            code.replace('register("group_median")', 'register("group_median_readme")'), "readme", "exec"
        ),
        namespace,
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    advantages, returns = namespace["group_median"](
        rewards=torch.tensor([1.0, 0.0, 3.0, 2.0, 0.5]),
        group_ids=torch.tensor([0, 0, 0, 1, 1]),
        action_mask=mask,
        scale=2.0,
    )
    # group 0: median 1 -> 2 x [0, -1, 2]; group 1: median of [2, 0.5] is 0.5 (the lower) -> 2 x [1.5, 0]
    assert advantages[:, 0].tolist() == [0.0, -2.0, 4.0, 3.0, 0.0]
    assert torch.equal(advantages * (1 - mask), torch.zeros(5, 3))
    assert torch.equal(advantages, returns)


def test_the_readme_command_lines_run(tmp_path):
    code, lines = example()
    (tmp_path / "group_median.py").write_text(code)
    listing, ppo = (shlex.split(line) for line in lines)
    assert listing[:2] == ["rl-launch", "components"]
    result = run_cli(listing[1:], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "group_median(scale=1.0)" in result.stdout
    # The training command, checked and resolved (the model and data paths are placeholders).
    result = run_cli([*ppo[1:], "--print-config"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "estimator: group_median" in result.stdout
    assert "scale: 2" in result.stdout
    result = run_cli([*ppo[1:], "--algo.advantage.options.scael", "2", "--print-config"], tmp_path)
    assert result.returncode == 2
    assert (
        "algo.advantage.options.scael: not an option of advantage estimator 'group_median'; it takes scale"
        in result.stderr
    )


def test_the_readme_async_command_line_resolves_to_the_depth_and_bound_it_shows(tmp_path):
    text = README.read_text()
    start = text.index("- `--rollout.async_train`")
    (shell,) = re.findall(r"```bash\n(.+?)```", text[start : text.index("### Rewards", start)], re.S)
    command = shlex.split(shell.replace("\\\n", " "))
    assert command[:2] == ["rl-launch", "ppo"]
    result = run_cli([*command[1:], "--print-config"], tmp_path)
    assert result.returncode == 0, result.stderr
    for line in ("async_train: true", "async_depth: 2", "max_staleness: 2"):
        assert line in result.stdout


def test_the_supervised_commands_readme_lines_resolve(capsys):
    """Every `rl-launch sft|rm|dpo|kto` line of the README's supervised section is a valid command
    line (resolved with --print-config: the models it names are not on this machine)."""
    from rl_launch.cli import main

    (shell,) = re.findall(r"```bash\n(.+?)```", section("## SFT, reward model, DPO and KTO"), re.S)
    lines = [line.split("#")[0].strip() for line in shell.replace("\\\n", " ").strip().splitlines()]
    commands = [shlex.split(line)[1:] for line in lines if line.startswith("rl-launch ")]
    assert {args[0] for args in commands} == {"sft", "rm", "dpo", "kto"}
    for args in commands:
        assert main([*args, "--print-config"]) == 0, (args, capsys.readouterr().err)
        out = capsys.readouterr().out
        pairs = zip(args[1::2], args[2::2], strict=False)
        for option, value in pairs:  # each given name-like value is where its option says
            if option.startswith("--") and value.isidentifier():
                assert f"{option.rsplit('.', 1)[-1]}: {value}" in out, (option, value)


def test_the_readme_distillation_command_line_resolves_to_a_teacher_run(tmp_path):
    (shell,) = re.findall(r"```bash\n(.+?)```", section("## On-policy distillation"), re.S)
    build, command = shell.replace("\\\n", " ").strip().splitlines()
    # the first line builds the preset's teacher with the function it names
    (code,) = re.findall(r'python -c "(.+?)"\)', build)
    assert code.startswith("from rl_launch.presets.arithmetic import build_teacher;")
    command = shlex.split(command.replace('"$TEACHER"', "/models/teacher"))
    assert command[:2] == ["rl-launch", "ppo"]
    result = run_cli([*command[1:], "--print-config"], tmp_path)
    assert result.returncode == 0, result.stderr
    for line in ("teacher_pretrain: /models/teacher", "outcome: false", "estimator: reinforce"):
        assert line in result.stdout
