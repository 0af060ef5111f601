"""The shape every `rl-launch` command shares, written once (torchtune's recipe shape).

    resolve_with_preset   the config of a command line: preset settings < file < dotted options
    ray_address_override  ray.address as `ray.init()` reads it: "local", else RAY_ADDRESS when not given
    run_command           a bad config -> `<prog>: error: <message>`, exit 2; --print-config; the run
    Recipe / run_recipe   a run as setup -> train -> cleanup, its failures mapped to exit codes

Exit codes of a run (`run_recipe`): 0 on success; 2 for a bad configuration or run folder
(`ConfigError`, `RunFolderError`); 1 for inputs the preflight refuses, a cluster that cannot host
the run, a health stop or a failed actor; 130 for Ctrl-C; the signal's own code (143 for SIGTERM)
when a signal stopped the run (`rl_launch.preemption`).

Only the standard library is imported here at module level: the command line parses and checks
its configuration before Ray, torch's learners or transformers are imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError

__all__ = [
    "Recipe",
    "given",
    "ray_address_override",
    "ray_line",
    "resolve_with_preset",
    "run_command",
    "run_recipe",
]


def given(path: str | None, overrides: Mapping[str, Any], dotted: str) -> Any:
    """The value of `dotted` from the command line, else from the file, else None (no defaults)."""
    from .options import read_config_file

    if dotted in overrides:
        return overrides[dotted]
    data: Any = read_config_file(path) if path is not None else {}
    for key in dotted.split("."):
        if not isinstance(data, Mapping) or key not in data:
            return None
        data = data[key]
    return data


def resolve_with_preset(
    cls: type,
    path: str | None,
    overrides: Mapping[str, Any],
    *,
    own_keys: tuple[str, ...],
    settings_of: Callable[[str], dict[str, Any]],
    rewrite: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """The `cls` config of a command line: the preset's settings < the file < dotted overrides.

    The preset is chosen first (the `preset` override, else the file's, else auto), so that its
    settings can sit under the file: auto is arithmetic when the run gives none of `own_keys`
    (its own model or data), else none; "none" contributes nothing. `settings_of(preset)` are the
    preset's settings; `rewrite` rewrites the file's settings (former option names).

    Raises:
        ConfigError: a missing or invalid file, an unknown preset or any invalid option.
    """
    import msgspec

    from .options import load_config, parse_value

    field = next(field for field in msgspec.structs.fields(cls) if field.name == "preset")
    preset = given(path, overrides, "preset")
    preset = parse_value(str(preset) if preset is not None else "auto", field.type, name="preset")
    if preset == "auto":
        own = any(given(path, overrides, key) is not None for key in own_keys)
        preset = "none" if own else "arithmetic"
    settings = settings_of(preset) if preset != "none" else {}
    overrides = {**overrides, **ray_address_override(cls, path, overrides), "preset": preset}
    return load_config(cls, path, overrides, base=settings, rewrite=rewrite)


def ray_address_override(cls: type, path: str | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`ray.address` as Ray's own `ray.init()` reads it: "local" starts a local Ray (None in the
    config), and where neither the command line nor the file gives an address, RAY_ADDRESS names
    the cluster to join when it is set (`ray job submit` sets it for its entrypoint: a run that
    started a local Ray beside the cluster would use the head node alone), said on stderr.
    Empty for a config without `ray.address`."""
    import msgspec

    ray = next((field for field in msgspec.structs.fields(cls) if field.name == "ray"), None)
    if ray is None or not any(field.name == "address" for field in msgspec.structs.fields(ray.type)):
        return {}
    address = given(path, overrides, "ray.address")
    if address == "local":
        return {"ray.address": None}
    environ = os.environ.get("RAY_ADDRESS", "")
    if address is not None or not environ:
        return {}
    print(
        f"ray.address {environ}: from RAY_ADDRESS (ray job submit sets it for its entrypoint); "
        "--ray.address local starts a local Ray instead",
        file=sys.stderr,
    )
    return {"ray.address": environ}


def run_command(prog: str, resolve: Callable[[], Any], print_config: bool, run: Callable[[Any], int]) -> int:
    """Resolve a command's config (a bad one prints `<prog>: error: <message>` and returns 2, before
    anything heavy loads), print it as YAML (`--print-config`, 0) or run it; Ctrl-C outside a
    run's own handling prints `<prog>: interrupted` and returns 130."""
    try:
        try:
            config = resolve()
        except (ConfigError, FileNotFoundError) as error:
            print(f"{prog}: error: {error}", file=sys.stderr)
            return 2
        if print_config:
            from .options import dump_config

            sys.stdout.write(dump_config(config))
            return 0
        code = run(config)
        return 0 if code is None else int(code)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def ray_line(started_ray: bool, address: str | None) -> str:
    """The start-up line of the cluster a run uses: the one at `address` it joined, the local Ray
    it started, or the Ray this process had initialized before the run."""
    if address is not None:
        return f"ray: joined {address}"
    return (
        "ray: local cluster on 127.0.0.1"
        if started_ray
        else "ray: the Ray this process had already initialized"
    )


class Recipe:
    """One run of a command: `setup` (inputs, run folder, data, actors), `train` (the steps and what
    follows them; the exit code), `cleanup` (always, whatever happened).

    `run_recipe` calls them and maps what they raise to exit codes. A recipe keeps `guard` (its
    `PreemptionGuard` once installed), says whether its steps began (`stepping`), which errors are
    failed actors (`ray_errors`, once it uses Ray) and what to print for one (`diagnose`)."""

    name = "rl-launch"
    guard: Any = None
    ray_errors: tuple[type[BaseException], ...] = ()

    @property
    def stepping(self) -> bool:
        """Whether the first step has begun (before it, a signal finds nothing to save)."""
        return False

    def setup(self) -> None:
        raise NotImplementedError

    def train(self) -> int:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Release what `setup` started (actors, Ray, the signal handlers); must not raise."""

    def diagnose(self, error: BaseException) -> str:
        """The lines printed after `<name>: error: ` for a failed actor (`ray_errors`)."""
        return str(error)


def run_recipe(recipe: Recipe) -> int:
    """Run `recipe` (setup, train, cleanup); the process exit code (see the module docstring)."""
    from .cluster import ClusterError
    from .health import HealthError
    from .preflight import PreflightError
    from .runs import RunFolderError

    try:
        recipe.setup()
        return recipe.train()
    except (ConfigError, PreflightError, ClusterError, RunFolderError) as error:
        print(f"{recipe.name}: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, (ConfigError, RunFolderError)) else 1
    except HealthError as error:
        print(f"{recipe.name}: stopped: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        guard = recipe.guard
        if guard is not None and guard.requested:
            what = (
                "without saving"
                if recipe.stepping
                else "during start-up, before the first step (nothing to save)"
            )
            print(f"{recipe.name}: {guard.signal_name}: stopped {what}", file=sys.stderr)
            return guard.exit_code
        return 130
    except Exception as error:
        if not isinstance(error, recipe.ray_errors):
            raise
        print(f"{recipe.name}: error: {recipe.diagnose(error)}", file=sys.stderr)
        return 1
    finally:
        recipe.cleanup()
