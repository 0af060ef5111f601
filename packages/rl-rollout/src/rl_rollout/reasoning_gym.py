"""reasoning-gym tasks as prompts and their verifiers as the reward (`pip install 'rl-rollout[reasoning-gym]'`).

reasoning-gym (PyPI `reasoning-gym`) generates verifiable tasks procedurally, offline: item i of
`create_dataset(task, size=n, seed=s, **config)` is the same on every machine, and the task's own
`score_answer(answer, entry)` scores an answer to it. A source names one task and its options,
URL-query style (no commas, so it fits a comma-separated list of datasets):

    reasoning_gym:basic_arithmetic                      500 items, seed 0
    reasoning_gym:leg_counting?size=64&seed=3           64 items, seed 3
    reasoning_gym:basic_arithmetic?size=8&max_terms=3   a task option, read as JSON when it parses

`reasoning_gym_rows(source)` gives one row per item: the item's question as the prompt and, as the
label, a short JSON text naming the task, its options and the item's index. `ReasoningGymReward`
rebuilds the item from that label (the metadata a verifier needs never travels through the data
pipeline, where tuples or sets would not survive) and scores the response with the task's
`score_answer`. The answer is the last `<answer>...</answer>` of the response (reasoning-gym's
own convention and system prompt, `REASONING_GYM_SYSTEM_PROMPT`), or the whole stripped response
when it has none.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from .rewards import RuleReward

__all__ = [
    "REASONING_GYM_INSTALL",
    "REASONING_GYM_PREFIX",
    "REASONING_GYM_SYSTEM_PROMPT",
    "ReasoningGymReward",
    "is_reasoning_gym_source",
    "parse_reasoning_gym_source",
    "reasoning_gym_label",
    "reasoning_gym_rows",
    "reasoning_gym_tasks",
]

REASONING_GYM_PREFIX = "reasoning_gym:"
"""A dataset source starting with this names a reasoning-gym task."""
REASONING_GYM_INSTALL = "pip install 'rl-rollout[reasoning-gym]'"
DEFAULT_SIZE, DEFAULT_SEED = 500, 0
REASONING_GYM_SYSTEM_PROMPT = (
    "Given a problem, your task is to answer the question by thinking step-by-step in a clear and "
    "specific manner.\nOnce you have thought about the reasoning process, provide the answer in the "
    "following format:\n<answer>answer here</answer>\nDo not explain your reasoning inside the answer "
    "tags, provide only the final answer."
)
"""reasoning-gym's default system prompt (its `SYSTEM_PROMPTS["default"]`, first sentences):
`--data.system_prompt` takes it."""


def is_reasoning_gym_source(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(REASONING_GYM_PREFIX)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_reasoning_gym_source(source: str) -> tuple[str, dict[str, Any]]:
    """(task, options) of `reasoning_gym:<task>?key=value&...`; options hold size and seed
    (defaults 500 and 0) and the task's own, each value read as JSON when it parses (3, 0.5,
    true), else kept as text. ValueError naming what is wrong; the task is not looked up here."""
    if not is_reasoning_gym_source(source):
        raise ValueError(f"{source!r} does not start with {REASONING_GYM_PREFIX!r}")
    task, _, query = source[len(REASONING_GYM_PREFIX) :].partition("?")
    if not task or not task.replace("_", "a").isalnum():
        raise ValueError(
            f"{source!r}: expected reasoning_gym:<task>[?size=N&seed=S&option=value...] with a task name "
            "of letters, digits and _ (e.g. reasoning_gym:basic_arithmetic?size=64)"
        )
    options: dict[str, Any] = {"size": DEFAULT_SIZE, "seed": DEFAULT_SEED}
    for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        options[key] = _value(text)
    for key in ("size", "seed"):
        value = options[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "size" else 0):
            raise ValueError(
                f"{source!r}: {key}={value!r}; expected an integer >= {1 if key == 'size' else 0}"
            )
    return task, options


def _import() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(f"the reasoning-gym package is not installed: {REASONING_GYM_INSTALL}") from None
    return reasoning_gym


def reasoning_gym_tasks() -> list[str]:
    """The task names of the installed reasoning-gym (ImportError with the pip line without it)."""
    return sorted(_import().factory.DATASETS)


_CACHE: dict[str, Any] = {}
_CACHE_LOCK = threading.Lock()


def _dataset(task: str, options: Mapping[str, Any]) -> Any:
    """reasoning-gym's dataset of (task, options), built once per process (items are generated lazily)."""
    key = json.dumps([task, dict(options)], sort_keys=True)
    with _CACHE_LOCK:
        if key not in _CACHE:
            reasoning_gym = _import()
            try:
                _CACHE[key] = reasoning_gym.create_dataset(task, **options)
            except (AssertionError, KeyError, TypeError, ValueError) as error:
                names = sorted(reasoning_gym.factory.DATASETS)
                known = "" if task in names else f" (not a task; tasks: {', '.join(names)})"
                raise ValueError(
                    f"reasoning_gym:{task} with {dict(options)}: {type(error).__name__}: {error}{known}"
                ) from None
        return _CACHE[key]


def reasoning_gym_label(task: str, options: Mapping[str, Any], index: int) -> str:
    """The label of item `index`: what `ReasoningGymReward` rebuilds it from."""
    return json.dumps({"reasoning_gym": task, "options": dict(options), "index": index}, sort_keys=True)


def reasoning_gym_rows(
    source: str, *, input_key: str = "prompt", label_key: str = "label"
) -> list[dict[str, str]]:
    """One row per item of the source's task: {input_key: question, label_key: label}."""
    task, options = parse_reasoning_gym_source(source)
    dataset = _dataset(task, options)
    return [
        {input_key: dataset[index]["question"], label_key: reasoning_gym_label(task, options, index)}
        for index in range(len(dataset))
    ]


def _answer(response: str, tag: str) -> str:
    start, end = f"<{tag}>", f"</{tag}>"
    last = response.rfind(start)
    if last == -1 or (close := response.find(end, last)) == -1:
        return response.strip()
    return response[last + len(start) : close].strip()


class ReasoningGymReward(RuleReward):
    """The task's own `score_answer` on the response's answer, for labels of `reasoning_gym_rows`.

    Args:
      answer_tag: the answer is inside the last `<answer_tag>...</answer_tag>`; a response without
        one is scored whole (stripped).
      on_error, fallback, timeout_s: as `RuleReward` (a label that is not a reasoning-gym label is
        an error).
    """

    name = "reasoning_gym"

    def __init__(self, *, answer_tag: str = "answer", **kwargs: Any) -> None:
        self.answer_tag = answer_tag
        super().__init__(**kwargs)

    def score(self, response: str, label: Any) -> float:
        try:
            parsed = json.loads(label) if isinstance(label, str) else label
            task, options, index = parsed["reasoning_gym"], parsed["options"], parsed["index"]
        except (TypeError, ValueError, KeyError):
            raise ValueError(
                f"label {label!r} is not a reasoning-gym label (data.prompt_data reasoning_gym:<task> makes them)"
            ) from None
        dataset = _dataset(task, options)
        entry = dataset[index]
        return float(dataset.score_answer(_answer(response, self.answer_tag), entry) or 0.0)
