"""Run folders: one run per `log.output_dir`, resumed only when asked and only from its own checkpoints.

`rl-launch ppo` writes everything a run produces into its run folder (`log.output_dir`). This
module decides, before Ray or any engine starts, whether a run may use that folder:

- A fresh run (`ckpt.load_checkpoint false`, the default) needs an empty or missing folder. A
  folder that already holds a run is refused (`RunFolderError`), never overwritten: starting
  the same command twice must not mix two runs' metrics and checkpoints, nor silently continue
  the first one.
- A resumed run (`ckpt.load_checkpoint true`) continues the run recorded in `run.json`, and only
  with a compatible configuration: keys outside `RESUMABLE_KEYS` (algorithm, model, data,
  learner layout...) must be equal, because the checkpoint's weights, optimizer state and data
  position only make sense under them. A folder without a run and without checkpoints starts
  fresh, so that the same command line both starts and continues a run.
- A resumed run loads only checkpoints that it wrote. DeepSpeed checkpoints are pickles, loaded
  with `torch.load(weights_only=False)`: loading one runs whatever code its author put in it, so
  a checkpoint folder must never be loaded on the strength of its path alone (`ckpt.path` can
  point anywhere). The driver writes the run's id and configuration fingerprint into every
  checkpoint's `TrainingState.extra` (`checkpoint_extra`); before anything loads a checkpoint,
  `select_checkpoint` reads them back from `training_state.json` with a JSON decoder and refuses a
  checkpoint without them or from another run. (This protects against mistakes, not forgery:
  anyone who can write the folder can write the JSON too.)

The run manifest `<output_dir>/run.json` (JSON, see `RunManifest`) records the run's id, creation
time, rl-launch version, configuration and fingerprint, and one entry per resume.

Configurations are handled as nested dicts (`msgspec.to_builtins(config)`), so this module does
not depend on the exact fields of `PPOConfig`; keys are named by their dotted path
(`algo.advantage.estimator`). The one exception is reading an older `run.json` format, whose
configuration's former keys `rl_launch.former.migrate_former_keys` rewrites. It imports neither
Ray nor torch (`rl_learner` is imported when checkpoints are listed; that import stays light).

Typical use by the driver, before Ray starts:

    plan = prepare_run_folder(cfg.log.output_dir, msgspec.to_builtins(cfg),
                              resume=cfg.ckpt.load_checkpoint, ckpt_root=ckpt_root, roles=roles)
    print(plan.message)
    ...
    for role, folder in plan.checkpoints.items():       # empty unless plan.resume
        load_checkpoint(folder.parent, engines, tag=folder.name)
    ...
    TrainingState(step=..., extra={**other_extra, **checkpoint_extra(plan)})
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from .__about__ import __version__

__all__ = [
    "ABSENT",
    "FINGERPRINT_KEY",
    "RESUMABLE_KEYS",
    "RUN_FILE",
    "RUN_ID_KEY",
    "RunFolderError",
    "RunManifest",
    "RunPlan",
    "RunResume",
    "SelectedCheckpoint",
    "checkpoint_extra",
    "config_differences",
    "config_fingerprint",
    "is_resumable",
    "prepare_run_folder",
    "read_run_manifest",
    "select_checkpoint",
    "write_run_manifest",
]

RUN_FILE = "run.json"
RUN_FORMAT = 2
# Format 2 (rl-launch's rollout correction became `algo.policy.correction` and its options): a
# format-1 run.json is read with its configuration's former keys rewritten
# (`rl_launch.former.migrate_former_keys`), its fingerprint kept in `earlier_fingerprints`.
_READABLE_FORMATS = (1, 2)
# Keys of TrainingState.extra that tie a checkpoint to the run that wrote it.
RUN_ID_KEY = "run_id"
FINGERPRINT_KEY = "config_fingerprint"
# Files whose presence means that a run used the folder (the checkpoints are checked separately).
_RUN_OUTPUTS = (RUN_FILE, "metrics.jsonl", "config.yaml")
_STATE_FILE = "training_state.json"  # rl_learner.checkpoint.STATE_NAME; read here as plain JSON

# Dotted keys, or section prefixes (`log` covers `log.*`), that may differ between the run that wrote
# a checkpoint and the run that resumes it. The rule: a key may change when it shapes neither the
# state a checkpoint holds (weights, optimizer and scheduler state, data position, RNG streams) nor
# what that state means. Everything else is compared, including keys added by later versions (an
# unlisted key is never resumable: refusing a harmless change costs a rerun, accepting a harmful one
# costs a silently wrong run).
RESUMABLE_KEYS: tuple[str, ...] = (
    # preset: no, it chooses model, data and reward. preset_root is only where the build is cached.
    "preset_root",
    # model.*: no (weights, precision, LoRA shape are the checkpoint's content), except activation
    # recomputation: same math, less memory; the knob to turn when a resume runs out of memory.
    "model.gradient_checkpointing",
    # data.*: no, the saved loader position indexes this exact prompt list. Evaluation prompts
    # never feed training.
    "data.eval_dataset",
    "data.eval_max_samples",
    # rollout.*: sampling and batching are part of the algorithm. Engines hold no state (the policy's
    # weights are synced to them at start), so how many run and how they use their devices may change.
    "rollout.num_engines",
    "rollout.weight_sync",
    "rollout.tensor_parallel_size",
    "rollout.gpu_memory_utilization",
    "rollout.max_num_seqs",
    "rollout.enforce_eager",
    # reward.*: no, the function or server defines the objective; how its requests are sent and
    # authorised (batching, retries, timeout, which variable holds the header) does not.
    "reward.timeout_s",
    "reward.batch_size",
    "reward.retries",
    "reward.headers_env",
    # algo.*: never, it is the algorithm.
    # train.*: only the length. The LR schedule spans train.max_steps, so a resume that changes it
    # continues on the schedule of the new length (OpenRLHF does the same).
    "train.max_steps",
    "train.num_episodes",
    # ray.*: where the cluster is and how generous it is. Not ray.policy / ray.critic (their
    # num_actors is the data-parallel size the ZeRO optimizer state was partitioned for), nor
    # ray.ref / ray.teacher / ray.reward_model / ray.colocate (the actor layout is kept as one decision).
    # A caveat on ray.device: with model.dtype auto the device also picks the precision (bf16 on GPUs,
    # fp32 on CPU), and no comparison of configurations sees that when it stays "auto" on a cluster
    # with other devices; only the resolved precision, recorded by the driver, would.
    "ray.address",
    "ray.temp_dir",
    "ray.num_cpus",
    "ray.startup_timeout_s",
    "ray.engine_num_cpus",
    "ray.device",
    # Where a frozen model's parameters wait between uses: memory, not content.
    "ray.ref.offload",
    "ray.teacher.offload",
    "ray.reward_model.offload",
    # ckpt.*: how often and how many to keep, and the resume switch itself. Not ckpt.path: a typo there
    # would restart a run at step 0 over its own metrics.
    "ckpt.save_steps",
    "ckpt.save_minutes",
    "ckpt.max_ckpt_num",
    "ckpt.save_hf_model",
    "ckpt.hf_output_dir",
    "ckpt.load_checkpoint",
    # Which checkpoint is also kept; under a new key the best is searched for again from the resume.
    "ckpt.best_metric_key",
    "ckpt.preemption_timeout_s",
    # eval.*: evaluation never feeds training, and training's sampling seeds derive from rollout.seed
    # and the step, not from a stream that evaluation advances.
    "eval",
    # log.*: outputs only; the run folder itself may move (log.output_dir).
    "log",
    # health.*: when the run warns or stops; nothing it trains on.
    "health",
)


class _Absent:
    """The value of a key that one of two configurations lacks."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT: Any = _Absent()
"""Sentinel in `config_differences` for a key present in only one of the configurations."""


class RunFolderError(ValueError):
    """A run folder cannot be used as asked; the message names the folder, what it holds and the ways out."""


# ----------------------------------------------------------------------------------------------
# Configurations


def is_resumable(key: str) -> bool:
    """Whether the dotted `key` may change on resume: listed in `RESUMABLE_KEYS` or under a listed prefix."""
    return any(key == entry or key.startswith(entry + ".") for entry in RESUMABLE_KEYS)


def _leaves(config: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, value) of every non-dict value.

    An empty dict has no leaves: `algo.policy.options: {}` and no such key both mean "no options",
    and `{}` -> `{"epsilon_high": 0.28}` reads as the one option that was added.
    """
    for key, value in config.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            yield from _leaves(value, path)
        else:
            yield path, value


def _canonical(value: Any) -> str:
    # Compared as canonical JSON, not with ==: 1 and 1.0, or True and 1, are equal in Python but are
    # different configurations (and differ in the fingerprint); a tuple equals the list it is saved as.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _check_config(name: str, config: Any) -> None:
    if not isinstance(config, Mapping):
        raise TypeError(
            f"{name}: expected a nested dict (msgspec.to_builtins(config)), got {type(config).__name__}"
        )


def _all_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    old = {".".join(path): value for path, value in _leaves(saved)}
    new = {".".join(path): value for path, value in _leaves(current)}
    differences = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, ABSENT), new.get(key, ABSENT)
        if before is ABSENT or after is ABSENT or _canonical(before) != _canonical(after):
            differences.append((key, before, after))
    return differences


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The leaves outside `RESUMABLE_KEYS` where two configurations differ, sorted by key.

    Args:
        saved: the configuration of the run that wrote the checkpoint, as a nested dict.
        current: the configuration of the run that would resume it.

    Returns:
        `(dotted key, saved value, current value)` per differing leaf; a key present in only one
        of them is a difference, with `ABSENT` on the other side. Values are compared by their
        canonical JSON, so 1 and 1.0 differ (so do their fingerprints) and a tuple equals its list.
    """
    _check_config("saved", saved)
    _check_config("current", current)
    return [item for item in _all_differences(saved, current) if not is_resumable(item[0])]


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of `config`'s leaves outside `RESUMABLE_KEYS`.

    Two configurations have the same fingerprint exactly when `config_differences` finds nothing
    between them: both are computed from the same leaves. The fingerprint therefore changes when
    a later rl-launch adds a configuration key or changes `RESUMABLE_KEYS`, and checkpoints of
    earlier versions are then refused (explicitly, never loaded under a changed meaning).
    """
    _check_config("config", config)
    leaves = sorted(
        ([list(path), value] for path, value in _leaves(config) if not is_resumable(".".join(path))),
        key=lambda item: _canonical(item[0]),
    )
    return hashlib.sha256(_canonical(leaves).encode()).hexdigest()


def _format_differences(differences: Sequence[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {key}: {before!r} -> {after!r}" for key, before, after in differences)


# ----------------------------------------------------------------------------------------------
# The run manifest


class RunResume(msgspec.Struct, kw_only=True):
    """One resume of a run: when, by which rl-launch, from which step, with which resumable changes.

    `changed` maps a dotted key to `[old, new]`; a key absent on one side is written as null.
    """

    time: str
    version: str
    step: int
    changed: dict[str, list[Any]] = msgspec.field(default_factory=dict)


class RunManifest(msgspec.Struct, kw_only=True):
    """`<output_dir>/run.json`: the identity of the run that owns the folder.

    Fields:
        run_id:      uuid4 hex, written into every checkpoint the run saves.
        created:     ISO 8601 time (UTC) of the first start.
        version:     rl-launch version of the last start.
        fingerprint: `config_fingerprint(config)`.
        config:      the configuration of the last start, a nested dict.
        resumes:     one `RunResume` per resume, oldest first.
        format:      the layout of this file (`RUN_FORMAT`; an older one as read, until rewritten).
        earlier_fingerprints: fingerprints this configuration had under earlier formats; a
                     checkpoint carrying one of them was written by this run under its old names.
    """

    run_id: str
    created: str
    version: str
    fingerprint: str
    config: dict[str, Any]
    resumes: list[RunResume] = msgspec.field(default_factory=list)
    format: int = RUN_FORMAT
    earlier_fingerprints: list[str] = msgspec.field(default_factory=list)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _fsync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse directory fsync
        pass
    finally:
        os.close(fd)


def write_run_manifest(output_dir: str | os.PathLike[str], manifest: RunManifest, *, exclusive: bool) -> Path:
    """Write `<output_dir>/run.json` atomically (temporary sibling, fsync, rename); its path.

    With `exclusive`, fail with `RunFolderError` if the file exists, also when another process
    creates it at the same moment (the file is hard-linked into place, which never replaces), so
    that of two runs started together in one folder exactly one gets it. Without, replace it.
    """
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RUN_FILE
    temporary = folder / f".{RUN_FILE}.{os.getpid()}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    try:
        if not exclusive:
            os.replace(temporary, path)
        else:
            try:
                os.link(temporary, path)
            except FileExistsError:
                raise RunFolderError(
                    f"{path.resolve()} appeared while this run was starting: another run is starting "
                    "in the same folder; use another --log.output_dir"
                ) from None
            except OSError:  # no hard links on this file system: check, then rename
                if path.exists():
                    raise RunFolderError(
                        f"{path.resolve()} appeared while this run was starting: another run is "
                        "starting in the same folder; use another --log.output_dir"
                    ) from None
                os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(folder)
    return path


def read_run_manifest(output_dir: str | os.PathLike[str]) -> RunManifest | None:
    """The run manifest of `output_dir`, or None if it has no `run.json`.

    Raises `RunFolderError` naming the file when it is not valid JSON or lacks a field.
    """
    path = Path(output_dir) / RUN_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        manifest = msgspec.json.decode(data, type=RunManifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise RunFolderError(
            f"{path.resolve()} is not a valid run manifest ({error}); it identifies the run that owns "
            f"{path.parent.resolve()}: restore it, or use another --log.output_dir"
        ) from None
    if manifest.format not in _READABLE_FORMATS:
        raise RunFolderError(
            f"{path.resolve()} has format {manifest.format}; this rl-launch ({__version__}) reads formats "
            f"{', '.join(map(str, _READABLE_FORMATS))}: continue the run with the rl-launch version "
            f"{manifest.version} that wrote it"
        )
    if manifest.format == 1:
        from .former import migrate_former_keys

        try:
            config, _ = migrate_former_keys(manifest.config)
        except ValueError as error:
            raise RunFolderError(f"{path.resolve()} (format 1): {error}") from None
        manifest = msgspec.structs.replace(
            manifest,
            config=config,
            fingerprint=config_fingerprint(config),
            earlier_fingerprints=[*manifest.earlier_fingerprints, manifest.fingerprint],
        )
    return manifest


# ----------------------------------------------------------------------------------------------
# Checkpoints


@dataclasses.dataclass(frozen=True)
class SelectedCheckpoint:
    """The newest step with a complete checkpoint of every role, and each role's checkpoint folder.

    Load a role's checkpoint with `rl_learner.load_checkpoint(folder.parent, engines, tag=folder.name)`.
    """

    step: int
    folders: dict[str, Path]


class _SavedState(msgspec.Struct):
    # The part of rl_learner.TrainingState read here; other fields are ignored.
    step: int
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


_LOADS_ONLY_OWN = (
    "a run loads only checkpoints it wrote itself, because DeepSpeed checkpoints are pickles that "
    "can run code when loaded"
)


def _loads_only_own(folder: Path) -> str:
    return (
        f"{_LOADS_ONLY_OWN}. Move {folder} aside, point --ckpt.path at this run's "
        "checkpoints, or start a new run in another --log.output_dir"
    )


def _check_identity(folder: Path, *, run_id: str, fingerprint: str, earlier: Sequence[str] = ()) -> None:
    """Refuse checkpoint `folder` unless its training_state.json names this run and configuration."""
    state_file = folder / _STATE_FILE
    try:
        state = msgspec.json.decode(state_file.read_bytes(), type=_SavedState)
    except FileNotFoundError:
        raise RunFolderError(
            f"checkpoint {folder} has no {_STATE_FILE}, so nothing says which run wrote it; "
            + _loads_only_own(folder)
        ) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise RunFolderError(
            f"checkpoint {folder}: {_STATE_FILE} is unreadable ({error}); " + _loads_only_own(folder)
        ) from None
    written_by = state.extra.get(RUN_ID_KEY)
    written_with = state.extra.get(FINGERPRINT_KEY)
    if written_by is None or written_with is None:
        raise RunFolderError(
            f"checkpoint {folder} does not name the run that wrote it ({_STATE_FILE} has no "
            f"extra.{RUN_ID_KEY} / extra.{FINGERPRINT_KEY}: another program or an rl-launch before "
            "run identities wrote it); " + _loads_only_own(folder)
        )
    if written_by != run_id:
        raise RunFolderError(
            f"checkpoint {folder} was written by run {written_by}, not by this run {run_id}; "
            + _loads_only_own(folder)
        )
    if written_with != fingerprint and written_with not in earlier:
        raise RunFolderError(
            f"checkpoint {folder} was written by this run {run_id} under another configuration "
            f"(fingerprint {str(written_with)[:12]}, now {fingerprint[:12]}): {RUN_FILE} was edited, "
            "or this rl-launch version compares configurations differently; it cannot be loaded, "
            "start a new run in another --log.output_dir"
        )


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints in `root`, oldest save first."""
    from rl_learner import list_checkpoints  # reads JSON manifests only; no engine, no torch.load

    return [(info.step, Path(info.path)) for info in list_checkpoints(root)]


def select_checkpoint(
    ckpt_root: str | os.PathLike[str],
    roles: Sequence[str],
    *,
    run_id: str,
    fingerprint: str,
    earlier_fingerprints: Sequence[str] = (),
) -> SelectedCheckpoint | None:
    """The newest step complete for every role in `ckpt_root/<role>/`, checked to belong to this run.

    Every complete checkpoint of every role is checked, not only the chosen one: its
    `training_state.json` (read as JSON, no engine is touched) must carry `extra.run_id == run_id`
    and `extra.config_fingerprint == fingerprint`. A folder that mixes in another run's
    checkpoints is refused as a whole.

    Args:
        ckpt_root: the checkpoint folder (`ckpt.path`, default `<output_dir>/checkpoints`).
        roles: the trained roles, each checkpointed in its own root, e.g. ["policy", "critic"].
        run_id, fingerprint: this run's, from `run.json` and `config_fingerprint`.
        earlier_fingerprints: the same configuration's fingerprints under earlier run formats
            (`RunManifest.earlier_fingerprints`), also accepted.

    Returns:
        The step and each role's checkpoint folder; None when no role has a complete checkpoint.

    Raises:
        RunFolderError: a checkpoint without a run id, from another run or under another
            configuration (naming its folder), or checkpoints with no step common to all roles.
    """
    if not roles:
        raise ValueError("roles: expected at least one trained role, e.g. ['policy']")
    root = Path(ckpt_root).absolute()
    found: dict[str, dict[int, Path]] = {}
    for role in roles:
        found[role] = {}
        for step, folder in _complete_checkpoints(root / role):
            _check_identity(folder, run_id=run_id, fingerprint=fingerprint, earlier=earlier_fingerprints)
            found[role][step] = folder  # a step saved twice: the newest save wins
    if not any(found.values()):
        return None
    common = set.intersection(*(set(checkpoints) for checkpoints in found.values()))
    if not common:
        held = "; ".join(
            f"{role}: {', '.join(map(str, sorted(steps))) or 'none'}" for role, steps in found.items()
        )
        raise RunFolderError(
            f"checkpoints in {root}: no step has a complete checkpoint of every role ({held}), "
            "so the run cannot continue from any of them; start a new run in another --log.output_dir"
        )
    step = max(common)
    return SelectedCheckpoint(step=step, folders={role: found[role][step] for role in roles})


# ----------------------------------------------------------------------------------------------
# The decision


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What the driver does with the run folder, from `prepare_run_folder`.

    Fields:
        run_id, fingerprint: this run's identity; `checkpoint_extra(plan)` puts both into every
            checkpoint it saves.
        output_dir, ckpt_root: absolute paths.
        resume: True when checkpoints are to be loaded (then `step > 0` or a step-0 checkpoint).
        step: the step training continues after (0 for a run that starts from the beginning).
        checkpoints: role -> checkpoint folder to load; empty unless `resume`.
        changes: resumable keys whose value differs from the previous start, `(key, old, new)`.
        message: one line for the console, e.g. "resuming run 3f2a9c1d from step 4: /abs/checkpoints".
    """

    run_id: str
    fingerprint: str
    output_dir: Path
    ckpt_root: Path
    resume: bool
    step: int
    checkpoints: dict[str, Path]
    changes: list[tuple[str, Any, Any]]
    message: str


def _last_logged_step(path: Path) -> int | None:
    """The step of the last readable line of a metrics file (a torn last line is skipped)."""
    last = None
    try:
        with open(path, "rb") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    last = record["step"]
    except OSError:
        return None
    return last


def _has_files(folder: Path) -> bool:
    return folder.is_dir() and any(files for _, _, files in os.walk(folder))


def _folder_contents(output_dir: Path, ckpt_root: Path, manifest: RunManifest | None) -> list[str]:
    """What in the folder shows that a run used it, in words; empty when nothing does."""
    held = []
    for name in _RUN_OUTPUTS:
        path = output_dir / name
        if not path.is_file():
            continue
        if name == RUN_FILE and manifest is not None:
            held.append(f"{name} (run {manifest.run_id[:8]}, created {manifest.created})")
        elif name == "metrics.jsonl":
            step = _last_logged_step(path)
            held.append(f"{name} ({'no steps' if step is None else f'last step {step}'})")
        else:
            held.append(name)
    if _has_files(ckpt_root):
        steps = []
        if ckpt_root.is_dir():
            for role_root in sorted(p for p in ckpt_root.iterdir() if p.is_dir()):
                complete = _complete_checkpoints(role_root)
                if complete:
                    steps.append(f"{role_root.name} at step {max(step for step, _ in complete)}")
        where = "checkpoints" if ckpt_root == output_dir / "checkpoints" else f"checkpoints in {ckpt_root}"
        held.append(f"{where} ({', '.join(steps) or 'no complete one'})")
    return held


def _max_steps(config: Mapping[str, Any]) -> int | None:
    """`train.max_steps` where the configuration has it (this module does not require it)."""
    train = config.get("train")
    value = train.get("max_steps") if isinstance(train, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prepare_run_folder(
    output_dir: str | os.PathLike[str],
    config: Mapping[str, Any],
    *,
    resume: bool,
    ckpt_root: str | os.PathLike[str],
    roles: Sequence[str],
) -> RunPlan:
    """Decide how a run uses its folder, check it, write `run.json`; the one decision point.

    Call before anything slow starts (Ray, engines). Nothing is written unless the run may go on.

    Fresh run (`resume=False`): the folder must not hold a run (`run.json`, `metrics.jsonl`,
    `config.yaml`, or any file under `ckpt_root`); otherwise `RunFolderError` names the folder,
    what it holds and the two ways out (`--ckpt.load_checkpoint true`, another `--log.output_dir`).
    A missing or empty folder gets a new `run.json`.

    Resume (`resume=True`):
    - no `run.json` and nothing else of a run: starts fresh as above (the plan says so);
    - no `run.json` but outputs or checkpoints of a run: refused, nothing ties them to a run;
    - `run.json`: its configuration must equal `config` outside `RESUMABLE_KEYS` (else
      `RunFolderError` listing every differing key, old -> new); the checkpoints are chosen by
      `select_checkpoint` (only this run's); a checkpoint at or beyond `train.max_steps` is
      refused (there would be nothing to train). `run.json` keeps `run_id` and `created`, takes
      the new configuration and gets a `resumes` entry. Without any checkpoint the run starts
      again at step 0 under the same id.

    Args:
        output_dir: the run folder (`log.output_dir`).
        config: the run's configuration as a nested dict (`msgspec.to_builtins(config)`).
        resume: `ckpt.load_checkpoint`.
        ckpt_root: the checkpoint folder (`ckpt.path`, or `<output_dir>/checkpoints`).
        roles: the roles whose checkpoints are loaded, e.g. ["policy", "critic"].
    """
    _check_config("config", config)
    output_dir = Path(output_dir).absolute()
    ckpt_root = Path(ckpt_root).absolute()
    config = msgspec.json.decode(msgspec.json.encode(config))  # a plain copy, as run.json will hold it
    fingerprint = config_fingerprint(config)
    manifest = read_run_manifest(output_dir)
    held = _folder_contents(output_dir, ckpt_root, manifest)

    def start_fresh(message: str) -> RunPlan:
        run_id = _new_run(output_dir, config, fingerprint)
        return RunPlan(
            run_id=run_id,
            fingerprint=fingerprint,
            output_dir=output_dir,
            ckpt_root=ckpt_root,
            resume=False,
            step=0,
            checkpoints={},
            changes=[],
            message=message,
        )

    if not resume:
        if held:
            raise RunFolderError(
                f"{output_dir} already holds a run: {'; '.join(held)}. A new run never overwrites "
                "one. To continue that run, pass --ckpt.load_checkpoint true; to start a new run, "
                "pass another --log.output_dir"
            )
        return start_fresh(f"new run in {output_dir}")

    if manifest is None:
        if held:
            raise RunFolderError(
                f"cannot resume in {output_dir}: it holds {'; '.join(held)}, but no {RUN_FILE}, so "
                "nothing ties them to a run (an rl-launch before run identities, or a deleted "
                f"{RUN_FILE}), and {_LOADS_ONLY_OWN}. Move them aside to start a new run here, or "
                "start it in another --log.output_dir"
            )
        return start_fresh(f"no checkpoint in {ckpt_root}: starting at step 0")
    return _resume_run(output_dir, ckpt_root, config, fingerprint, manifest, roles)


def _resume_run(
    output_dir: Path,
    ckpt_root: Path,
    config: dict[str, Any],
    fingerprint: str,
    manifest: RunManifest,
    roles: Sequence[str],
) -> RunPlan:
    """`prepare_run_folder`'s resume of the run `manifest` describes: the configuration checked
    against it, the checkpoint chosen, `run.json` rewritten with a `resumes` entry."""
    differences = config_differences(manifest.config, config)
    if differences:
        raise RunFolderError(
            f"cannot resume the run in {output_dir}: its configuration ({output_dir / RUN_FILE}) differs "
            f"in keys a resumed run must keep:\n{_format_differences(differences)}\n"
            "A changed algorithm, model, data or learner layout is a new run: pass another "
            "--log.output_dir (or restore these values to continue this run). Keys that may change "
            f"on resume: {', '.join(RESUMABLE_KEYS)}"
        )
    selected = select_checkpoint(
        ckpt_root,
        roles,
        run_id=manifest.run_id,
        fingerprint=fingerprint,
        earlier_fingerprints=manifest.earlier_fingerprints,
    )
    step = 0 if selected is None else selected.step
    max_steps = _max_steps(config)
    if selected is not None and max_steps is not None and step >= max_steps:
        raise RunFolderError(
            f"the run in {output_dir} has a checkpoint at step {step} and train.max_steps is "
            f"{max_steps}: there is nothing to train. To train it further, pass a larger "
            "--train.max_steps; to start a new run, pass another --log.output_dir"
        )

    changes = [item for item in _all_differences(manifest.config, config) if is_resumable(item[0])]
    resumes = [
        *manifest.resumes,
        RunResume(
            time=_now(),
            version=__version__,
            step=step,
            changed={key: [_json_value(old), _json_value(new)] for key, old, new in changes},
        ),
    ]
    write_run_manifest(
        output_dir,
        msgspec.structs.replace(
            manifest,
            version=__version__,
            fingerprint=fingerprint,
            config=config,
            resumes=resumes,
            format=RUN_FORMAT,
        ),
        exclusive=False,
    )
    if selected is None:
        message = f"no checkpoint in {ckpt_root}: starting run {manifest.run_id[:8]} again at step 0"
        checkpoints: dict[str, Path] = {}
    else:
        message = f"resuming run {manifest.run_id[:8]} from step {step}: {ckpt_root}"
        checkpoints = selected.folders
    if manifest.format != RUN_FORMAT:
        message += (
            f" ({RUN_FILE} of format {manifest.format} read with its former option names, "
            f"rewritten as format {RUN_FORMAT})"
        )
    return RunPlan(
        run_id=manifest.run_id,
        fingerprint=fingerprint,
        output_dir=output_dir,
        ckpt_root=ckpt_root,
        resume=selected is not None,
        step=step,
        checkpoints=checkpoints,
        changes=changes,
        message=message,
    )


def _json_value(value: Any) -> Any:
    return None if value is ABSENT else value


def _new_run(output_dir: Path, config: dict[str, Any], fingerprint: str) -> str:
    manifest = RunManifest(
        run_id=uuid.uuid4().hex, created=_now(), version=__version__, fingerprint=fingerprint, config=config
    )
    write_run_manifest(output_dir, manifest, exclusive=True)
    return manifest.run_id


def checkpoint_extra(plan: RunPlan) -> dict[str, str]:
    """What the driver merges into `TrainingState.extra` on every save: the run id and fingerprint.

    `select_checkpoint` refuses checkpoints without them, so a run that saves without this
    cannot be resumed.
    """
    return {RUN_ID_KEY: plan.run_id, FINGERPRINT_KEY: plan.fingerprint}


def open_run_folder(config: Any, *, roles: Sequence[str], say: Any) -> RunPlan:
    """`prepare_run_folder` for a command's config (`log.output_dir`, `ckpt.path` or
    `<output_dir>/checkpoints`, `ckpt.load_checkpoint`); `say`s the plan's line and writes the
    resolved config to `<output_dir>/config.yaml`. What `rl-launch ppo` and the trainers share."""
    from .options import dump_config

    output_dir = Path(config.log.output_dir)
    plan = prepare_run_folder(
        output_dir,
        msgspec.to_builtins(config),
        resume=config.ckpt.load_checkpoint,
        ckpt_root=Path(config.ckpt.path or output_dir / "checkpoints"),
        roles=roles,
    )
    say(plan.message)
    (output_dir / "config.yaml").write_text(dump_config(config))
    return plan
