"""A stand-in for the `reasoning_gym` package (its `create_dataset`, `factory.DATASETS` and a
dataset's `score_answer`), so the adapter is tested without it installed: `install(monkeypatch)`."""

from __future__ import annotations

import importlib.machinery
import sys
import types


class AddDataset:
    """Item i: "What is a + b?" with a = seed + i, b = 2·i; metadata holds a tuple (which JSON would
    turn into a list) that `score_answer` needs, as real tasks' metadata does."""

    def __init__(self, size: int = 500, seed: int | None = None, offset: int = 0) -> None:
        self.size, self.seed, self.offset = size, seed or 0, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        a, b = self.seed + index, 2 * index + self.offset
        return {"question": f"What is {a} + {b}?", "answer": str(a + b), "metadata": {"pair": (a, b)}}

    def score_answer(self, answer: str | None, entry: dict) -> float:
        assert isinstance(entry["metadata"]["pair"], tuple)
        if answer is None:
            return 0.0
        return 1.0 if answer == str(sum(entry["metadata"]["pair"])) else 0.01


def install(monkeypatch) -> list:
    """Put the fake on sys.modules (and empty the adapter's dataset cache); returns the list of
    create_dataset calls (name, kwargs)."""
    from rl_rollout import reasoning_gym as adapter

    calls: list = []

    def create_dataset(name: str, **kwargs):
        calls.append((name, kwargs))
        if name != "add":
            raise ValueError(f"Dataset {name} not registered")
        return AddDataset(**kwargs)

    module = types.ModuleType("reasoning_gym")
    factory = types.ModuleType("reasoning_gym.factory")
    factory.DATASETS = {"add": AddDataset}
    module.__spec__ = importlib.machinery.ModuleSpec("reasoning_gym", None)  # find_spec sees it
    module.create_dataset, module.factory = create_dataset, factory
    monkeypatch.setitem(sys.modules, "reasoning_gym", module)
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", factory)
    monkeypatch.setattr(adapter, "_CACHE", {})
    return calls
