"""rl-launch's own former option names (before run format 2), rewritten with a note each.

The rollout correction's four options `algo.policy.is_correction` / `_level` / `_gating` /
`_bounds` are now `algo.policy.correction` and its options `algo.policy.correction_options`
(`FORMER_CORRECTION_KEYS`). `expand_former_options` rewrites a command line,
`migrate_former_keys` a config file's settings and the configuration of a format-1 `run.json`
(so an old run folder resumes). OpenRLHF's flags are another matter (`rl_launch.aliases`).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FORMER_CORRECTION_KEYS", "expand_former_options", "migrate_former_keys", "option_tokens"]


def option_tokens(pairs: Sequence[tuple[str, str]]) -> list[str]:
    """`--name value` for each pair, as a command line has them."""
    # A value starting with "-" would read as an option to argparse (`-10,10`): keep it attached.
    tokens: list[str] = []
    for name, value in pairs:
        tokens.extend([f"--{name}={value}"] if value.startswith("-") else [f"--{name}", value])
    return tokens


FORMER_CORRECTION_KEYS: tuple[str, ...] = (
    "is_correction",
    "is_correction_level",
    "is_correction_gating",
    "is_correction_bounds",
)
"""`algo.policy` keys that named the rollout correction before it became a registry entry with
its own options: now `algo.policy.correction` and `algo.policy.correction_options`."""

_OLD_DEFAULTS = {
    "is_correction_level": "token",
    "is_correction_gating": "ratio",
    "is_correction_bounds": (0.5, 5.0),
}
_FILTERS = ("seq-mask", "seq-mask-tis")  # geometric by definition, ratio-gated only


def _bounds(value: Any) -> tuple[float, float]:
    parts = value.strip("[]() ").replace(",", " ").split() if isinstance(value, str) else list(value)
    try:
        low, high = (float(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(
            f"algo.policy.is_correction_bounds: expected two numbers (low, high), got {value!r}"
        ) from None
    return low, high


def _former_correction(former: Mapping[str, Any]) -> list[tuple[str, Any, list[tuple[str, Any]] | str]]:
    """(former key, its value, the `algo.policy` keys and values it becomes or why it is dropped).

    The rule keeps every run's weights: a correction keeps its name (every former name is a
    registry name); a level, gating or bounds equal to the former default is dropped (it is the
    default of every correction that takes it), and so is one the former correction ignored
    (none's; seq-mask's level and gating; auto's gating, which ran only when auto picked none).
    """
    kind = str(former.get("is_correction", "auto"))
    changes: list[tuple[str, Any, list[tuple[str, Any]] | str]] = []
    for key in FORMER_CORRECTION_KEYS:
        if key not in former:
            continue
        value = former[key]
        if key == "is_correction":
            changes.append((key, value, [("correction", kind)]))
            continue
        if key == "is_correction_bounds":
            value = _bounds(value)
        if kind == "none":
            changes.append((key, value, "the correction is none"))
        elif value == _OLD_DEFAULTS[key]:
            changes.append((key, value, "it is the correction's default"))
        elif key == "is_correction_level":
            if kind in _FILTERS:
                changes.append((key, value, f"{kind} is geometric by definition; the level was unused"))
            else:
                changes.append((key, value, [("correction_options.level", value)]))
        elif key == "is_correction_gating":
            if kind in (*_FILTERS, "auto"):
                changes.append((key, value, f"{kind} gates on the ratio; this gating was unused"))
            else:
                changes.append((key, value, [("correction_options.gating", value)]))
        else:
            changes.append(
                (key, value, [("correction_options.low", value[0]), ("correction_options.high", value[1])])
            )
    return changes


def migrate_former_keys(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A nested configuration (a config file's, a format-1 run.json's) with `algo.policy`'s former
    correction keys (`FORMER_CORRECTION_KEYS`) rewritten; one note per former key.

        {"algo": {"policy": {"is_correction": "tis", "is_correction_bounds": [0.5, 2.0]}}}
        → {"algo": {"policy": {"correction": "tis", "correction_options": {"high": 2.0}}}}

    Options the section already gives in `correction_options` win over converted ones.

    Raises:
        ValueError: both `is_correction` and `correction`, or bounds that are not two numbers.
    """
    algo = config.get("algo")
    policy = algo.get("policy") if isinstance(algo, Mapping) else None
    if not isinstance(policy, Mapping) or not any(key in policy for key in FORMER_CORRECTION_KEYS):
        return dict(config), []
    if "is_correction" in policy and "correction" in policy:
        raise ValueError(
            "algo.policy: give correction (its former name is_correction) once, not both; "
            f"got is_correction {policy['is_correction']!r} and correction {policy['correction']!r}"
        )
    new_policy = {key: value for key, value in policy.items() if key not in FORMER_CORRECTION_KEYS}
    options: dict[str, Any] = {}
    notes = []
    for key, value, change in _former_correction(policy):
        if isinstance(change, str):
            notes.append(f"algo.policy.{key} {value!r} → dropped: {change}")
            continue
        for name, new_value in change:
            if name.startswith("correction_options."):
                options[name.partition(".")[2]] = new_value
            else:
                new_policy[name] = new_value
        notes.append(
            f"algo.policy.{key} {value!r} → " + ", ".join(f"algo.policy.{n} {v!r}" for n, v in change)
        )
    if options:
        new_policy["correction_options"] = {**options, **dict(new_policy.get("correction_options") or {})}
    return {**config, "algo": {**algo, "policy": new_policy}}, notes


def expand_former_options(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Rewrite rl-launch's former option names in a command line (`--algo.policy.is_correction
    tis --algo.policy.is_correction_bounds 0.5,2`) into today's (`--algo.policy.correction tis
    --algo.policy.correction_options.high 2.0`), in place of the first of them; one note per
    former option, as `expand_aliases` writes them. Arguments after a bare `--` are left alone.

    Raises:
        ValueError: a former option without its value, or with a value that has no counterpart.
    """
    argv = list(argv)
    stop = argv.index("--") if "--" in argv else len(argv)
    former: dict[str, str] = {}
    written: dict[str, list[str]] = {}
    kept: list[str] = []
    first = None
    index = 0
    while index < stop:
        token = argv[index]
        name, equals, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        key = name.removeprefix("algo.policy.")
        if name.startswith("algo.policy.") and key in FORMER_CORRECTION_KEYS:
            if equals:
                value, index = inline, index + 1
            elif index + 1 < stop and not argv[index + 1].startswith("--"):
                value, index = argv[index + 1], index + 2
            else:
                raise ValueError(f"--{name} (the former name of --algo.policy.correction*) expects a value")
            first = len(kept) if first is None else first
            former[key] = value
            written[key] = [f"--{name}", value]
            continue
        kept.append(token)
        index += 1
    if not former:
        return argv, []
    tokens: list[str] = []
    notes: list[str] = []
    for key, _value, change in _former_correction(former):
        original = shlex.join(written[key])
        if isinstance(change, str):
            notes.append(f"{original} → dropped: {change}")
            continue
        new = option_tokens([(f"algo.policy.{name}", str(new_value)) for name, new_value in change])
        tokens.extend(new)
        notes.append(f"{original} → {shlex.join(new)}")
    first = first or 0
    return [*kept[:first], *tokens, *kept[first:], *argv[stop:]], notes
