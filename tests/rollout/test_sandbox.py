"""The sandbox for model-written code (`rl_rollout.sandbox`), the unit-test reward and the
`python` tool on it (`rl_rollout.code_tasks`). Real subprocesses, limits kept small."""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import time

import pytest

from rl_rollout import CodeReward, SandboxError, SandboxLimits, python_tool, run_python
from rl_rollout.code_tasks import extract_code, label_tests, run_tests
from rl_rollout.tools import call_tool


@pytest.fixture(scope="module")
def isolated():
    """Whether this machine makes the sandbox's namespaces (network='isolated')."""
    try:
        run_python("pass", limits=SandboxLimits(timeout_s=30))
    except SandboxError:
        return False
    return True


def test_a_program_runs_in_a_throwaway_folder_without_the_callers_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RL_TEST_SECRET_TOKEN", "s3cret")
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.environ))\nopen('out.txt', 'w').write('hi')\n"
    result = run_python(code, limits=SandboxLimits(network="allow"), collect=["out.txt", "../x"])
    assert result.ok, result.stderr
    folder, names = result.stdout.splitlines()
    assert folder != str(tmp_path)
    assert os.path.basename(folder).startswith("rl-sandbox-")
    assert not os.path.exists(folder)  # deleted with what the program wrote there
    assert not (tmp_path / "out.txt").exists()
    assert result.files == {"out.txt": b"hi"}  # read back by name; never a path out of the folder
    assert "RL_TEST_SECRET_TOKEN" not in names
    assert "s3cret" not in result.stdout
    assert ast.literal_eval(names) == [
        "HOME",
        "LANG",
        "PATH",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONIOENCODING",
        "TMPDIR",
    ]


def test_an_endless_loop_is_killed_at_the_deadline_with_what_it_started(tmp_path, isolated):
    mark = tmp_path / "late"
    late = f"import time; time.sleep(0.6); open({str(mark)!r}, 'w')"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {late!r}], start_new_session=True)\n"
        "print('looping', flush=True)\n"
        "while True:\n    pass\n"
    )
    network = "isolated" if isolated else "allow"
    result = run_python(code, limits=SandboxLimits(timeout_s=0.4, network=network))
    assert (result.timed_out, result.exit_code, result.ok) == (True, None, False)
    assert result.stdout == "looping\n"  # what it printed before the deadline is kept
    if isolated:  # its PID namespace died with it: the detached child never wrote
        time.sleep(1.0)
        assert not mark.exists()


def test_a_memory_bomb_fails_within_its_memory_limit():
    result = run_python(
        "x = bytearray(1 << 30)\nprint('allocated')", limits=SandboxLimits(memory_mb=128, network="allow")
    )
    assert (result.exit_code, result.timed_out) == (1, False)
    assert "MemoryError" in result.stderr
    assert "allocated" not in result.stdout


def test_output_is_capped_and_the_rest_dropped():
    result = run_python(
        "import sys\nprint('a' * 100_000)\nsys.stderr.write('b' * 10)",
        limits=SandboxLimits(max_output_bytes=1000, network="allow"),
    )
    assert (result.ok, result.output_truncated) == (True, True)
    assert (result.stdout, result.stderr) == ("a" * 1000, "b" * 10)


def test_no_connection_leaves_an_isolated_sandbox(isolated):
    if not isolated:
        pytest.skip("this machine refuses unprivileged user namespaces")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=5)\nprint('connected')"
        assert "Network is unreachable" in run_python(code).stderr
        assert run_python(code, limits=SandboxLimits(network="allow")).stdout == "connected\n"


@pytest.mark.parametrize(
    ("field", "value"), [("timeout_s", 0), ("memory_mb", 0), ("max_output_bytes", True), ("network", "none")]
)
def test_limits_name_the_field_at_fault(field, value):
    with pytest.raises(ValueError, match=f"{field}: {value!r} is not allowed"):
        SandboxLimits(**{field: value})


def test_code_and_tests_come_from_the_response_and_the_label():
    assert extract_code("so:\n```python\nx = 1\n```\nand ```\ny = 2\n```") == "x = 1\n"
    assert extract_code("```\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert label_tests({"tests": ["assert f()"]}) == label_tests('["assert f()"]') == ["assert f()"]
    assert label_tests("assert f() == 1") == ["assert f() == 1"]
    with pytest.raises(ValueError, match="label: expected a non-empty list of test snippets"):
        label_tests([])


def test_the_code_reward_is_the_pass_fraction_and_zero_past_a_limit():
    reward = CodeReward(limits=SandboxLimits(timeout_s=0.5, memory_mb=256, network="allow"))
    tests = ["assert f(1) == 2", "assert f(2) == 3", "assert f(-1) == 0"]
    responses = [
        "```python\ndef f(x):\n    return x + 1\n```",
        "```python\ndef f(x):\n    return x + 1 if x > 0 else 5\n```",
        "```python\ndef f(x):\n    while True:\n        pass\n```",
        "```python\nblob = bytearray(1 << 30)\ndef f(x):\n    return x + 1\n```",
        "I do not know.",
    ]
    output = reward(["Q: " + r for r in responses], ["Q: "] * 5, [tests] * 5)
    assert output.rewards == pytest.approx([1.0, 2 / 3, 0.0, 0.0, 0.0])
    report = run_tests(
        "def f(x):\n    return x + 1\n", ["assert f(1) == 2", "while True: pass"], reward.limits
    )
    assert (report.passed, report.total, report.run.timed_out) == (1, 2, True)  # passed before the hang


def test_the_python_tool_returns_what_the_program_printed():
    tool = python_tool(SandboxLimits(timeout_s=0.5, network="allow"))
    result = asyncio.run(call_tool(tool, {"code": "print(6 * 7)"}, timeout_s=30))
    assert (result.content, result.error) == ("42\n", None)
    result = asyncio.run(call_tool(tool, {"code": "while True: pass"}, timeout_s=30))
    assert result.content == "[killed: the program ran past 0.5 s]"
    result = asyncio.run(call_tool(tool, {"code": "raise SystemExit(3)"}, timeout_s=30))
    assert result.content == "[exit code 3]"


def test_the_readme_sandbox_example_runs_as_written(isolated):
    import pathlib
    import re

    if not isolated:
        pytest.skip("this machine refuses unprivileged user namespaces (the example isolates the network)")
    readme = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-rollout" / "README.md"
    text = readme.read_text()
    start = text.index("## Code in a sandbox")
    (example,) = re.findall(r"```python\n(.+?)```", text[start : text.index("\n## ", start + 1)], re.S)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["tool"].name == "python"
