"""The `rl-launch` command: `rl-launch ppo [--config FILE] [--print-config] [--section.option VALUE ...]`.

Parsing and checking the configuration imports only the config structs (msgspec, yaml, torch via
rl_algos): a wrong value fails in a fraction of a second with `rl-launch ppo: error: <message>`
and exit code 2, before Ray, vLLM, DeepSpeed or transformers are imported. The run itself
(`rl_launch.ppo.run`) is imported only when there is something to run.

Configuration layers of `ppo`, in increasing priority: the defaults of `PPOConfig`, the chosen
preset's settings (`rl_launch.presets.preset_settings`; the preset is `--preset`, else the file's
`preset`, else auto: arithmetic only when the run names neither a model nor prompt data), the
`--config` file, the dotted command-line options. `rl-launch components` lists what the
component options (`algo.advantage.options`, `algo.policy.options`, ...) can hold.

Exit codes: the run's own code; 0 after `--help` or `--print-config`; 2 for a bad command line
or configuration (and no subcommand); 130 when interrupted (Ctrl-C), 143 on SIGTERM: a run then
saves its last finished step first (`rl_launch.preemption`).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from .command import resolve_with_preset, run_command
from .config import ConfigError, PPOConfig
from .options import (
    HelpFormatter,
    build_parser,
    check_unknown_args,
    overrides_from_namespace,
    parse_value,
    split_mapping_entries,
)

__all__ = ["build_main_parser", "console_main", "main", "resolve_ppo_config"]

PROG = "rl-launch"


def build_main_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `rl-launch` parser and its subcommand parsers by name."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="The RL post-training stack on Ray (vLLM rollouts, DeepSpeed learners).",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    ppo = commands.add_parser(
        "ppo",
        help="Train a policy with PPO / GRPO / RLOO / REINFORCE++ (any rl_algos estimator and loss).",
        description=(
            "Train a policy with PPO-family RL. Settings come from, in increasing priority: the "
            "defaults below, the preset's settings, the --config file and the dotted options."
        ),
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    build_parser(PPOConfig, ppo)
    ppo.add_argument(
        "--plugin",
        action="append",
        metavar="MODULE",
        help="A module or .py file registering components, imported in the driver and every actor "
        "(repeatable; added to `plugins`).",
    )
    from .serve_rm import ServeRMConfig

    serve_rm = commands.add_parser(
        "serve-rm",
        help="Serve a reward model over HTTP (OpenRLHF's /get_reward API) for reward.remote_url.",
        description=(
            "Serve a reward model over HTTP: POST /get_reward {query, prompts?, labels?} -> "
            "{rewards, scores}, GET /health. Settings come from, in increasing priority: the "
            "defaults below, the --config file and the options."
        ),
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    build_parser(ServeRMConfig, serve_rm)
    components = commands.add_parser(
        "components",
        help="List the components `ppo` can use by name (estimators, losses, KL estimators, engines, "
        "rewards) with their options and defaults.",
        formatter_class=HelpFormatter,
    )
    components.add_argument(
        "--plugin", action="append", metavar="MODULE", help="Import this plugin first (repeatable)."
    )
    from .trainers import COMMANDS

    parsers = {"ppo": ppo, "components": components, "serve-rm": serve_rm}
    for name, help_text in (
        ("sft", "Supervised fine-tuning on prompt / response rows (token-mean NLL of the responses)."),
        ("rm", "Train a reward model on chosen / rejected pairs (Bradley-Terry)."),
        ("dpo", "Train a policy on chosen / rejected pairs with DPO, cDPO or IPO."),
        ("kto", "Train a policy on completions labelled desirable or undesirable with KTO."),
    ):
        parsers[name] = commands.add_parser(
            name,
            help=help_text,
            description=f"{help_text} Settings come from, in increasing priority: the defaults "
            "below, the preset's settings, the --config file and the dotted options. One rank "
            "trains in this process; --ray.learner.num_actors N trains on N Ray ranks.",
            formatter_class=HelpFormatter,
            allow_abbrev=False,
        )
        build_parser(COMMANDS[name], parsers[name])
    return parser, parsers


def resolve_ppo_config(path: str | None, overrides: Mapping[str, Any]) -> PPOConfig:
    """The `PPOConfig` of a command line, decoded: preset settings < file < dotted overrides.

    The preset is chosen first (the `preset` override, else the file's, else auto), so that its
    settings can sit under the file. auto is arithmetic when neither `model.pretrain` nor
    `data.prompt_data` is given, else none; "none" contributes nothing. Decoding consults no
    registry and imports no plugin: the names of components are checked afterwards, once, by
    `rl_launch.validation.prepare` (which imports the config's plugins first).

    Raises:
        ConfigError: a missing or invalid file, an unknown preset, or any invalid option.
    """
    return resolve_with_preset(
        PPOConfig,
        path,
        overrides,
        own_keys=("model.pretrain", "data.prompt_data"),
        settings_of=_preset_settings,
        rewrite=_former_keys_of(path),
    )


def _preset_settings(preset: str) -> dict[str, Any]:
    from .presets import preset_settings  # only when a preset is chosen

    return preset_settings(preset)


def _former_keys_of(path: str | None) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The config file's settings with rl-launch's former option names rewritten (a note each)."""

    def rewrite(settings: dict[str, Any]) -> dict[str, Any]:
        from .former import migrate_former_keys

        try:
            settings, notes = migrate_former_keys(settings)
        except ValueError as error:
            raise ConfigError(f"{error} (in {path})") from None
        for note in notes:
            print(f"{PROG} ppo: former option in {path}: {note}", file=sys.stderr)
        return settings

    return rewrite


def _ppo_overrides(args: argparse.Namespace, extras: list[str]) -> dict[str, Any]:
    """Dotted options, entries of dict options (`--algo.policy.options.x 1`) and `--plugin`s."""
    entries, rest = split_mapping_entries(PPOConfig, extras)
    check_unknown_args(PPOConfig, rest)
    overrides: dict[str, Any] = {**overrides_from_namespace(PPOConfig, args), **entries}
    if args.plugin:
        listed = (
            parse_value(overrides["plugins"], list[str], name="plugins") if "plugins" in overrides else []
        )
        overrides["plugins"] = [*listed, *args.plugin]
    return overrides


def _resolve_ppo(args: argparse.Namespace, extras: list[str]) -> PPOConfig:
    """The config of `ppo`, decoded, then prepared (plugins imported, every component's name and
    options checked, a note for each translation): the one check of the run and of
    --print-config (`rl_launch.ppo.run` trusts it)."""
    from .validation import prepare

    return prepare(resolve_ppo_config(args.config, _ppo_overrides(args, extras)))


def _run_ppo(config: PPOConfig) -> int:
    from .ppo import run

    return run(config)


def _list_components(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Print every registered component and its options with their defaults."""
    from .components import list_components
    from .plugins import import_plugins, resolve_plugins

    try:
        import_plugins(resolve_plugins(args.plugin or []))
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(list_components())
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: parse `argv`, run the command, return its exit code (`console_main` is the
    console script that calls it).

    `--help` exits through argparse (SystemExit 0), as do argparse's own usage errors (2).
    """
    parser, commands = build_main_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    from .aliases import COMMANDS as ALIASED_COMMANDS

    if argv[:1] and argv[0] in ALIASED_COMMANDS:
        from .aliases import expand_aliases
        from .former import expand_former_options

        command, former = argv[0], []
        try:
            if command == "ppo":
                argv, former = expand_former_options(argv)
            argv, notes = expand_aliases(argv, command)
        except ValueError as error:
            print(f"{PROG} {command}: error: {error}", file=sys.stderr)
            return 2
        for note in former:  # stderr: --print-config's YAML on stdout stays clean
            print(f"{PROG} {command}: former option {note}", file=sys.stderr)
        for note in notes:
            print(f"{PROG} {command}: OpenRLHF flag {note}", file=sys.stderr)
    args, extras = parser.parse_known_args(argv)
    if args.command is None:
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        parser.print_help(sys.stderr)
        return 2
    if args.command == "serve-rm":
        from . import serve_rm

        return serve_rm.run_command(commands["serve-rm"], args, extras)
    if args.command == "components":
        if extras:
            commands["components"].error(f"unrecognized arguments: {' '.join(extras)}")
        return _list_components(commands["components"], args)
    from .trainers import COMMANDS

    if args.command in COMMANDS:
        from .trainers import resolve_config, run

        command, cls = args.command, COMMANDS[args.command]

        def resolve() -> Any:
            entries, rest = split_mapping_entries(cls, extras)
            check_unknown_args(cls, rest)
            return resolve_config(command, args.config, {**overrides_from_namespace(cls, args), **entries})

        return run_command(
            commands[command].prog, resolve, args.print_config, lambda config: run(command, config)
        )
    return run_command(
        commands[args.command].prog, lambda: _resolve_ppo(args, extras), args.print_config, _run_ppo
    )


def console_main() -> NoReturn:
    """The `rl-launch` console script and `python -m rl_launch.cli`: `main`, then the process ends.

    Once a command has returned, what outlives the process is released (a run's local Ray is shut
    down and its actors are gone, its files are closed): the exit handlers run (`atexit`: logging,
    file locks, Ray, multiprocessing), and then the process ends without Python's teardown of its
    heap. With torch, transformers, datasets and Ray loaded that teardown is a garbage collection
    of 1.7-1.8 s on 2 cores, for memory the operating system frees at once. `--help`, a usage error
    and an exception end the process as usual.
    """
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console_main()
