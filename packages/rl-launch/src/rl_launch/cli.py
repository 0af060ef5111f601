"""The `rl-launch` command: `rl-launch ppo [--config FILE] [--print-config] [--section.option VALUE ...]`.

Parsing and checking the configuration imports only the config structs (msgspec, yaml, torch via
rl_algos): a wrong value fails in a fraction of a second with `rl-launch ppo: error: <message>`
and exit code 2, before Ray, vLLM, DeepSpeed or transformers are imported. The run itself
(`rl_launch.ppo.run`) is imported only when there is something to run.

Configuration layers of `ppo`, in increasing priority: the defaults of `PPOConfig`, the chosen
preset's settings (`rl_launch.presets.preset_settings`; the preset is `--preset`, else the file's
`preset`, else the default), the `--config` file, the dotted command-line options.

Exit codes: the run's own code; 0 after `--help` or `--print-config`; 2 for a bad command line
or configuration (and no subcommand); 130 when interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

import msgspec

from .config import ConfigError, PPOConfig
from .options import (
    HelpFormatter,
    build_parser,
    check_unknown_args,
    dump_config,
    load_config,
    overrides_from_namespace,
    parse_value,
    read_config_file,
)

__all__ = ["build_main_parser", "main", "resolve_ppo_config"]

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
    return parser, {"ppo": ppo}


def resolve_ppo_config(path: str | None, overrides: Mapping[str, str]) -> PPOConfig:
    """The `PPOConfig` of a command line: preset settings < file < dotted overrides.

    The preset is chosen first (the `preset` override, else the file's, else the default), so
    that its settings can sit under the file. Preset "none" contributes nothing.

    Raises:
        ConfigError: a missing or invalid file, an unknown preset, or any invalid option.
    """
    preset_field = next(field for field in msgspec.structs.fields(PPOConfig) if field.name == "preset")
    if "preset" in overrides:
        preset = parse_value(overrides["preset"], preset_field.type, name="preset")
    else:
        from_file = read_config_file(path).get("preset") if path is not None else None
        preset = preset_field.default if from_file is None else from_file
        preset = parse_value(str(preset), preset_field.type, name="preset")
    settings: dict[str, Any] = {}
    if preset != "none":
        from .presets import preset_settings

        settings = preset_settings(preset)
    return load_config(PPOConfig, path, overrides, base=settings)


def _run_ppo(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> int:
    try:
        check_unknown_args(PPOConfig, extras)
        config = resolve_ppo_config(args.config, overrides_from_namespace(PPOConfig, args))
    except (ConfigError, FileNotFoundError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_config(config))
        return 0
    from .ppo import run

    code = run(config)
    return 0 if code is None else int(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rl-launch` console script; returns the exit code.

    `--help` exits through argparse (SystemExit 0), as do argparse's own usage errors (2).
    """
    parser, commands = build_main_parser()
    args, extras = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        parser.print_help(sys.stderr)
        return 2
    try:
        return _run_ppo(commands[args.command], args, extras)
    except KeyboardInterrupt:
        print(f"{commands[args.command].prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
