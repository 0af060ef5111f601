"""The Python examples in packages/rl-data/README.md run as written, in order, in one namespace."""

from __future__ import annotations

import json
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-data" / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.+?)```", README.read_text(), re.S)


def test_readme_examples_run_in_order(tmp_path, make_tokenizer):
    math_file, chat_file = tmp_path / "math.jsonl", tmp_path / "chat.parquet"
    math_rows = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(12)]
    math_file.write_text("".join(json.dumps(row) + "\n" for row in math_rows))
    import datasets

    chat_rows = [{"question": f"Say hello {i} times.", "answer": "hello"} for i in range(4)]
    datasets.Dataset.from_list(chat_rows).to_parquet(str(chat_file))
    namespace = {
        "math_file": str(math_file),
        "chat_file": str(chat_file),
        "cache_dir": str(tmp_path / "hf-cache"),
        "tmp_path": tmp_path,
        "tokenizer": make_tokenizer("chatml"),
        "think_tokenizer": make_tokenizer("chatml-think"),
    }
    blocks = python_blocks()
    assert len(blocks) >= 6
    for block in blocks:
        exec(block, namespace)
    assert namespace["plan"].num_ranks == 2
    assert len(namespace["first"]) == 2
    assert namespace["state"].consumed_samples == 2
    assert (namespace["path"] / "config.json").is_file()
