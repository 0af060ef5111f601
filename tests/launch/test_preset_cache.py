"""`rl_launch.presets.cache.cached_build`: built once, complete or not at all, one builder at a time."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rl_launch.presets.cache import cached_build, recipe_hash


def _builder(calls: list[str], *, pause_s: float = 0.0, fail: bool = False):
    def build(staging):
        calls.append(staging.name)
        (staging / "weights.txt").write_text("w")
        time.sleep(pause_s)
        if fail:
            raise RuntimeError("the build failed")
        return {"built": len(calls)}

    return build


def test_built_once_then_read_from_its_marker(tmp_path):
    calls: list[str] = []
    folder = tmp_path / "task-abc"
    assert cached_build(folder, "done.json", _builder(calls)) == {"built": 1}
    assert cached_build(folder, "done.json", _builder(calls)) == {"built": 1}
    assert len(calls) == 1
    assert (folder / "weights.txt").read_text() == "w"
    assert json.loads((folder / "done.json").read_text()) == {"built": 1}
    assert sorted(path.name for path in tmp_path.iterdir()) == [".task-abc.lock", "task-abc"]


def test_a_failed_build_leaves_nothing_and_a_folder_without_its_marker_is_built_again(tmp_path):
    calls: list[str] = []
    folder = tmp_path / "task-abc"
    with pytest.raises(RuntimeError, match="the build failed"):
        cached_build(folder, "done.json", _builder(calls, fail=True))
    assert not folder.exists()
    assert not list(tmp_path.glob(".task-abc.tmp-*"))  # the staging folder went with the error
    folder.mkdir()  # an interrupted build: files but no marker
    (folder / "half.bin").write_text("x")
    assert cached_build(folder, "done.json", _builder(calls)) == {"built": 2}
    assert sorted(path.name for path in folder.iterdir()) == ["done.json", "weights.txt"]


def test_two_builders_at_once_build_once(tmp_path):
    calls: list[str] = []
    folder = tmp_path / "task-abc"
    results: list[dict] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(cached_build(folder, "done.json", _builder(calls, pause_s=0.3)))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [{"built": 1}, {"built": 1}]


def test_the_recipe_hash_ignores_key_order_and_sees_every_value():
    assert recipe_hash({"a": 1, "b": 2}) == recipe_hash({"b": 2, "a": 1})
    assert recipe_hash({"a": 1, "b": 2}) != recipe_hash({"a": 1, "b": 3})
    assert len(recipe_hash({})) == 16


def test_a_build_saves_its_model_without_a_progress_bar_and_gives_the_callers_bars_back(tmp_path, capfd):
    # transformers' "Writing model shards 0% ... 100%" bar was the first thing a new user saw of
    # `hatch run launch:ppo`.
    from transformers.utils import logging as transformers_logging

    from rl_data.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, intermediate_size=64)

    def build(staging):
        model.save_pretrained(staging / "model")
        return {}

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        cached_build(tmp_path / "model-abc", "done.json", build)
        assert (tmp_path / "model-abc" / "model" / "model.safetensors").is_file()
        assert "Writing model shards" not in capfd.readouterr().err
        assert transformers_logging.is_progress_bar_enabled()
    finally:
        (transformers_logging.enable_progress_bar if was_on else transformers_logging.disable_progress_bar)()
