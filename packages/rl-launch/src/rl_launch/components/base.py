"""What every component kind is made of: a declared entry, its options, and the generic checks.

A kind (`ComponentKind`) says where a run names its component (`algo.policy.loss`), where that
component's options are (`algo.policy.options`), what a registered name accepts, and the checks
of its own that need a dry run. `rl_launch.components` reads these entries to check, describe and
list every kind with one loop; nothing outside a kind's module knows its names.

A registry whose components have capabilities (an engine that cannot receive weights, an
executor whose options come from a class) is a `ComponentRegistry`: registering wraps the builder
into the kind's entry dataclass, so a capability is data on the entry, given at registration:

    @ENGINES.register("my_engine", receives_weights=False, required_options=("base_url",))
    def my_engine(spec, *, base_url, **options): ...
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from rl_algos import Registry

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = [
    "ComponentKind",
    "ComponentRegistry",
    "Selection",
    "check_options",
    "component_options",
    "dry_run",
    "format_options",
]

SUPPLIED_BY_THE_RUN = frozenset({"generator", "all_reduce"})
"""Keyword arguments the learner fills itself (a random generator, a data-parallel all-reduce)."""


def component_options(fn: Callable, *, inputs: Iterable[str] = ()) -> dict[str, Any]:
    """Option name -> default of a registered function or class: its keyword arguments with a
    default, minus the `inputs` the run hands it and what the run supplies itself. A `**kwargs`
    shows as `"**"`."""
    inputs = frozenset(inputs)
    options: dict[str, Any] = {}
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            options["**"] = None
        elif (
            parameter.default is not inspect.Parameter.empty
            and parameter.kind is not inspect.Parameter.VAR_POSITIONAL
            and name not in inputs
            and name not in SUPPLIED_BY_THE_RUN
        ):
            options[name] = parameter.default
    return options


def check_options(
    section: str, kind: str, name: str, given: Mapping[str, Any], takes: Mapping[str, Any]
) -> None:
    """ConfigError for the first key of `given` that is not in `takes` (unless it takes `**`)."""
    if "**" in takes:
        return
    for key in given:
        if key not in takes:
            close = difflib.get_close_matches(key, list(takes), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            if len(takes) > 24:  # vLLM's engine arguments: name the close one, not all of them
                allowed = f"{len(takes)} options (its own and, for vllm, vLLM's engine arguments)"
            else:
                allowed = ", ".join(sorted(takes)) or "no options"
            raise ConfigError(f"{section}.{key}: not an option of {kind} {name!r}; it takes {allowed}{hint}")


def dry_run(section: str, what: str, call: Callable[[], Any]) -> None:
    """Run `call`; a TypeError / ValueError / KeyError it raises becomes a ConfigError of `section`."""
    try:
        call()
    except (TypeError, ValueError, KeyError) as error:
        raise ConfigError(f"{section}: {what} refused its options: {error}") from None


def format_options(options: Mapping[str, Any]) -> str:
    """`a=1, b='x'`, without the `"**"` marker of a component that takes any option."""
    return ", ".join(f"{key}={value!r}" for key, value in options.items() if key != "**")


class ComponentRegistry(Registry):
    """A registry whose values are entries of `entry_type`, a dataclass whose field `builder`
    holds the function: `register(name, **capabilities)` wraps the decorated function as
    `entry_type(<builder>=fn, **capabilities)`; an entry instance may also be registered as it is."""

    def __init__(self, kind: str, entry_type: type, *, builder: str = "build") -> None:
        super().__init__(kind)
        self.entry_type = entry_type
        self.builder = builder

    def builder_of(self, entry: Any) -> Callable[..., Any]:
        """The function an entry wraps (its docstring is what `rl-launch components` shows)."""
        return getattr(entry, self.builder)

    def register(
        self,
        name: str,
        fn: Any = None,
        *,
        aliases: Iterable[str] = (),
        override: bool = False,
        **capabilities: Any,
    ) -> Any:
        def add(build: Any) -> Any:
            entry = (
                build
                if isinstance(build, self.entry_type)
                else self.entry_type(**{self.builder: build}, **capabilities)
            )
            Registry.register(self, name, entry, aliases=aliases, override=override)
            return build

        return add if fn is None else add(fn)


@dataclasses.dataclass(frozen=True)
class Selection:
    """One component a config picks: the dotted key naming it, its options and what it takes."""

    key: str
    """Dotted option holding the name (`algo.policy.loss`)."""
    name: str
    options_key: str | None
    """Dotted option holding its options verbatim (`algo.policy.options`), None if it has none."""
    options: Mapping[str, Any]
    takes: Mapping[str, Any] | None
    """Option -> default it accepts (`"**"`: any); None: not known before the component is built."""
    allowed: tuple[str, ...] = ()
    """Names that are valid without being registered (`auto`, `none`)."""
    options_owner: tuple[str, str] | None = None
    """(kind, name) that takes the options when it is not the component itself (the KL options
    belong to `kl_penalty`, whichever estimator it computes)."""
    names: Collection[str] | None = None
    """The registered names valid here; None: every name of the kind's registry (the KL in the
    reward takes no straight-through "+" variant: it carries no gradient)."""


@dataclasses.dataclass(frozen=True)
class ComponentKind:
    """A kind of component of `rl-launch ppo`, as the generic check / describe / list code sees it."""

    title: str
    """Plural, for `rl-launch components` ("advantage estimators")."""
    singular: str
    """For errors ("advantage estimator")."""
    registry: Registry
    where: str
    """How a config picks it, for the listing ("algo.policy.loss, options: algo.policy.options")."""
    select: Callable[[PPOConfig], list[Selection]]
    """The components of this kind a config picks (none, one, or one per side as for the KL)."""
    options_of: Callable[[str], Mapping[str, Any]] | None = None
    """A registered name -> the options it takes with their defaults, for the listing; None: the
    kind's options are not per name."""
    check: Callable[[PPOConfig], None] | None = None
    """The kind's own checks once names and options are known: dry runs, combinations."""
    describe: Callable[[PPOConfig], str | None] | None = None
    """Its part of the start-up line."""
    listing_note: str = ""
    """A line under the kind in `rl-launch components`."""
    extra_names: tuple[str, ...] = ()
    """Names a config may give that are not registry entries (listed with the kind)."""
