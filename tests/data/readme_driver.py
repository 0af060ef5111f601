"""Runs the Python examples of packages/rl-data/README.md as written, in order, in one namespace,
with the inputs they name built in `folder` (a JSONL and a parquet file, tiny tokenizers).

Imported by tests/data/test_readme_examples.py (in the test process), and run as a script in a
process that sees only rl-data's declared dependencies: `python readme_driver.py README FOLDER`.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys


def python_blocks(readme: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.+?)```", readme.read_text(), re.S)


def run_examples(readme: pathlib.Path, folder: pathlib.Path) -> dict:
    """The namespace the README's examples leave, after checking what they should have made."""
    import datasets

    from rl_data.tiny import build_tiny_tokenizer

    math_file, chat_file = folder / "math.jsonl", folder / "chat.parquet"
    math_rows = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(12)]
    math_file.write_text("".join(json.dumps(row) + "\n" for row in math_rows))
    chat_rows = [{"question": f"Say hello {i} times.", "answer": "hello"} for i in range(4)]
    datasets.Dataset.from_list(chat_rows).to_parquet(str(chat_file))
    namespace = {
        "math_file": str(math_file),
        "chat_file": str(chat_file),
        "cache_dir": str(folder / "hf-cache"),
        "tmp_path": folder,
        "tokenizer": build_tiny_tokenizer(chat_template="chatml"),
        "think_tokenizer": build_tiny_tokenizer(chat_template="chatml-think"),
    }
    blocks = python_blocks(readme)
    assert len(blocks) >= 6, len(blocks)
    for block in blocks:
        exec(block, namespace)
    assert namespace["plan"].num_ranks == 2
    assert len(namespace["first"]) == 2
    assert namespace["state"].consumed_samples == 2
    assert (namespace["path"] / "config.json").is_file()
    return namespace


if __name__ == "__main__":
    run_examples(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
    print("ok")
