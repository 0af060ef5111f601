"""verifiers environments as prompts and as a reward (`pip install 'rl-rollout[verifiers]'`).

verifiers 0.4 (PyPI `verifiers`, imported as `verifiers.v1`) describes an environment as a
taskset module whose `__all__` exports one `vf.Taskset` subclass: its `load()` yields `vf.Task`s,
each a `vf.TaskData` row (`prompt`, `system_prompt` and the task's own fields, an answer say) and
a task class that scores a finished `vf.Trace` with its async `@vf.reward` methods (weighted; the
trace's reward is Σ weight·score) and logs its `@vf.metric`s. A module that also exports a
`vf.Env` subclass drives its episodes itself (multi-turn: `rl_rollout.verifiers_episode`).

Our engine generates, token in / token out: verifiers code never calls a model here. A source
names the taskset and its config, URL-query style (no commas, so it fits a list of datasets):

    verifiers:my_envs.arith                the module my_envs.arith (or a taskset id verifiers ships)
    verifiers:envs/arith.py?size=64        a file; size=64 is a field of its TasksetConfig
    verifiers:envs/arith.py?limit=8        the first 8 tasks (needed for an INFINITE taskset)

Values are read as JSON when they parse (3, 0.5, true), else kept as text; a field its config
lacks, or a value it refuses, is an error naming the config's fields.

`verifiers_rows(source)` gives one row per task: the prompt as chat messages (the task's system
prompt, then its prompt; "-" for a task without one, whose environment opens the conversation)
and, as the label, a short JSON naming the taskset, its options and the task's `TaskData`
(verifiers' own wire form), from which `task_of_label` rebuilds the task without loading the
taskset again.

`VerifiersReward` scores a single-turn task: it builds the trace verifiers would have recorded
(the prompt messages, then our response as the one sampled assistant message) and runs the task's
own scoring, `Task.score`, on it; the reward is `trace.reward`. Scoring has a deadline: the
task's `timeout.scoring`, else `scoring_timeout_s` (an async rubric function is cancelled there;
one that blocks its thread is abandoned at the caller's deadline, rl-launch's
`reward.function_timeout_s`). Loading a taskset (importing its module, `load()`) runs on a
thread abandoned after `load_timeout_s`.

Refused, by name, because they need what rl-rollout does not run: tools (`Toolset`s), plugged
judges (they call a model), container tasks, `Task.setup` / `finalize` / `stage_verifier`
(runtime hooks), `@vf.intercept` hooks and `@vf.stop`s on a Request or Response (they rewrite or
refuse model calls); `@vf.stop`s on the Trace are honoured by the episodes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from .rewards import RuleReward, _check_timeout

__all__ = [
    "DEFAULT_LOAD_TIMEOUT_S",
    "DEFAULT_SCORING_TIMEOUT_S",
    "LOAD_ERRORS",
    "VERIFIERS_INSTALL",
    "VERIFIERS_PREFIX",
    "VerifiersDeadline",
    "VerifiersEnvironment",
    "VerifiersReward",
    "is_verifiers_source",
    "load_verifiers_environment",
    "parse_verifiers_source",
    "task_of_label",
    "verifiers_label",
    "verifiers_rows",
]

VERIFIERS_PREFIX = "verifiers:"
"""A dataset source starting with this names a verifiers taskset."""
VERIFIERS_INSTALL = "pip install 'rl-rollout[verifiers]'"
LIMIT = "limit"
"""The one source option that is not a field of the taskset's config: the first N tasks."""
DEFAULT_SCORING_TIMEOUT_S = 60.0
DEFAULT_LOAD_TIMEOUT_S = 600.0
PROMPTLESS = "-"
"""The dataset prompt of a task without one: its environment's first message replaces it."""


class VerifiersDeadline(RuntimeError):
    """A call into verifiers code (loading a taskset, scoring a trace, an env's run or finalize) ran
    past its deadline. Not a TimeoutError: an executor reads those as its own episode deadline."""


LOAD_ERRORS = (ImportError, FileNotFoundError, AttributeError, TypeError, ValueError, VerifiersDeadline)
"""What loading a taskset raises for what the user named wrong (each message names the taskset)."""


def is_verifiers_source(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(VERIFIERS_PREFIX)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_verifiers_source(source: str) -> tuple[str, dict[str, Any]]:
    """(taskset, options) of `verifiers:<module or file.py>?key=value&...`, each value read as
    JSON when it parses. ValueError naming what is wrong; the taskset is not imported here."""
    if not is_verifiers_source(source):
        raise ValueError(f"{source!r} does not start with {VERIFIERS_PREFIX!r}")
    taskset, _, query = source[len(VERIFIERS_PREFIX) :].partition("?")
    if not taskset.strip() or taskset != taskset.strip():
        raise ValueError(
            f"{source!r}: expected verifiers:<module or path/to/file.py>[?limit=N&field=value...] "
            "(e.g. verifiers:envs/arith.py?limit=64)"
        )
    options = {
        key: _value(text)
        for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    }
    limit = options.get(LIMIT)
    if LIMIT in options and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"{source!r}: limit={limit!r}; expected an integer >= 1")
    return taskset, options


def import_verifiers() -> Any:
    """`verifiers.v1` (ImportError with the pip line where verifiers 0.4 is not installed)."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ImportError(
            f"verifiers 0.4 (verifiers.v1) cannot be imported ({error}): {VERIFIERS_INSTALL}"
        ) from None
    return vf


def _is_file(taskset: str) -> bool:
    return taskset.endswith(".py") or "/" in taskset


def _module(taskset: str) -> Any:
    """The taskset's module: a file, or an importable module / taskset id (verifiers' own lookup,
    which also finds the tasksets it ships, `verifiers.v1.tasksets.<id>`)."""
    if _is_file(taskset):
        from .rewards import load_python_file

        return load_python_file(Path(taskset).expanduser().resolve(), f"verifiers:{taskset}: taskset")
    try:
        return import_verifiers().import_taskset(taskset)
    except ModuleNotFoundError as error:
        raise ImportError(
            f"verifiers:{taskset}: {error}; give an importable module or a file (verifiers:path/to/env.py)"
        ) from None


def _exported(module: Any, base: type, taskset: str) -> list[type]:
    names = getattr(module, "__all__", None)
    if names is None:
        raise AttributeError(
            f"verifiers:{taskset}: the module defines no __all__; it must export its vf.Taskset subclass "
            "(and its vf.Env subclass, if any) in __all__"
        )
    found = [getattr(module, name, None) for name in names]
    return [obj for obj in found if isinstance(obj, type) and issubclass(obj, base) and obj is not base]


def _one(classes: list[type], base: str, taskset: str, *, required: bool) -> type | None:
    if len(classes) > 1 or (required and not classes):
        raise TypeError(
            f"verifiers:{taskset}: __all__ exports {len(classes)} {base} subclasses "
            f"({', '.join(c.__name__ for c in classes) or 'none'}); expected {'exactly' if required else 'at most'} one"
        )
    return classes[0] if classes else None


def _validation_errors(error: Exception) -> str:
    """pydantic's errors as `field: message; ...` (any other error as itself)."""
    if not callable(getattr(error, "errors", None)):
        return f"{type(error).__name__}: {error}"
    return "; ".join(
        f"{'.'.join(map(str, item['loc'])) or '(config)'}: {item['msg']}" for item in error.errors()
    )


@dataclass
class VerifiersEnvironment:
    """A verifiers taskset module, loaded: its taskset (config applied), its `Env` class
    (`SingleAgentEnv` when it exports none) and that env's config; no task is loaded yet."""

    taskset_id: str
    """The taskset as given (a file as its absolute path)."""
    options: dict[str, Any]
    taskset: Any
    env_class: type
    env_config: Any
    seat: str
    """The env's one seat (its `vf.AgentConfig` field), the one our policy plays."""
    drives_episodes: bool
    """The module exports its own `vf.Env`: its `run()` drives the episode (multi-turn)."""
    _checked: set = field(default_factory=set, repr=False, init=False)

    @property
    def name(self) -> str:
        return f"verifiers:{self.taskset_id}"

    def new_env(self) -> Any:
        """An `Env` of the class with this config, for one episode. Its `__init__` (which loads
        harnesses and runtimes for verifiers' own model calls) is not run: `run()` and the hooks
        around it read `self.config` and `self.taskset`, which are set."""
        env = self.env_class.__new__(self.env_class)
        env.config, env.taskset = self.env_config, self.taskset
        return env

    def task(self, data: Mapping[str, Any]) -> Any:
        """The task of `data` (a `TaskData` as JSON), with the taskset's task config, checked."""
        task_class = type(self.taskset).task_type()
        try:
            parsed = task_class.data_type().model_validate(dict(data))
        except Exception as error:  # pydantic's ValidationError
            raise ValueError(
                f"{self.name}: a label's task data does not fit {task_class.__name__}: {error}"
            ) from None
        task = task_class(parsed, self.taskset.config.task)
        check_task(task, self.name, self._checked)
        return task

    def load_tasks(self, *, timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> list[Any]:
        """The taskset's tasks (the first `limit` of them), loaded on a thread with a deadline."""
        from .bounded import CallTimeout, call_with_deadline

        limit = self.options.get(LIMIT)
        if limit is None and not self.taskset.bounded:
            raise ValueError(f"{self.name}: {type(self.taskset).__name__} is infinite; give ?limit=N")
        view = self.taskset if limit is None else self.taskset.take(limit)
        try:
            tasks = call_with_deadline(list, view, timeout_s=timeout_s)
        except CallTimeout as error:
            raise VerifiersDeadline(f"{self.name}: {type(self.taskset).__name__}.load(): {error}") from None
        except Exception as error:
            raise ValueError(f"{self.name}: {type(self.taskset).__name__}.load() raised {error!r}") from error
        if not tasks:
            raise ValueError(f"{self.name}: {type(self.taskset).__name__}.load() yielded no task")
        for task in tasks:
            check_task(task, self.name, self._checked)
        return tasks


_CACHE: dict[str, VerifiersEnvironment] = {}
_CACHE_LOCK = threading.Lock()


def load_verifiers_environment(
    taskset: str, options: Mapping[str, Any] | None = None, *, timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
) -> VerifiersEnvironment:
    """The taskset `taskset` (a module, a taskset id or a `.py` file) with `options` (its config's
    fields, and `limit`), loaded once per process on a thread abandoned after `timeout_s`.

    Raises ImportError / FileNotFoundError (the module or file), AttributeError / TypeError (what
    its `__all__` exports), ValueError (options its config refuses, an env without exactly one
    seat); each message names the taskset."""
    from .bounded import CallTimeout, call_with_deadline

    taskset = str(Path(taskset).expanduser().resolve()) if _is_file(taskset) else taskset
    options = dict(options or {})
    key = json.dumps([taskset, options], sort_keys=True)
    with _CACHE_LOCK:
        if key not in _CACHE:
            try:
                _CACHE[key] = call_with_deadline(_load, taskset, options, timeout_s=timeout_s)
            except CallTimeout as error:
                raise VerifiersDeadline(f"verifiers:{taskset}: loading the taskset module: {error}") from None
        return _CACHE[key]


def _load(taskset: str, options: dict[str, Any]) -> VerifiersEnvironment:
    vf = import_verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.generic import concrete_type

    module = _module(taskset)
    taskset_class = _one(_exported(module, vf.Taskset, taskset), "vf.Taskset", taskset, required=True)
    env_class = _one(_exported(module, vf.Env, taskset), "vf.Env", taskset, required=False)
    config_class = concrete_type(taskset_class, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    fields = {key: value for key, value in options.items() if key != LIMIT}
    try:
        config = config_class.model_validate(fields)
    except Exception as error:  # pydantic's ValidationError
        known = ", ".join(sorted(set(config_class.model_fields) - {"id", "task"}))
        raise ValueError(
            f"verifiers:{taskset}: {config_class.__name__} refused the options {fields}: "
            f"{_validation_errors(error)} (its fields: {known}; and limit=N)"
        ) from None
    env_class = env_class or vf.SingleAgentEnv
    env_config_class = concrete_type(env_class, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    env_config = env_config_class(taskset=config)
    seats = list(agent_config_fields(env_config))
    if len(seats) != 1:
        raise ValueError(
            f"verifiers:{taskset}: {env_class.__name__} declares the seats {seats}; rl-rollout plays exactly "
            "one seat with the policy being trained (verifiers calls no model here)"
        )
    try:
        instance = taskset_class(config)
    except Exception as error:
        raise ValueError(
            f"verifiers:{taskset}: {taskset_class.__name__}({config!r}) raised {error!r}"
        ) from error
    return VerifiersEnvironment(
        taskset_id=taskset,
        options=options,
        taskset=instance,
        env_class=env_class,
        env_config=env_config,
        seat=seats[0],
        drives_episodes=env_class is not vf.SingleAgentEnv,
    )


def check_task(task: Any, where: str, checked: set | None = None) -> None:
    """ValueError naming what `task` needs that rl-rollout does not run (module docstring), once
    per task class and config when `checked` remembers them."""
    key = (type(task), id(task.config))
    if checked is not None and key in checked:
        return
    vf = import_verifiers()
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    name = type(task).__name__
    refused = []
    if type(task).NEEDS_CONTAINER:
        refused.append("a container (NEEDS_CONTAINER)")
    refused += [
        f"{hook}()"
        for hook in ("setup", "finalize", "stage_verifier")
        if getattr(type(task), hook) is not getattr(vf.Task, hook)
    ]
    if type(task).toolsets(task.config):
        refused.append("tools (toolsets())")
    if task.config.judges:
        refused.append("plugged judges (they call a model)")
    if discover_decorated(task, "intercept"):
        refused.append("@vf.intercept hooks")
    for stop in task.hooks("stop"):
        if hook_boundary(stop, allow_trace=True) is not vf.Trace:
            refused.append(f"@vf.stop {stop.__name__} on a Request or Response")
    if refused:
        raise ValueError(
            f"{where}: task {name} needs {', '.join(refused)}, which rl-rollout does not run (it generates "
            "with its own engine and scores the trace without a runtime)"
        )
    if checked is not None:
        checked.add(key)


def verifiers_label(environment: VerifiersEnvironment, task: Any) -> str:
    """The label of `task`: what `task_of_label` rebuilds it from."""
    data = task.data.model_dump(mode="json", exclude_defaults=True)
    return json.dumps(
        {"verifiers": environment.taskset_id, "options": environment.options, "data": data}, sort_keys=True
    )


def task_of_label(label: Any) -> tuple[VerifiersEnvironment, Any]:
    """(environment, task) of a label of `verifiers_rows`."""
    try:
        parsed = json.loads(label) if isinstance(label, str) else label
        taskset, options, data = parsed["verifiers"], parsed["options"], parsed["data"]
    except (TypeError, ValueError, KeyError):
        shown = repr(label) if len(repr(label)) <= 120 else repr(label)[:117] + "..."
        raise ValueError(
            f"label {shown} is not a verifiers label (data.prompt_data verifiers:<taskset> makes them)"
        ) from None
    environment = load_verifiers_environment(taskset, options)
    return environment, environment.task(data)


def opening_messages(data: Any) -> list[Any]:
    """The typed messages a task opens with: its system prompt, then its prompt (none without)."""
    vf = import_verifiers()
    messages: list[Any] = []
    if data.system_prompt is not None:
        messages.append(vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(data.prompt)
    return messages


def chat_messages(messages: list[Any]) -> list[dict[str, str]]:
    """Typed verifiers messages as chat-template messages (role, text content; images dropped)."""
    from verifiers.v1.types import content_text

    return [{"role": message.role, "content": content_text(message.content) or ""} for message in messages]


def verifiers_rows(
    source: str,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """One row per task of the source's taskset: {input_key: chat messages, label_key: label}."""
    taskset, options = parse_verifiers_source(source)
    environment = load_verifiers_environment(taskset, options, timeout_s=timeout_s)
    rows = []
    for task in environment.load_tasks(timeout_s=timeout_s):
        messages = chat_messages(opening_messages(task.data))
        if task.data.prompt is None:
            messages.append({"role": "user", "content": PROMPTLESS})
        rows.append({input_key: messages, label_key: verifiers_label(environment, task)})
    return rows


def new_trace(task: Any, seat: str = "agent") -> Any:
    """An empty `vf.Trace` of `task`, as verifiers' rollout starts one."""
    vf = import_verifiers()
    from verifiers.v1.state import state_cls

    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name=seat),
        state=state_cls(type(task))(),
    )


def add_message(trace: Any, message: Any, *, sampled: bool = False) -> None:
    """Append `message` to the trace's one branch (`sampled`: the model wrote it)."""
    vf = import_verifiers()
    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))


def scoring_timeout(task: Any, default: float | None, agent_config: Any = None) -> float | None:
    """The scoring deadline verifiers gives a task (its seat's `timeout.scoring`, else the task's),
    else `default`."""
    seat = agent_config.timeout.scoring if agent_config is not None else None
    return seat or task.data.timeout.scoring or default


async def score_trace(task: Any, trace: Any, *, timeout_s: float | None, where: str) -> None:
    """`task.score(trace)` (its metrics and rewards, recorded on the trace) within `timeout_s`."""
    if timeout_s is None:
        await task.score(trace)
        return
    try:
        await asyncio.wait_for(task.score(trace), timeout_s)
    except asyncio.TimeoutError:
        raise VerifiersDeadline(
            f"{where}: {type(task).__name__}'s scoring ran past its {timeout_s:g} s deadline"
        ) from None


def _run_coroutine(coroutine: Any, timeout_s: float | None) -> Any:
    """Run `coroutine` to its end from synchronous code: on a fresh event loop here, or on a thread
    of its own when this thread already runs one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from .bounded import call_with_deadline

    return call_with_deadline(
        asyncio.run, coroutine, timeout_s=None if timeout_s is None else timeout_s + 5.0
    )


class VerifiersReward(RuleReward):
    """The task's own scoring (`Task.score`: its `@vf.reward`s, weighted) of the response, for the
    labels of `verifiers_rows` (module docstring); a task whose module exports its own `vf.Env`
    is multi-turn and refused here (`rl_rollout.verifiers_episode`).

    Args:
      scoring_timeout_s: deadline of one sample's scoring where the task sets none.
      on_error, fallback, timeout_s: as `RuleReward` (a label that is not a verifiers label, a
        reward function that raises or runs past its deadline are errors).
    """

    name = "verifiers"

    def __init__(self, *, scoring_timeout_s: float | None = DEFAULT_SCORING_TIMEOUT_S, **kwargs: Any) -> None:
        self.scoring_timeout_s = _check_timeout(scoring_timeout_s)
        super().__init__(**kwargs)

    def score(self, response: str, label: Any) -> float:
        vf = import_verifiers()
        environment, task = task_of_label(label)
        if environment.drives_episodes:
            raise ValueError(
                f"{environment.name}: its {environment.env_class.__name__}.run() drives the episode; "
                "play it with the verifiers episodes (rl_rollout.verifiers_episode; rl-launch "
                "--rollout.executor verifiers), not as a reward"
            )
        if task.data.prompt is None:
            raise ValueError(f"{environment.name}: task {task.data.idx} has no prompt to answer")
        trace = new_trace(task, environment.seat)
        for message in opening_messages(task.data):
            add_message(trace, message)
        add_message(trace, vf.AssistantMessage(content=response), sampled=True)
        trace.stop("agent_completed")
        timeout_s = scoring_timeout(task, self.scoring_timeout_s)
        _run_coroutine(score_trace(task, trace, timeout_s=timeout_s, where=environment.name), timeout_s)
        return float(trace.reward)
