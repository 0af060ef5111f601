"""Reward functions: the batched interface, OpenRLHF-style function files, rule rewards.

Every reward source (a Python function file, a remote reward server, a rule) is a
`RewardFunction`: a batched call on text

    reward_fn(queries, prompts, labels) -> RewardOutput(rewards [B], scores [B], extra_logs)

where `queries[i]` is the prompt text followed by the decoded response, `prompts[i]` the prompt
text and `labels[i]` the dataset label. `rewards` train the policy (after shaping); `scores` are
the task scores used for logging and dynamic filtering (they default to the rewards).

OpenRLHF reward files work unchanged: `load_reward_function("reward.py")` imports the file and
wraps its `reward_func(queries, prompts, labels)`, which may return a dict with "rewards"
(required), "scores" and "extra_logs", or (older files) a bare tensor / list of rewards. A file
that imports a module this environment lacks (OpenRLHF's math example imports `openrlhf.utils`'s
grader) fails with an ImportError naming the module and what to install.

Outputs are checked: a wrong number of values, a non-numeric value, NaN or ±inf raises
`RewardError` naming the function (or file) and the sample index; with `on_error="fallback"`
the offending samples (or the whole batch, when the function raises or returns the wrong
number of values) get `fallback` instead. Fallbacks are logged with the `logging` module,
counted in `RewardOutput.num_fallbacks` / `fallback_indices` and in the function's running
`metrics()`.

Rule rewards for verifiable tasks compare the response (query minus prompt) with the label:
`ExactMatchReward`, `NumericAnswerReward` (`\\boxed{}`, GSM8K `#### 42`, or the last number),
`FormatReward` (a regex) and `WeightedSumReward` (Σ w_k r_k over named components).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import numbers
import re
import string
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch

__all__ = [
    "ON_ERROR",
    "BatchedReward",
    "ExactMatchReward",
    "FormatReward",
    "NumericAnswerReward",
    "PerSampleReward",
    "RewardError",
    "RewardFunction",
    "RewardOutput",
    "RewardTimeout",
    "RuleReward",
    "WeightedSumReward",
    "check_reward_inputs",
    "extract_numeric_answer",
    "load_python_file",
    "load_reward_function",
    "normalize_answer",
    "response_text",
]

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "fallback")


class RewardError(ValueError):
    """A reward function failed or returned something unusable; the message says which and where."""


class RewardTimeout(RewardError):
    """A reward function ran past its deadline (`timeout_s`); its thread was abandoned."""


def _check_timeout(timeout_s: float | None) -> float | None:
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s: {timeout_s!r} is not allowed; expected a number > 0 or None")
    return float(timeout_s)


def _call(
    function: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any], timeout_s: float | None
) -> Any:
    """`function(*args, **kwargs)`, inline without a deadline, else on an abandoned-at-the-deadline
    thread (`rl_rollout.bounded.call_with_deadline`): `CallTimeout` when it runs past it."""
    if timeout_s is None:
        return function(*args, **kwargs)
    from .bounded import call_with_deadline

    return call_with_deadline(function, *args, timeout_s=timeout_s, **kwargs)


class RewardOutput(msgspec.Struct, kw_only=True):
    """Rewards for one batch of B samples.

    rewards: [B] floats used for training. scores: [B] task scores (logging, dynamic filtering).
    extra_logs: name -> value or [B] values, for the metrics logger. fallback_indices: samples
    whose reward is the configured fallback because the function failed on them;
    timeout_indices: those of them whose function ran past its deadline.
    """

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, Any] = msgspec.field(default_factory=dict)
    fallback_indices: list[int] = msgspec.field(default_factory=list)
    timeout_indices: list[int] = msgspec.field(default_factory=list)
    """The fallbacks whose reason was a timeout (a subset of `fallback_indices`)."""

    @property
    def num_fallbacks(self) -> int:
        return len(self.fallback_indices)


@runtime_checkable
class RewardFunction(Protocol):
    """Batched reward: `(queries [B], prompts [B], labels [B]) -> RewardOutput`."""

    def __call__(
        self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]
    ) -> RewardOutput: ...


def check_reward_inputs(
    queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any], name: str
) -> int:
    """The batch size B, after checking that the three inputs are sequences of the same length."""
    lengths = {}
    for argument, value in (("queries", queries), ("prompts", prompts), ("labels", labels)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"{name}: {argument} must be a list, got {type(value).__name__}")
        lengths[argument] = len(value)
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{name}: queries, prompts and labels differ in length: {lengths}")
    return lengths["queries"]


def _check_on_error(on_error: str, fallback: float) -> float:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error: {on_error!r} is not allowed; expected one of {ON_ERROR}")
    if isinstance(fallback, bool) or not isinstance(fallback, numbers.Real) or not math.isfinite(fallback):
        raise ValueError(f"fallback: {fallback!r} is not allowed; expected a finite number")
    return float(fallback)


def _as_values(value: Any, field: str, where: str) -> list[Any]:
    """A tensor / array / list / tuple as a flat Python list (elements not yet checked)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().reshape(-1).tolist()
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # numpy arrays
        return list(value.reshape(-1).tolist())
    if isinstance(value, (list, tuple)):
        return list(value)
    raise RewardError(f"{where}: {field!r} must be a list or a tensor, got {type(value).__name__}")


def _as_float(value: Any) -> float | None:
    """`value` as a finite float, or None when it is not a finite real number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class _ErrorPolicy:
    """Shared bookkeeping for `on_error`: raise, or substitute `fallback` and count it."""

    def __init__(self, name: str, on_error: str, fallback: float) -> None:
        self.name = name
        self.on_error = on_error
        self.fallback = _check_on_error(on_error, fallback)
        self.num_calls = 0
        self.num_samples = 0
        self.num_fallbacks = 0
        self.num_timeouts = 0

    def fail(self, message: str) -> None:
        """Raise (on_error="raise") or log the problem (on_error="fallback")."""
        if self.on_error == "raise":
            raise RewardError(message)
        logger.warning("%s; using fallback reward %s", message, self.fallback)

    def metrics(self) -> dict[str, float]:
        """Running counts since construction: calls, samples, fallbacks, timeouts and the fallback rate."""
        rate = self.num_fallbacks / self.num_samples if self.num_samples else 0.0
        return {
            "reward/calls": float(self.num_calls),
            "reward/samples": float(self.num_samples),
            "reward/fallbacks": float(self.num_fallbacks),
            "reward/timeouts": float(self.num_timeouts),
            "reward/fallback_rate": rate,
        }


def _check_values(
    raw: list[Any], batch_size: int, field: str, where: str, policy: _ErrorPolicy, bad: set[int]
) -> list[float]:
    """Floats from `raw`; a non-numeric or non-finite value is an error or joins `bad`."""
    if len(raw) != batch_size:
        raise RewardError(f"{where}: {field!r} has {len(raw)} values for a batch of {batch_size} samples")
    values = []
    for index, item in enumerate(raw):
        value = _as_float(item)
        if value is None:
            policy.fail(f"{where}: {field}[{index}] (sample {index}) is {item!r}, expected a finite number")
            bad.add(index)
            value = policy.fallback
        values.append(value)
    return values


def _finish(
    raw: Any, batch_size: int, where: str, policy: _ErrorPolicy, bad: set[int] | None = None
) -> RewardOutput:
    """Validate a raw OpenRLHF-style result (dict or bare rewards) into a RewardOutput; a
    `RewardOutput` (a wrapped `RewardFunction`'s) is checked already and kept."""
    if isinstance(raw, RewardOutput):
        if len(raw.rewards) != batch_size or len(raw.scores) != batch_size:
            raise RewardError(
                f"{where}: returned {len(raw.rewards)} rewards for a batch of {batch_size} samples"
            )
        return raw
    bad = set() if bad is None else bad
    if isinstance(raw, Mapping):
        if "rewards" not in raw:
            raise RewardError(f"{where}: the result has no 'rewards' key (keys: {sorted(map(str, raw))})")
        raw_rewards = raw["rewards"]
        raw_scores = raw.get("scores")
        extra_logs = raw.get("extra_logs") or {}
        if not isinstance(extra_logs, Mapping):
            raise RewardError(f"{where}: 'extra_logs' must be a dict, got {type(extra_logs).__name__}")
    else:
        raw_rewards, raw_scores, extra_logs = raw, None, {}
    rewards = _check_values(
        _as_values(raw_rewards, "rewards", where), batch_size, "rewards", where, policy, bad
    )
    if raw_scores is None:
        scores = list(rewards)
    else:
        scores = _check_values(
            _as_values(raw_scores, "scores", where), batch_size, "scores", where, policy, bad
        )
    for index in bad:
        rewards[index] = scores[index] = policy.fallback
    return RewardOutput(
        rewards=rewards, scores=scores, extra_logs=_loggable(extra_logs), fallback_indices=sorted(bad)
    )


def _loggable(extra_logs: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors in `extra_logs` as floats or lists of floats (JSON-like, for the metrics logger)."""
    out: dict[str, Any] = {}
    for key, value in extra_logs.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = value.item() if value.numel() == 1 else value.reshape(-1).tolist()
        out[str(key)] = value
    return out


class BatchedReward:
    """A checked `RewardFunction` around a raw batched callable (an OpenRLHF `reward_func`).

    `fn(queries, prompts, labels, **kwargs)` may return {"rewards", "scores", "extra_logs"},
    bare rewards (tensor or list), or a `RewardOutput` (any `RewardFunction` wrapped for its
    deadline and error policy). `name` appears in every error ("reward.py:reward_func").
    With on_error="fallback", an exception or a wrong-length result gives the whole batch the
    fallback; a bad single value gives that sample the fallback. With `timeout_s`, a call that
    runs past it on a batch is abandoned (`RewardTimeout`, or the batch's fallback, counted in
    `timeout_indices` and `metrics()["reward/timeouts"]`); None: no deadline, run inline.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        on_error: str = "raise",
        fallback: float = 0.0,
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.kwargs = dict(kwargs or {})
        self.policy = _ErrorPolicy(self.name, on_error, fallback)
        self.timeout_s = _check_timeout(timeout_s)

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        from .bounded import CallTimeout

        batch_size = check_reward_inputs(queries, prompts, labels, self.name)
        self.policy.num_calls += 1
        self.policy.num_samples += batch_size
        timed_out = False
        try:
            try:
                raw = _call(
                    self.fn, (list(queries), list(prompts), list(labels)), self.kwargs, self.timeout_s
                )
            except CallTimeout as error:
                timed_out = True
                raise RewardTimeout(f"{self.name}: {error}") from None
            output = _finish(raw, batch_size, self.name, self.policy)
        except Exception as error:
            message = error.args[0] if isinstance(error, RewardError) else f"{self.name}: raised {error!r}"
            if self.policy.on_error == "raise":
                if isinstance(error, RewardError):
                    raise
                raise RewardError(f"{message} on a batch of {batch_size} samples") from error
            logger.warning(
                "%s; the whole batch of %d gets reward %s", message, batch_size, self.policy.fallback
            )
            output = RewardOutput(
                rewards=[self.policy.fallback] * batch_size,
                scores=[self.policy.fallback] * batch_size,
                fallback_indices=list(range(batch_size)),
                timeout_indices=list(range(batch_size)) if timed_out else [],
            )
        self.policy.num_fallbacks += output.num_fallbacks
        self.policy.num_timeouts += len(output.timeout_indices)
        return output

    def metrics(self) -> dict[str, float]:
        return self.policy.metrics()


class PerSampleReward:
    """A per-sample function `fn(query, prompt, label) -> float` made into a `RewardFunction`.

    `fn` may also return a `(reward, score)` pair. A failure (exception, non-finite or
    non-numeric value) concerns only its sample: an error naming the sample index, or the
    fallback for that sample alone. With `timeout_s` each sample's call has that deadline: past
    it the sample is abandoned (`RewardTimeout`, or its fallback, counted in `timeout_indices`).
    """

    def __init__(
        self,
        fn: Callable[[str, str, Any], Any],
        *,
        name: str | None = None,
        on_error: str = "raise",
        fallback: float = 0.0,
        timeout_s: float | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.policy = _ErrorPolicy(self.name, on_error, fallback)
        self.timeout_s = _check_timeout(timeout_s)

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        from .bounded import CallTimeout

        batch_size = check_reward_inputs(queries, prompts, labels, self.name)
        self.policy.num_calls += 1
        self.policy.num_samples += batch_size
        rewards, scores, bad, timeouts = [], [], [], []
        for index, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
            try:
                value = _call(self.fn, (query, prompt, label), {}, self.timeout_s)
            except CallTimeout as error:
                message = f"{self.name}: sample {index}: {error}"
                if self.policy.on_error == "raise":
                    raise RewardTimeout(message) from None
                self.policy.fail(message)
                timeouts.append(index)
                value = None
            except Exception as error:
                if self.policy.on_error == "raise":
                    raise RewardError(f"{self.name}: raised {error!r} on sample {index}") from error
                self.policy.fail(f"{self.name}: raised {error!r} on sample {index}")
                value = None
            pair = value if isinstance(value, tuple) and len(value) == 2 else (value, value)
            reward, score = _as_float(pair[0]), _as_float(pair[1])
            if reward is None or score is None:
                if value is not None:
                    self.policy.fail(f"{self.name}: sample {index} got {value!r}, expected a finite number")
                bad.append(index)
                reward = score = self.policy.fallback
            rewards.append(reward)
            scores.append(score)
        self.policy.num_fallbacks += len(bad)
        self.policy.num_timeouts += len(timeouts)
        return RewardOutput(rewards=rewards, scores=scores, fallback_indices=bad, timeout_indices=timeouts)

    def metrics(self) -> dict[str, float]:
        return self.policy.metrics()


def load_python_file(path: str | Path, kind: str) -> Any:
    """Import the Python file at `path` as a fresh module; errors name the file and `kind`.

    The module is registered in `sys.modules` under a name derived from the path (dataclasses
    and pickling inside the file need that), so loading the same file twice gives one module name.
    """
    file = Path(path)
    if file.suffix != ".py":
        raise ValueError(f"{kind} file {str(file)!r}: expected a Python file ending in .py")
    if not file.is_file():
        raise FileNotFoundError(f"{kind} file {str(file)!r} does not exist")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module_name = f"rl_rollout_user_{file.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{kind} file {str(file)!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(module_name, None)
        missing = _missing_import(error)
        if missing is not None:
            raise ImportError(f"{kind} file {str(file)!r} failed to import: it {missing}") from error
        raise ImportError(f"{kind} file {str(file)!r} failed to import: {error!r}") from error
    return module


_MISSING_IMPORT_HINTS: dict[str, str] = {
    "openrlhf": (
        "OpenRLHF's own helpers: rl_rollout stands in only for openrlhf.utils.agent (the base classes "
        "of agent files). Install OpenRLHF where the rollout runs (pip install openrlhf), or score "
        "with a built-in reward (rl-launch --reward.function numeric: the \\boxed{} / #### / last number "
        "of the response against the label)"
    ),
    "gem": "GEM, the agent environment library: pip install gem-llm (its import name is gem)",
}
"""Top-level module -> what it is and how to get it, for the files OpenRLHF's examples import
from; `load_python_file` names it when a user file's import of it fails."""


def _missing_import(error: BaseException) -> str | None:
    """For a failed import of a module the environment lacks (or a name the openrlhf stand-in
    lacks): what the file imports, what is missing and what to install; else None."""
    if not isinstance(error, ImportError) or not error.name:
        return None
    top = error.name.partition(".")[0]
    hint = _MISSING_IMPORT_HINTS.get(top)
    if isinstance(error, ModuleNotFoundError):
        what = f"imports {error.name!r}, which is not installed"
    elif top == "openrlhf":  # `from openrlhf.utils import x` where only the stand-in is there
        what = f"imports from {error.name!r} what its stand-in lacks ({error})"
    else:
        return None
    return f"{what}: {hint}" if hint else f"{what}: install the package that provides {top!r}"


def load_reward_function(
    path: str | Path,
    *,
    function_name: str = "reward_func",
    on_error: str = "raise",
    fallback: float = 0.0,
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float | None = None,
) -> BatchedReward:
    """The `reward_func(queries, prompts, labels)` of an OpenRLHF-style Python file, checked.

    Raises FileNotFoundError / ImportError / AttributeError / TypeError naming the file when it
    is missing, fails to import, lacks `function_name` or defines it as something not callable.
    `timeout_s` bounds one call on a batch (`BatchedReward`).
    """
    module = load_python_file(path, "reward function")
    fn = getattr(module, function_name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AttributeError(
            f"reward function file {str(path)!r} defines no {function_name!r} (callables defined: {defined})"
        )
    if not callable(fn):
        raise TypeError(
            f"reward function file {str(path)!r}: {function_name!r} is a {type(fn).__name__}, not a function"
        )
    return BatchedReward(
        fn,
        name=f"{path}:{function_name}",
        on_error=on_error,
        fallback=fallback,
        kwargs=kwargs,
        timeout_s=timeout_s,
    )


# ----------------------------------------------------------------------------------------------
# Rule rewards for verifiable tasks.


def response_text(query: str, prompt: str) -> str:
    """The response part of `query`: the text after `prompt` when the query starts with it."""
    return query[len(prompt) :] if prompt and query.startswith(prompt) else query


_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, articles (a, an, the) dropped, whitespace collapsed (SQuAD)."""
    text = str(text).lower().translate(_PUNCTUATION)
    return " ".join(word for word in text.split() if word not in ("a", "an", "the"))


_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_SEARCH = re.compile(
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+"
)


def _last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}`, braces balanced; None when absent or unclosed."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start:position]
    return None


def _parse_number(text: str) -> float | None:
    """A number written as `1,234.5`, `-3`, `1e3`, `3/4` or `\\frac{3}{4}` (with optional $ and %)."""
    text = text.strip().strip("$").rstrip("%").rstrip(".").replace("\\!", "").replace(" ", "")
    text = text.removeprefix("\\$").removesuffix("\\%")
    fraction = re.fullmatch(
        r"(?:\\d?frac\{([-+]?[\d.]+)\}\{([-+]?[\d.]+)\}|([-+]?[\d.]+)/([-+]?[\d.]+))", text
    )
    if fraction:
        numerator, denominator = (g for g in fraction.groups() if g is not None)
        try:
            return float(numerator) / float(denominator)
        except (ValueError, ZeroDivisionError):
            return None
    if text and _NUMBER.fullmatch(text):
        try:
            return float(text.replace(",", ""))
        except ValueError:
            return None
    return None


def extract_numeric_answer(text: str, order: Sequence[str] = ("boxed", "hashes", "last")) -> float | None:
    """The final numeric answer in `text`, or None.

    Tried in `order`, the first method that finds a candidate decides: "boxed" the last
    `\\boxed{...}` (None when its content is not a number, e.g. `\\boxed{x+1}`); "hashes" the
    first number after the last GSM8K-style `####`; "last" the last number anywhere in the text. Commas in thousands are
    removed; fractions `a/b` and `\\frac{a}{b}` are evaluated.
    """
    for method in order:
        if method == "boxed":
            candidate = _last_boxed(text)
        elif method == "hashes":
            matches = _HASHES.findall(text)
            candidate = matches[-1] if matches else None
        elif method == "last":
            numbers_found = _NUMBER_SEARCH.findall(text)
            candidate = numbers_found[-1] if numbers_found else None
        else:
            raise ValueError(f"order: unknown method {method!r}; expected 'boxed', 'hashes' or 'last'")
        if candidate is None:
            continue
        # A boxed answer that is not a number is the model's (non-numeric) answer: no fallback
        # to numbers elsewhere. After "####" the first number counts ("#### 72 clips").
        if method == "hashes":
            found = _NUMBER_SEARCH.findall(candidate)
            return _parse_number(found[0]) if found else None
        return _parse_number(candidate)
    return None


class RuleReward:
    """Base of the rule rewards: a batched `RewardFunction` over `score(response, label) -> float`.

    The response is `response_text(query, prompt)`. Errors (a label that cannot be read) follow
    `on_error` like `PerSampleReward`.
    """

    name = "rule"

    def __init__(
        self, *, on_error: str = "raise", fallback: float = 0.0, timeout_s: float | None = None
    ) -> None:
        self._per_sample = PerSampleReward(
            lambda query, prompt, label: self.score(response_text(query, prompt), label),
            name=self.name,
            on_error=on_error,
            fallback=fallback,
            timeout_s=timeout_s,
        )

    def score(self, response: str, label: Any) -> float:
        raise NotImplementedError

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        return self._per_sample(queries, prompts, labels)

    def metrics(self) -> dict[str, float]:
        return self._per_sample.metrics()


class ExactMatchReward(RuleReward):
    """1.0 when the answer equals the label after `normalize_answer`, else 0.0.

    The answer is the whole response, or group 1 (else the whole match) of the last match of
    `pattern` when given (e.g. r"The answer is (.+)"). `normalize=False` compares stripped text.
    A list label matches when any of its items does.
    """

    name = "exact_match"

    def __init__(self, *, pattern: str | None = None, normalize: bool = True, **kwargs: Any) -> None:
        self.pattern = re.compile(pattern) if pattern is not None else None
        self.normalize = normalize
        super().__init__(**kwargs)

    def _norm(self, text: str) -> str:
        return normalize_answer(text) if self.normalize else str(text).strip()

    def score(self, response: str, label: Any) -> float:
        if label is None:
            raise ValueError("label is None; exact match needs a reference answer")
        answer = response
        if self.pattern is not None:
            matches = list(self.pattern.finditer(response))
            if not matches:
                return 0.0
            last = matches[-1]
            answer = last.group(1) if last.groups() else last.group(0)
        references = label if isinstance(label, (list, tuple)) else [label]
        return float(any(self._norm(answer) == self._norm(str(reference)) for reference in references))


class NumericAnswerReward(RuleReward):
    """1.0 when the response's final number is within tolerance of the label's, else 0.0.

    |answer − label| ≤ abs_tol + rel_tol·|label|. The response's answer comes from
    `extract_numeric_answer(response, order)`; the label may be a number or text (a GSM8K
    solution ending in `#### 42`, a `\\boxed{}` or a plain number). No number in the response
    gives 0.0; a label without a number is an error (or the fallback).
    """

    name = "numeric_answer"

    def __init__(
        self,
        *,
        abs_tol: float = 1e-6,
        rel_tol: float = 0.0,
        order: Sequence[str] = ("boxed", "hashes", "last"),
        **kwargs: Any,
    ) -> None:
        for argument, value in (("abs_tol", abs_tol), ("rel_tol", rel_tol)):
            if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{argument}: {value!r} is not allowed; expected a finite number >= 0")
        self.abs_tol, self.rel_tol, self.order = float(abs_tol), float(rel_tol), tuple(order)
        super().__init__(**kwargs)

    def score(self, response: str, label: Any) -> float:
        if isinstance(label, numbers.Real) and not isinstance(label, bool):
            reference = float(label)
        else:
            reference = extract_numeric_answer(str(label)) if label is not None else None
            if reference is None:
                raise ValueError(f"label {label!r} holds no number")
        answer = extract_numeric_answer(response, self.order)
        if answer is None:
            return 0.0
        return float(abs(answer - reference) <= self.abs_tol + self.rel_tol * abs(reference))


class FormatReward(RuleReward):
    """`reward` (default 1.0) when the response matches the regex `pattern`, else 0.0.

    `fullmatch=True` requires the whole stripped response to match; otherwise `re.search`.
    Default flags: re.DOTALL, so `.` spans lines (e.g. r"<think>.*</think>.*\\\\boxed\\{.+\\}").
    """

    name = "format"

    def __init__(
        self,
        pattern: str,
        *,
        fullmatch: bool = False,
        flags: int = re.DOTALL,
        reward: float = 1.0,
        **kwargs: Any,
    ) -> None:
        self.pattern = re.compile(pattern, flags)
        self.fullmatch, self.reward = fullmatch, float(reward)
        super().__init__(**kwargs)

    def score(self, response: str, label: Any) -> float:
        text = response.strip() if self.fullmatch else response
        match = self.pattern.fullmatch(text) if self.fullmatch else self.pattern.search(text)
        return self.reward if match else 0.0


class WeightedSumReward:
    """Σ_k w_k · r_k over named reward components (e.g. accuracy + 0.1 · format).

    rewards = Σ_k w_k·rewards_k; scores = the scores of the component named `score_from`
    (e.g. the accuracy, so that dynamic filtering looks at correctness only), or Σ_k w_k·scores_k
    when None. extra_logs gets each component's rewards under "<name>" and its fallbacks.
    """

    def __init__(
        self, components: Mapping[str, tuple[RewardFunction, float]], *, score_from: str | None = None
    ) -> None:
        if not components:
            raise ValueError("components: expected at least one (reward_function, weight) entry")
        for key, entry in components.items():
            if not (isinstance(entry, tuple) and len(entry) == 2 and callable(entry[0])):
                raise TypeError(
                    f"components[{key!r}]: expected a (reward_function, weight) pair, got {entry!r}"
                )
            if not (isinstance(entry[1], numbers.Real) and math.isfinite(entry[1])):
                raise ValueError(f"components[{key!r}]: weight {entry[1]!r} is not a finite number")
        if score_from is not None and score_from not in components:
            raise ValueError(f"score_from: {score_from!r} is not one of the components {sorted(components)}")
        self.components = dict(components)
        self.score_from = score_from
        self.name = "weighted_sum(" + ", ".join(self.components) + ")"

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        batch_size = check_reward_inputs(queries, prompts, labels, self.name)
        rewards, scores = [0.0] * batch_size, [0.0] * batch_size
        extra_logs: dict[str, Any] = {}
        fallbacks: set[int] = set()
        timeouts: set[int] = set()
        for key, (function, weight) in self.components.items():
            output = function(queries, prompts, labels)
            if len(output.rewards) != batch_size or len(output.scores) != batch_size:
                raise RewardError(
                    f"{self.name}: component {key!r} returned {len(output.rewards)} rewards for {batch_size} samples"
                )
            for index in range(batch_size):
                rewards[index] += weight * output.rewards[index]
                if self.score_from is None:
                    scores[index] += weight * output.scores[index]
            if key == self.score_from:
                scores = list(output.scores)
            extra_logs[key] = list(output.rewards)
            fallbacks.update(output.fallback_indices)
            timeouts.update(output.timeout_indices)
        return RewardOutput(
            rewards=rewards,
            scores=scores,
            extra_logs=extra_logs,
            fallback_indices=sorted(fallbacks),
            timeout_indices=sorted(timeouts),
        )
