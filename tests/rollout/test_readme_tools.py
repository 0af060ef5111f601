"""The tool-calling example of packages/rl-rollout/README.md runs as written (with its checkpoint
folder moved into the test's temporary folder)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-rollout" / "README.md"


def test_the_tool_calling_example_runs(tmp_path, capsys):
    text = README.read_text()
    start = text.index("## Tool calling")
    section = text[start : text.index("\n## ", start + 1)]
    (code,) = re.findall(r"```python\n(.+?)```", section, re.S)
    assert '"/tmp/tiny-tools"' in code
    namespace: dict = {}
    exec(
        compile(code.replace('"/tmp/tiny-tools"', repr(str(tmp_path / "tiny-tools"))), "README", "exec"),
        namespace,
    )
    records = namespace["records"]
    assert len(records) == 4
    for record in records:
        assert set(record.extra["tools"]) >= {"calls", "malformed", "timeout"}
        prompt_text = namespace["tokenizer"].decode(record.prompt_ids.tolist())
        assert prompt_text.startswith("<|im_start|>system\nTools: add(a, b)<|im_end|>\n")
    assert "rollout/tools/call_rate" in namespace["executor"].last_metrics
    assert capsys.readouterr().out.strip()
