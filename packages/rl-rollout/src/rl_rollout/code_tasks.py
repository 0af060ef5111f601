"""Code tasks on the sandbox (`rl_rollout.sandbox`): a unit-test reward and a `python` tool.

`CodeReward` (`reward.function code` in rl-launch) scores a response by the tests of its label:

    reward = (tests that pass) / (tests)        0 when the response has no code or the run fails

The code is the response's last fenced block (```python ... ```, or any ``` block), else the
whole response. The label holds the tests: a list of test snippets (each a few lines of
`assert`s), a dict with "tests" (such a list), or a string: a JSON list of snippets, else one
snippet. The code and then each test run in one sandboxed program (`run_tests`), each test in a
copy of the code's globals; an infinite loop, a memory bomb or a crash ends at the sandbox's
limits, and the tests that passed before count. Responses of a batch run in parallel threads
(`max_workers`), each its own sandbox.

`python_tool()` is a `Tool` named "python" for tool-calling episodes (`ToolCallExecutor`,
`tools: file.py:NAME` with `NAME = python_tool()`): the model sends `{"code": ...}` and reads back
what the program printed, with a note when it failed, ran out of time or printed too much.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .rewards import BatchedReward, RewardOutput, response_text
from .sandbox import SandboxLimits, SandboxResult, run_python
from .tools import Tool

__all__ = ["CodeReward", "CodeTestReport", "extract_code", "label_tests", "python_tool", "run_tests"]

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)

# Runs solution.py, then each test of tests.json in a copy of its globals; one line per test in
# the results file, written as each test ends (a later test that hangs loses only itself).
_HARNESS = """
import json, traceback
namespace = {"__name__": "solution", "__builtins__": __builtins__}
try:
    with open("solution.py", encoding="utf-8") as source:
        exec(compile(source.read(), "solution.py", "exec"), namespace)
    loaded = True
except BaseException:
    traceback.print_exc()
    loaded = False
with open("tests.json", encoding="utf-8") as source:
    tests = json.load(source)
for index, test in enumerate(tests):
    passed = False
    if loaded:
        try:
            exec(compile(test, "test_%d" % index, "exec"), dict(namespace))
            passed = True
        except BaseException:
            traceback.print_exc()
    with open(RESULTS, "a") as results:
        results.write("%d %d\\n" % (index, passed))
"""


def extract_code(response: str) -> str:
    """The last fenced code block of `response` (a python / py one first), else the whole response."""
    blocks = _FENCE.findall(response)
    python = [body for language, body in blocks if language.lower() in ("python", "py", "python3")]
    if python or blocks:
        return (python or [body for _, body in blocks])[-1]
    return response


def label_tests(label: Any) -> list[str]:
    """The test snippets of a label (see the module docstring); ValueError naming what is wrong."""
    if isinstance(label, Mapping):
        if "tests" not in label:
            raise ValueError(
                f"label: a dict label needs 'tests' (a list of test snippets), got keys {sorted(label)}"
            )
        label = label["tests"]
    if isinstance(label, str):
        try:
            decoded = json.loads(label)
        except ValueError:
            decoded = None
        label = decoded if isinstance(decoded, list) else [label]
    if not isinstance(label, Sequence) or not label or not all(isinstance(t, str) for t in label):
        raise ValueError(f"label: expected a non-empty list of test snippets (strings), got {label!r:.200}")
    return list(label)


class CodeTestReport(msgspec.Struct, frozen=True, kw_only=True):
    """How a program did on its tests: passed of total, and the sandbox's run."""

    passed: int
    total: int
    run: SandboxResult

    @property
    def fraction(self) -> float:
        return self.passed / self.total


def run_tests(code: str, tests: Sequence[str], limits: SandboxLimits | None = None) -> CodeTestReport:
    """Run `code` then each of `tests` in one sandboxed program (`run_python`); the tests that
    passed before the program ended (its end, its deadline, a limit) count."""
    results = f".results-{secrets.token_hex(8)}"
    run = run_python(
        f"RESULTS = {results!r}\n" + _HARNESS,
        limits=limits,
        files={"solution.py": code, "tests.json": json.dumps(list(tests))},
        collect=[results],
    )
    lines = run.files.get(results, b"").decode("ascii", errors="replace").splitlines()
    passed = {
        int(index) for index, ok in (line.split() for line in lines if len(line.split()) == 2) if ok == "1"
    }
    return CodeTestReport(passed=len(passed & set(range(len(tests)))), total=len(tests), run=run)


class CodeReward:
    """The unit-test reward (see the module docstring) as a `RewardFunction`.

    Args:
      limits: the sandbox's limits for one response (default: 5 s, 512 MiB, network isolated).
      max_workers: responses run at once (default: min(8, CPUs)).
      on_error, fallback, timeout_s: as `BatchedReward` (a label without usable tests is an error).
    """

    name = "code"

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        max_workers: int | None = None,
        on_error: str = "raise",
        fallback: float = 0.0,
        timeout_s: float | None = None,
    ) -> None:
        self.limits = SandboxLimits(timeout_s=5.0) if limits is None else limits
        self.max_workers = max_workers or min(8, os.cpu_count() or 1)
        self._batched = BatchedReward(
            self._scores, name=self.name, on_error=on_error, fallback=fallback, timeout_s=timeout_s
        )

    def score(self, response: str, label: Any) -> float:
        """The pass fraction of one response."""
        return run_tests(extract_code(response), label_tests(label), self.limits).fraction

    def _scores(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> list[float]:
        responses = [response_text(query, prompt) for query, prompt in zip(queries, prompts, strict=True)]
        with concurrent.futures.ThreadPoolExecutor(
            self.max_workers, thread_name_prefix="rl-code-reward"
        ) as pool:
            return list(pool.map(self.score, responses, labels))

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        return self._batched(queries, prompts, labels)

    def metrics(self) -> dict[str, float]:
        return self._batched.metrics()


def _tool_text(result: SandboxResult, limits: SandboxLimits) -> str:
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    if result.timed_out:
        parts.append(f"[killed: the program ran past {limits.timeout_s:g} s]")
    elif result.exit_code:
        parts.append(f"[exit code {result.exit_code}]")
    if result.output_truncated:
        parts.append(f"[output cut at {limits.max_output_bytes} bytes]")
    return "\n".join(part for part in parts if part) or "[no output]"


def python_tool(limits: SandboxLimits | None = None, *, name: str = "python") -> Tool:
    """A `Tool` that runs the model's Python program in the sandbox and returns what it printed.

    Give the tool call a timeout above `limits.timeout_s` (the sandbox ends the program itself)."""
    limits = SandboxLimits(timeout_s=5.0) if limits is None else limits

    def run(code: str) -> str:
        return _tool_text(run_python(code, limits=limits), limits)

    return Tool(
        name=name,
        description="Run a Python program and return what it prints (stdout, then stderr).",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python program to run"}},
            "required": ["code"],
        },
        function=run,
    )
