"""Checkpoints of RL training: DeepSpeed engines plus training state, written atomically; HF export.

A checkpoint holds everything a run needs to continue as if it had never stopped: every
DeepSpeed engine's model, optimizer and LR-scheduler state (`engine.save_checkpoint`), the
training position (`TrainingState`: step, consumed samples, policy version, the data loader's
state) and each rank's RNG states (Python `random`, NumPy's global generator, torch CPU and
CUDA). On CPU in fp32, a run resumed from a checkpoint reproduces the losses and weights of an
uninterrupted run bit for bit.

Layout of a checkpoint root:

    root/
      latest                        the tag of the last complete checkpoint (one line)
      step_00000004/                a complete checkpoint; its folder name is its tag
        manifest.json               written last: every other file with its size and SHA-256
        training_state.json         TrainingState (msgspec JSON)
        rng/rank_00000.json         RNG states of rank 0 (one file per rank)
        policy/...                  engines["policy"].save_checkpoint(folder, tag="policy")
        critic/...
        tensors/ema.safetensors     optional named tensor sets (`tensors=`), written by rank 0
      .tmp-step_00000006/           a save in progress, or one that crashed: never loaded

Saving (every rank calls `save_checkpoint`): all ranks write into `.tmp-<tag>`; after a
barrier each rank hashes a share of the files (file i goes to rank i mod world_size) on a pool
of threads while one thread fsyncs them; rank 0 merges the shares into `manifest.json`, fsyncs,
renames the folder to `<tag>` with `os.replace` (atomic on POSIX), replaces the `latest` pointer
atomically, and deletes the oldest complete checkpoints beyond `keep_last` (except those named in
`keep_tags`: a best checkpoint) plus the leftovers of crashed saves.
A crash at any point leaves the previous complete checkpoint and `latest` intact. All ranks
must see the same folder (a shared file system on several nodes).

Loading (`load_checkpoint`) checks the manifest before it touches any engine: a missing
manifest (a partial checkpoint), a missing file, a size or a checksum that differs all raise
`CheckpointError`, naming the folder, the file and the previous complete checkpoint to fall
back to. Checksums are split over the ranks like on saving (and hashed on a pool of threads), and
the first failure reaches every rank, so that all of them raise together instead of hanging in a
collective.

World size on resume: DeepSpeed cannot re-partition ZeRO optimizer states (stages 1-3) for a
different data-parallel size, so such a resume raises `CheckpointError` before any engine is
touched (convert the checkpoint with DeepSpeed's `ds_to_universal` and load it with a
universal-checkpoint config, or restart from `export_hf` weights with a fresh optimizer).
Stage-0 engines keep the full optimizer state on rank 0 and load at any world size; RNG
states are then restored only for ranks that existed when saving (the random streams of a
differently sharded run differ anyway).

DeepSpeed writes its files with `torch.save`, and `engine.load_checkpoint` reads them with
`torch.load(weights_only=False)`: load only checkpoints you wrote (the manifest checksums
detect corruption, not forgery). Everything this module writes itself is JSON.

`export_hf` writes a folder that `AutoModelForCausalLM` / `AutoModelForSequenceClassification`
load (safetensors, config, generation config, tokenizer), from a plain model, a DeepSpeed engine
in any ZeRO stage (ZeRO-3 parameters are gathered, rank 0 writes) or a peft LoRA or DoRA model
(the merged weights are computed on copies by `rl_learner.lora.merged_tensors`, as weight sync
does; the live adapters are left untouched).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from .dtensor import full_value, is_dtensor
from .lora import merged_tensors

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CheckpointInfo",
    "Manifest",
    "ManifestFile",
    "TrainingState",
    "checkpoint_tag",
    "export_hf",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_checkpoint_tensors",
    "save_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2
# 1: every file's checksum is the SHA-256 of the whole file; 2 adds block digests (`ManifestFile`)
READABLE_FORMATS = (1, 2)
MANIFEST_NAME = "manifest.json"
STATE_NAME = "training_state.json"
LATEST_NAME = "latest"
RNG_FOLDER = "rng"
TENSORS_FOLDER = "tensors"
TMP_PREFIX = ".tmp-"
# Folders of earlier saves on their way out (rotation, a tag saved twice); always safe to delete.
TRASH_PREFIX = ".trash-"
_PARTS_FOLDER = ".manifest-parts"
_TAG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RESERVED_TAGS = frozenset({LATEST_NAME, RNG_FOLDER, TENSORS_FOLDER, MANIFEST_NAME, STATE_NAME})
_HASH_CHUNK = 1 << 22
# Files above this size get a block digest (`ManifestFile.block_bytes`), hashed block by block on
# a pool of threads: the SHA-256 of one 6 GB optimizer file takes 3-6 s on one core.
_BLOCK_BYTES = 1 << 26


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (partial, corrupt, incompatible) or a failed save.

    The message names the folder, the file and what is wrong, and, where one exists, the previous
    complete checkpoint (`previous`, a tag for `load_checkpoint(root, engines, tag=...)`).
    """

    def __init__(self, message: str, *, folder: Path | None = None, previous: str | None = None) -> None:
        self.folder, self.previous = folder, previous
        super().__init__(message)


class TrainingState(msgspec.Struct, kw_only=True):
    """Where training stands, saved next to the engines' state.

    Fields:
        step:             optimizer steps (or training iterations) done, >= 0.
        consumed_samples: prompts (or samples) consumed so far, >= 0.
        policy_version:   version of the weights the rollout engines hold, >= 0.
        data_state:       the data loader's position, JSON-able, e.g.
                          `msgspec.to_builtins(PromptLoader.state_dict())`; a msgspec Struct
                          is converted on save. Loads back as plain dicts and lists.
        extra:            anything else JSON-able (KL controller's beta, best reward...).
    """

    step: int
    consumed_samples: int = 0
    policy_version: int = 0
    data_state: dict[str, Any] = msgspec.field(default_factory=dict)
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class ManifestFile(msgspec.Struct, frozen=True):
    """One file of a checkpoint: path relative to the checkpoint folder, bytes, checksum (hex).

    `block_bytes` 0: `sha256` is the SHA-256 of the file. `block_bytes` B > 0 (files above 64 MiB):
    `sha256` = SHA-256(SHA-256(block 0) ‖ SHA-256(block 1) ‖ …) over the raw 32-byte digests of
    the file's consecutive B-byte blocks (the last one shorter), so that the blocks hash in
    parallel. Format-1 manifests have no `block_bytes` (read as 0).
    """

    path: str
    size: int
    sha256: str
    block_bytes: int = 0


class EngineInfo(msgspec.Struct, frozen=True):
    """How one engine was sharded when saved."""

    zero_stage: int
    dp_world_size: int


class Manifest(msgspec.Struct, kw_only=True):
    """The table of contents of a complete checkpoint; written last, so its presence means complete.

    `sequence` counts saves into the root (1, 2, ...): rotation keeps the highest ones, so a
    run that went back to an older step and saved again keeps its newest saves.
    """

    format: int
    tag: str
    step: int
    sequence: int
    saved_at: float
    world_size: int
    engines: dict[str, EngineInfo]
    files: list[ManifestFile]


class CheckpointInfo(msgspec.Struct, frozen=True):
    """A complete checkpoint found in a root (see `list_checkpoints`)."""

    tag: str
    path: str
    step: int
    sequence: int
    saved_at: float


class _NumpyRng(msgspec.Struct):
    kind: str
    keys: list[int]
    position: int
    has_gauss: int
    cached_gaussian: float


class _RngState(msgspec.Struct, kw_only=True):
    python_version: int
    python_state: list[int]
    python_gauss: float | None
    numpy: _NumpyRng
    torch_cpu: bytes
    cuda: list[bytes] = msgspec.field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# Ranks


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _distributed() else 0


def _world_size() -> int:
    return torch.distributed.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        torch.distributed.barrier()


def _any_rank_failed(failed: bool) -> bool:
    """True on every rank when `failed` is True on at least one (a collective: call on all ranks)."""
    if not _distributed():
        return failed
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":
        flag = flag.cuda()
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _min_over_ranks(value: int) -> int:
    if not _distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":
        tensor = tensor.cuda()
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return int(tensor.item())


# ----------------------------------------------------------------------------------------------
# Files


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _block_sha256(path: Path, start: int, length: int) -> bytes:
    """The raw SHA-256 of `length` bytes of `path` from `start` (hashlib and os.pread release the
    GIL, so blocks hash in parallel on threads)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = start + length
        while start < end:
            chunk = os.pread(fd, min(_HASH_CHUNK, end - start), start)
            if not chunk:  # the file shrank under us: the digest then differs
                break
            digest.update(chunk)
            start += len(chunk)
    finally:
        os.close(fd)
    return digest.digest()


def _block_bytes(size: int) -> int:
    """`ManifestFile.block_bytes` for a file of `size` bytes: block digests above 64 MiB."""
    return _BLOCK_BYTES if size > _BLOCK_BYTES else 0


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for hashing: one per core (at most 16) and one more for the fsyncs."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=min(16, os.cpu_count() or 1) + 1, thread_name_prefix="rl-checkpoint-hash"
    )


def _digests(
    pool: concurrent.futures.Executor, paths: list[Path], block_bytes: list[int]
) -> list[Callable[[], str]]:
    """Each file's checksum (`ManifestFile.sha256`) for its `block_bytes` (0: the whole file's
    SHA-256), as a call that waits for it; every block of every file is submitted to `pool` here."""
    digests: list[Callable[[], str]] = []
    for path, block in zip(paths, block_bytes, strict=True):
        if block == 0:
            digests.append(pool.submit(_sha256, path).result)
            continue
        size = path.stat().st_size
        blocks = [pool.submit(_block_sha256, path, start, block) for start in range(0, size, block)]
        digests.append(lambda blocks=blocks: hashlib.sha256(b"".join(f.result() for f in blocks)).hexdigest())
    return digests


def _seal(folder: Path, relatives: list[str]) -> list[ManifestFile]:
    """fsync and checksum the files `relatives` of `folder`: one thread fsyncs them in turn
    (the disk's write-back) while the others hash them (CPU), so a save pays about the longer
    of the two rather than their sum."""
    paths = [folder / relative for relative in relatives]
    sizes = [path.stat().st_size for path in paths]
    blocks = [_block_bytes(size) for size in sizes]
    with _hash_pool() as pool:
        synced = pool.submit(lambda: [_fsync_file(path) for path in paths])
        digests = _digests(pool, paths, blocks)
        synced.result()
        return [
            ManifestFile(path=relative, size=size, sha256=digest(), block_bytes=block)
            for relative, size, digest, block in zip(relatives, sizes, digests, blocks, strict=True)
        ]


def _fsync_file(path: Path) -> None:
    # fsync through a read-only descriptor flushes the file's dirty pages too (Linux, macOS).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems (and Windows) refuse directory fsync
        _fsync_file(path)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary sibling, fsync, rename."""
    temporary = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _relative_files(folder: Path) -> list[str]:
    """Every regular file under `folder`, as sorted POSIX paths relative to it."""
    files = []
    for directory, _, names in os.walk(folder):
        for name in names:
            files.append((Path(directory) / name).relative_to(folder).as_posix())
    return sorted(files)


def _remove_tree(path: Path) -> None:
    """Delete a folder: first renamed aside (so a crash never leaves a half-deleted checkpoint)."""
    if not path.exists():
        return
    if not path.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
        aside = path.with_name(f"{TRASH_PREFIX}{path.name}.{os.getpid()}")
        os.replace(path, aside)
        path = aside
    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Tags, listing, resolving


def checkpoint_tag(step_or_tag: int | str) -> str:
    """The folder name of a checkpoint: `step_00000042` for step 42, or a given tag checked as is.

    Tags are `[A-Za-z0-9][A-Za-z0-9._-]*` (no leading dot: those names are reserved for the
    folders of saves in progress) and not one of the file names a checkpoint uses.
    """
    if isinstance(step_or_tag, bool):
        raise TypeError(f"step_or_tag: expected an int step or a str tag, got {step_or_tag!r}")
    if isinstance(step_or_tag, (int, np.integer)):
        if step_or_tag < 0:
            raise ValueError(f"step_or_tag: step must be >= 0, got {step_or_tag}")
        return f"step_{int(step_or_tag):08d}"
    if not isinstance(step_or_tag, str):
        raise TypeError(f"step_or_tag: expected an int step or a str tag, got {type(step_or_tag).__name__}")
    if not _TAG_PATTERN.fullmatch(step_or_tag) or step_or_tag in _RESERVED_TAGS:
        raise ValueError(
            f"step_or_tag: {step_or_tag!r} is not a valid tag; use letters, digits, '.', '_', '-', "
            f"starting with a letter or digit, and none of {sorted(_RESERVED_TAGS)}"
        )
    return step_or_tag


def _read_manifest(folder: Path) -> Manifest:
    """The manifest of `folder`; CheckpointError if absent (partial checkpoint) or unreadable."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {folder} is partial: {MANIFEST_NAME} is missing (a save that did not finish, "
            "or a damaged folder)",
            folder=folder,
        )
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise CheckpointError(
            f"checkpoint {folder}: {MANIFEST_NAME} is unreadable: {error}", folder=folder
        ) from None
    if manifest.format not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {folder}: {MANIFEST_NAME} has format {manifest.format}, this version reads "
            f"formats {', '.join(map(str, READABLE_FORMATS))}",
            folder=folder,
        )
    return manifest


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """The complete checkpoints (readable manifest) in `root`, oldest save first.

    Folders of saves in progress or crashed (`.tmp-*`) and folders without a manifest are left
    out. Sizes and checksums are not checked here (`verify_checkpoint` does).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            manifest = _read_manifest(folder)
        except CheckpointError:
            continue
        found.append(
            CheckpointInfo(
                tag=folder.name,
                path=str(folder),
                step=manifest.step,
                sequence=manifest.sequence,
                saved_at=manifest.saved_at,
            )
        )
    return sorted(found, key=lambda info: (info.sequence, info.step, info.tag))


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint that `root/latest` names, or else the newest complete one; None if none.

    The folder the pointer names is returned even if it was damaged since (loading it then
    raises a `CheckpointError` that names the previous complete checkpoint).
    """
    root = Path(root)
    pointer = root / LATEST_NAME
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if _TAG_PATTERN.fullmatch(tag):
            return root / tag
    complete = list_checkpoints(root)
    return Path(complete[-1].path) if complete else None


def _previous_complete(root: Path, failed: Path) -> str | None:
    """The newest other checkpoint in `root` whose files are all present with the right sizes."""
    for info in reversed(list_checkpoints(root)):
        if Path(info.path).resolve() == failed.resolve():
            continue
        try:
            _check_files(Path(info.path), _read_manifest(Path(info.path)), checksums=False)
        except CheckpointError:
            continue
        return info.tag
    return None


def _resolve(path: Path, tag: str | None) -> tuple[Path, Path]:
    """(root, checkpoint folder) for `load_checkpoint(path, tag=tag)`."""
    if tag is not None:
        return path, path / checkpoint_tag(tag)
    is_checkpoint_folder = any((path / name).exists() for name in (MANIFEST_NAME, STATE_NAME, RNG_FOLDER))
    if is_checkpoint_folder or path.name.startswith(TMP_PREFIX):
        return path.parent, path
    folder = latest_checkpoint(path)
    if folder is None:
        partial = (
            sorted(p.name for p in path.iterdir() if p.name.startswith(TMP_PREFIX)) if path.is_dir() else []
        )
        hint = f" (only unfinished saves: {partial})" if partial else ""
        raise CheckpointError(f"no complete checkpoint in {path}{hint}", folder=path)
    return path, folder


# ----------------------------------------------------------------------------------------------
# Verification


def _check_files(folder: Path, manifest: Manifest, *, checksums: bool) -> None:
    """Presence and sizes of every file (all ranks); checksums of this rank's share if asked."""
    for entry in manifest.files:
        path = folder / entry.path
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: file {entry.path} is missing", folder=folder)
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointError(
                f"checkpoint {folder}: file {entry.path} has {size} bytes, the manifest says {entry.size} "
                "(truncated or overwritten)",
                folder=folder,
            )
    if not checksums:
        return
    rank, world = _rank(), _world_size()
    share = [(index, entry) for index, entry in enumerate(manifest.files) if index % world == rank]
    with _hash_pool() as pool:
        digests = _digests(
            pool, [folder / entry.path for _, entry in share], [entry.block_bytes for _, entry in share]
        )
        bad = [index for (index, entry), digest in zip(share, digests) if digest() != entry.sha256]
    first_bad = _min_over_ranks(min(bad, default=len(manifest.files)))
    if first_bad < len(manifest.files):
        entry = manifest.files[first_bad]
        raise CheckpointError(
            f"checkpoint {folder}: file {entry.path} is corrupt: its SHA-256 differs from the manifest's "
            f"{entry.sha256[:16]}…",
            folder=folder,
        )


def verify_checkpoint(path: str | os.PathLike[str], *, checksums: bool = True) -> Manifest:
    """Check a checkpoint folder against its manifest; return the manifest.

    Collective when torch.distributed is initialised (the checksums are split over the ranks):
    call it on every rank.

    Raises:
        CheckpointError: the manifest is missing or unreadable, a file is missing, has another
            size, or (with `checksums`) another SHA-256; the message names the folder and file.
    """
    folder = Path(path)
    manifest = _read_manifest(folder)
    _check_files(folder, manifest, checksums=checksums)
    return manifest


# ----------------------------------------------------------------------------------------------
# RNG states


def _capture_rng() -> _RngState:
    version, state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)  # noqa: NPY002 (the global stream is what is saved)
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return _RngState(
        python_version=version,
        python_state=list(state),
        python_gauss=gauss,
        numpy=_NumpyRng(
            kind=kind,
            keys=[int(k) for k in keys],
            position=int(position),
            has_gauss=int(has_gauss),
            cached_gaussian=float(cached),
        ),
        torch_cpu=bytes(torch.get_rng_state().numpy().tobytes()),
        cuda=cuda,
    )


def _restore_rng(state: _RngState) -> None:
    random.setstate((state.python_version, tuple(state.python_state), state.python_gauss))
    saved = state.numpy
    np.random.set_state(  # noqa: NPY002 (the global stream is what is saved)
        (
            saved.kind,
            np.asarray(saved.keys, dtype=np.uint32),
            saved.position,
            saved.has_gauss,
            saved.cached_gaussian,
        )
    )
    torch.set_rng_state(torch.frombuffer(bytearray(state.torch_cpu), dtype=torch.uint8))
    if state.cuda and torch.cuda.is_available():
        for device, raw in enumerate(state.cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8), device)


def _rng_file(rank: int) -> str:
    return f"{RNG_FOLDER}/rank_{rank:05d}.json"


# ----------------------------------------------------------------------------------------------
# Save


def _check_engines(engines: Any) -> dict[str, Any]:
    if not isinstance(engines, Mapping) or not engines:
        raise TypeError(
            f"engines: expected a non-empty mapping of name -> DeepSpeedEngine, got {type(engines).__name__}"
        )
    for name, engine in engines.items():
        if not isinstance(name, str) or not _TAG_PATTERN.fullmatch(name) or name in _RESERVED_TAGS:
            raise ValueError(
                f"engines: name {name!r} is not usable as a folder name; use letters, digits, '.', '_', '-' "
                f"and none of {sorted(_RESERVED_TAGS)}"
            )
        for method in ("save_checkpoint", "load_checkpoint", "zero_optimization_stage"):
            if not callable(getattr(engine, method, None)):
                raise TypeError(f"engines[{name!r}]: expected a DeepSpeedEngine, got {type(engine).__name__}")
        checkpoint_engine = getattr(engine, "checkpoint_engine", None)
        if checkpoint_engine is not None and checkpoint_engine.is_decoupled():
            raise ValueError(
                f"engines[{name!r}]: uses a decoupled (asynchronous) DeepSpeed checkpoint engine, whose files "
                "are not complete when save_checkpoint returns; use the default checkpoint engine"
            )
    return dict(engines)


def _dp_world_size(engine: Any) -> int:
    return int(getattr(engine, "dp_world_size", None) or _world_size())


def save_checkpoint(
    root: str | os.PathLike[str],
    step_or_tag: int | str,
    engines: Mapping[str, Any],
    state: TrainingState,
    *,
    keep_last: int | None = None,
    keep_tags: tuple[str, ...] = (),
    save_rng: bool = True,
    tensors: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> Path:
    """Save every engine and the training state as one checkpoint `root/<tag>`, atomically.

    Call on every rank (DeepSpeed's save is collective). See the module docstring for the
    protocol; the checkpoint appears under its final name only once complete, and `root/latest`
    then names it. An existing checkpoint with the same tag is replaced.

    Args:
        root: folder of the run's checkpoints (created if needed; shared by all ranks).
        step_or_tag: an int step (tag `step_%08d`) or a tag (see `checkpoint_tag`).
        engines: name -> `deepspeed.DeepSpeedEngine`, e.g. {"policy": ..., "critic": ...};
            engine `name` is saved in the sub-folder `name/`.
        state: the `TrainingState`; its `data_state` and `extra` must be JSON-able.
        keep_last: keep this many newest complete checkpoints (>= 1) and delete older ones;
            None keeps all. The checkpoint just written is never deleted.
        keep_tags: tags (or int steps) of checkpoints that rotation never deletes, on top of the
            newest `keep_last` (a run's best checkpoint).
        save_rng: save this rank's RNG states (restored by `load_checkpoint`).
        tensors: name -> {tensor name -> tensor}, written by rank 0 as
            `tensors/<name>.safetensors` (state kept outside the engines, e.g. an EMA of the
            weights; read back with `load_checkpoint_tensors`). Other ranks' values are ignored.

    Returns:
        The checkpoint folder `root/<tag>`.
    """
    tag = checkpoint_tag(step_or_tag)
    engines = _check_engines(engines)
    if not isinstance(state, TrainingState):
        raise TypeError(f"state: expected a TrainingState, got {type(state).__name__}")
    for field in ("step", "consumed_samples", "policy_version"):
        value = getattr(state, field)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"state.{field}: expected an integer >= 0, got {value!r}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last: expected an integer >= 1 or None, got {keep_last!r}")
    protected = {checkpoint_tag(kept) for kept in keep_tags}
    for name in tensors or {}:
        if not isinstance(name, str) or not _TAG_PATTERN.fullmatch(name):
            raise ValueError(
                f"tensors: name {name!r} is not usable as a file name; use letters, digits, '.', '_', '-'"
            )
    try:
        state_bytes = msgspec.json.encode(msgspec.to_builtins(state))
    except (TypeError, msgspec.EncodeError) as error:
        raise ValueError(f"state: data_state or extra is not JSON-able: {error}") from None

    root = Path(root)
    rank, world = _rank(), _world_size()
    temporary = root / f"{TMP_PREFIX}{tag}"
    final = root / tag
    with _disk_full_explained(root, temporary):
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if temporary.exists():  # a crashed save of the same tag
                shutil.rmtree(temporary)
            (temporary / RNG_FOLDER).mkdir(parents=True)
            (temporary / _PARTS_FOLDER).mkdir()
        _barrier()

        for name, engine in engines.items():
            engine.save_checkpoint(str(temporary), tag=name, client_state={}, save_latest=False)
        if save_rng:
            _write_atomic(temporary / _rng_file(rank), msgspec.json.encode(_capture_rng()))
        if rank == 0:
            _write_atomic(temporary / STATE_NAME, state_bytes)
            if tensors:
                from safetensors.torch import save_file

                (temporary / TENSORS_FOLDER).mkdir()
                for name, named in tensors.items():
                    save_file(
                        {key: value.detach().contiguous().cpu() for key, value in named.items()},
                        str(temporary / TENSORS_FOLDER / f"{name}.safetensors"),
                    )
        _barrier()

        # Each rank hashes and fsyncs its share of the files.
        files = [f for f in _relative_files(temporary) if not f.startswith(_PARTS_FOLDER + "/")]
        share = _seal(temporary, [relative for index, relative in enumerate(files) if index % world == rank])
        _write_atomic(temporary / _PARTS_FOLDER / f"rank_{rank:05d}.json", msgspec.json.encode(share))
        _barrier()

        if rank == 0:
            entries: list[ManifestFile] = []
            for part in range(world):
                entries += msgspec.json.decode(
                    (temporary / _PARTS_FOLDER / f"rank_{part:05d}.json").read_bytes(),
                    type=list[ManifestFile],
                )
            shutil.rmtree(temporary / _PARTS_FOLDER)
            listed = {entry.path for entry in entries}
            if listed != set(files):
                raise CheckpointError(
                    f"checkpoint {temporary}: the ranks saw different files ({sorted(listed ^ set(files))[:5]}); "
                    "is the root on a file system that every rank shares?",
                    folder=temporary,
                )
            previous = list_checkpoints(root)
            manifest = Manifest(
                format=CHECKPOINT_FORMAT,
                tag=tag,
                step=int(state.step),
                sequence=max((info.sequence for info in previous), default=0) + 1,
                saved_at=time.time(),
                world_size=world,
                engines={
                    name: EngineInfo(
                        zero_stage=int(engine.zero_optimization_stage()), dp_world_size=_dp_world_size(engine)
                    )
                    for name, engine in engines.items()
                },
                files=sorted(entries, key=lambda entry: entry.path),
            )
            _write_atomic(temporary / MANIFEST_NAME, msgspec.json.format(msgspec.json.encode(manifest)))
            for directory, _, _ in os.walk(temporary):
                _fsync_dir(Path(directory))
            if final.exists():
                _remove_tree(final)
            os.replace(temporary, final)
            _fsync_dir(root)
            _write_atomic(root / LATEST_NAME, f"{tag}\n".encode())
            _rotate(root, keep=final, keep_last=keep_last, keep_tags=protected)
    _barrier()
    return final


def _tree_bytes(folder: Path) -> int:
    total = 0
    for directory, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += (Path(directory) / name).stat().st_size
    return total


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    # torch.save (DeepSpeed's writer) reports a full disk as a RuntimeError from its C++ writer
    return isinstance(error, RuntimeError) and "No space left on device" in str(error)


@contextlib.contextmanager
def _disk_full_explained(root: Path, temporary: Path) -> Iterator[None]:
    """A save that runs out of space: the partial folder is removed (the previous checkpoint and
    `latest` are untouched) and a `CheckpointError` names the folder, the free space and the
    space a checkpoint takes (the newest complete one's size, else what was written so far)."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        if not _is_disk_full(error):
            raise
        written = _tree_bytes(temporary)
        if _rank() == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        previous = list_checkpoints(root) if root.is_dir() else []
        needed = _tree_bytes(Path(previous[-1].path)) if previous else 0
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            free = -1
        gib = 2**30
        need = (
            f"a checkpoint takes {needed / gib:.2f} GiB (the last one, {previous[-1].tag})"
            if needed
            else f"this one had written {written / gib:.2f} GiB when the disk filled"
        )
        fallback = (
            f"; the previous checkpoint {previous[-1].path} is intact and `latest` still names it"
            if previous
            else ""
        )
        raise CheckpointError(
            f"checkpoint {temporary}: no space left on the device of {root} ({error}): {need}, "
            f"{max(free, 0) / gib:.2f} GiB are free. Free space, lower ckpt.max_ckpt_num or move "
            f"ckpt.path{fallback}",
            folder=temporary,
            previous=previous[-1].tag if previous else None,
        ) from error


def _rotate(root: Path, *, keep: Path, keep_last: int | None, keep_tags: set[str] = frozenset()) -> None:
    """Delete complete checkpoints beyond the newest `keep_last` (never `keep` nor a tag in
    `keep_tags`) and dead folders."""
    for folder in root.iterdir():
        if folder.is_dir() and folder.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(folder, ignore_errors=True)
    if keep_last is None:
        return
    complete = list_checkpoints(root)
    for info in complete[: max(0, len(complete) - keep_last)]:
        if info.tag not in keep_tags and Path(info.path).resolve() != keep.resolve():
            _remove_tree(Path(info.path))


# ----------------------------------------------------------------------------------------------
# Load


def load_checkpoint(
    path: str | os.PathLike[str],
    engines: Mapping[str, Any],
    *,
    tag: str | int | None = None,
    load_optimizer_states: bool = True,
    restore_rng: bool = True,
    verify: bool = True,
) -> TrainingState:
    """Restore engines (model, optimizer, LR scheduler) and RNG states; return the training state.

    Call on every rank. `path` is a root (the checkpoint named by `root/latest`, or with `tag`
    that one) or a checkpoint folder itself. Everything is checked before any engine is touched:
    the manifest (a missing one means the save never finished), each file's presence and size,
    and with `verify` each file's SHA-256; the engine names and ZeRO stages; the world size (see
    the module docstring). Folders of unfinished saves (`.tmp-*`) are never picked.

    Args:
        path: checkpoint root or folder.
        engines: name -> DeepSpeedEngine; the names must be those saved.
        tag: load this checkpoint of the root instead of the latest (int step or tag).
        load_optimizer_states: also restore optimizer and LR-scheduler states (False: weights only,
            e.g. to start a new phase from trained weights).
        restore_rng: restore this rank's Python, NumPy, torch (and CUDA) RNG states.
        verify: check SHA-256 checksums (reads every byte once; sizes are always checked).

    Raises:
        CheckpointError: naming the folder, the file and the problem, and the previous complete
            checkpoint usable with `tag=` where there is one.
    """
    engines = _check_engines(engines)
    root, folder = _resolve(Path(path), None if tag is None else str(checkpoint_tag(tag)))
    try:
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {folder} does not exist", folder=folder)
        if folder.name.startswith(TMP_PREFIX):
            raise CheckpointError(f"checkpoint {folder} is an unfinished save ({TMP_PREFIX}*)", folder=folder)
        manifest = verify_checkpoint(folder, checksums=verify)
        _check_compatible(folder, manifest, engines)
        state = msgspec.json.decode((folder / STATE_NAME).read_bytes(), type=TrainingState)
    except CheckpointError as error:
        previous = _previous_complete(root, folder) if root.is_dir() else None
        hint = (
            f"; the previous complete checkpoint is {previous!r}: load it with tag={previous!r}"
            if previous
            else "; no other complete checkpoint was found"
        )
        raise CheckpointError(str(error) + hint, folder=folder, previous=previous) from None
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise CheckpointError(
            f"checkpoint {folder}: {STATE_NAME} is unreadable: {error}", folder=folder
        ) from None

    for name, engine in engines.items():
        try:
            with _loading_torch_adam(engine):
                loaded, _ = engine.load_checkpoint(
                    str(folder),
                    tag=name,
                    load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_optimizer_states,
                    load_module_only=not load_optimizer_states,
                )
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {folder}: DeepSpeed failed to load engine {name!r} ({type(error).__name__}: {error}); "
                "the engines may be partly loaded, rebuild them before trying another checkpoint",
                folder=folder,
            ) from error
        if loaded is None:
            raise CheckpointError(
                f"checkpoint {folder}: DeepSpeed found no checkpoint for engine {name!r} in {folder / name}",
                folder=folder,
            )

    rng_path = folder / _rng_file(_rank())
    if restore_rng and rng_path.is_file():
        _restore_rng(msgspec.json.decode(rng_path.read_bytes(), type=_RngState))
    elif restore_rng and manifest.world_size == _world_size():
        logger.warning(
            "checkpoint %s holds no RNG state for rank %d; RNG states not restored", folder, _rank()
        )
    return state


def _torch_adam_layout(state_dict: dict[str, Any], live_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """A torch Adam / AdamW state dict for one saved in DeepSpeed FusedAdam's layout, which
    `build_optimizer` gave CUDA learners below ZeRO-3 until 2026-11-27 (torch's fused AdamW
    since): FusedAdam counts steps in each parameter group (`group["step"]`), torch in each
    parameter's state, and torch's `load_state_dict` raises KeyError 'step' without it. The
    groups take the live optimizer's settings that FusedAdam's lack (`fused`, ...). A state dict
    in torch's own layout (no group has a "step") is returned unchanged."""
    groups = state_dict.get("param_groups", [])
    if not any("step" in group for group in groups):
        return state_dict
    states = dict(state_dict.get("state", {}))
    converted = []
    for group, live in zip(groups, live_groups, strict=True):
        group = dict(group)
        step = float(group.pop("step", 0))
        for index in group["params"]:
            if states.get(index) and "step" not in states[index]:
                states[index] = {**states[index], "step": step}  # torch makes it a tensor where it belongs
        converted.append(
            {**{key: value for key, value in live.items() if key not in ("params", "step")}, **group}
        )
    return {**state_dict, "state": states, "param_groups": converted}


@contextlib.contextmanager
def _loading_torch_adam(engine: Any) -> Iterator[None]:
    """While DeepSpeed loads `engine`, its torch Adam / AdamW reads FusedAdam's layout too
    (`_torch_adam_layout`)."""
    basic = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    if not isinstance(basic, torch.optim.Adam):  # AdamW is an Adam
        yield
        return
    load = basic.load_state_dict
    basic.load_state_dict = lambda state_dict: load(_torch_adam_layout(state_dict, basic.param_groups))
    try:
        yield
    finally:
        del basic.load_state_dict  # the class's method again


def load_checkpoint_tensors(
    path: str | os.PathLike[str], name: str, *, tag: str | int | None = None
) -> dict[str, torch.Tensor] | None:
    """The tensor set `name` saved with `save_checkpoint(..., tensors={name: ...})` (on CPU), or
    None when the checkpoint has none. `path` and `tag` as in `load_checkpoint`, which verifies
    the file with the rest of the checkpoint (safetensors: no code runs on reading)."""
    from safetensors.torch import load_file

    _, folder = _resolve(Path(path), None if tag is None else str(checkpoint_tag(tag)))
    file = folder / TENSORS_FOLDER / f"{name}.safetensors"
    return load_file(str(file)) if file.is_file() else None


def _backend(engine: Any) -> str:
    """The learner backend of `engine`: "fsdp2" for an `rl_learner.fsdp2.Fsdp2Engine`, else "deepspeed"."""
    from .fsdp2 import Fsdp2Engine

    return "fsdp2" if isinstance(engine, Fsdp2Engine) else "deepspeed"


def _check_compatible(folder: Path, manifest: Manifest, engines: Mapping[str, Any]) -> None:
    if set(engines) != set(manifest.engines):
        raise CheckpointError(
            f"checkpoint {folder}: holds engines {sorted(manifest.engines)}, but engines {sorted(engines)} "
            "were given; pass the same names as when saving",
            folder=folder,
        )
    world = _world_size()
    files = {entry.path for entry in manifest.files}
    for name, engine in engines.items():
        saved = manifest.engines[name]
        backend, saved_backend = (
            _backend(engine),
            "fsdp2" if f"{name}/dcp/.metadata" in files else "deepspeed",
        )
        if backend != saved_backend:
            raise CheckpointError(
                f"checkpoint {folder}: engine {name!r} was saved by the {saved_backend} learner backend and now "
                f"runs on {backend}; the two write different files (DeepSpeed's, torch.distributed.checkpoint's). "
                f"Resume with backend {saved_backend} (rl-launch: --train.backend {saved_backend})",
                folder=folder,
            )
        stage = int(engine.zero_optimization_stage())
        if stage != saved.zero_stage:
            raise CheckpointError(
                f"checkpoint {folder}: engine {name!r} was saved with ZeRO stage {saved.zero_stage} and now "
                f"runs stage {stage}; DeepSpeed cannot convert optimizer states between stages",
                folder=folder,
            )
        if stage > 0 and _dp_world_size(engine) != saved.dp_world_size:
            raise CheckpointError(
                f"checkpoint {folder}: engine {name!r} was saved by {saved.dp_world_size} data-parallel ranks "
                f"and now runs on {_dp_world_size(engine)} (world size {world}); DeepSpeed cannot re-partition "
                f"ZeRO stage {stage} optimizer states. Resume with {saved.dp_world_size} ranks, or convert with "
                "DeepSpeed's ds_to_universal and load with a universal-checkpoint config",
                folder=folder,
            )


# ----------------------------------------------------------------------------------------------
# Hugging Face export


def _is_zero3_parameter(parameter: torch.Tensor) -> bool:
    return hasattr(parameter, "ds_id")


@contextlib.contextmanager
def _gathered(parameters: list[torch.nn.Parameter]) -> Iterator[None]:
    partitioned = [p for p in parameters if _is_zero3_parameter(p)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def _full_state_dict(
    model: torch.nn.Module, *, keep: bool, replace: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's persistent state with full (ZeRO-3-gathered) tensors and LoRA merged, on CPU.

    Collective under ZeRO-3: every rank walks the tensors (`rl_learner.lora.merged_tensors`, the
    walker weight sync uses) and gathers each one's parameters in turn; only where `keep` are
    copies made. Names are the plain model's (peft's `base_layer` and adapter weights folded away,
    LoRA and DoRA merged); tied parameters map to one tensor. A name in `replace` takes that
    tensor instead of the model's (still gathered in turn, so that every rank runs the same
    collectives).
    """
    output: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for tensor in merged_tensors(model, where="export_hf", buffers=True, tied=True):
        with _gathered(tensor.params()):
            # FSDP2 / tensor-parallel DTensors: every rank takes part in the gather (rl_learner.dtensor)
            gathered = full_value(tensor) if is_dtensor(tensor.param) else None
            if not keep:
                continue
            if replace is not None and tensor.name in replace:
                value = replace[tensor.name]
                output[tensor.name] = value.detach().to("cpu", tensor.param.dtype, copy=True)
            elif gathered is not None:
                output[tensor.name] = gathered.detach().to("cpu", copy=True)
            elif tensor.adapters():
                output[tensor.name] = tensor.value().detach().to("cpu", copy=True)
            else:
                if id(tensor.param) not in copies:
                    copies[id(tensor.param)] = tensor.param.detach().to("cpu", copy=True)
                output[tensor.name] = copies[id(tensor.param)]
    return output


def export_hf(
    model: Any,
    path: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    max_shard_size: int | str = "5GB",
    replace: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a Hugging Face folder (safetensors, config, tokenizer) of a model, atomically.

    `model` is a `transformers` model, a peft `PeftModel` around one (LoRA or DoRA merged into
    the weights: the folder loads with plain `AutoModelFor...` classes; the live adapters and base
    weights are not modified), or a DeepSpeed engine wrapping either, in any ZeRO stage (ZeRO-3
    parameters are gathered one tensor at a time; rank 0 holds the full state on CPU and
    writes). Call on every rank when distributed. The folder is built in a temporary sibling
    and renamed into place; an existing folder at `path` is replaced.

    Args:
        model: transformers PreTrainedModel, PeftModel, or DeepSpeedEngine of one.
        path: the output folder.
        tokenizer: saved into the folder too when given (anything with `save_pretrained`).
        max_shard_size: passed to `save_pretrained`.
        replace: tensor name -> full tensor written instead of the model's own, in the model's
            dtype (read on rank 0 only): e.g. `WeightEMA.export_names`, an EMA of the weights.

    Returns:
        `path`.
    """
    module = getattr(model, "module", model) if hasattr(model, "zero_optimization_stage") else model
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"model: expected a torch module, PeftModel or DeepSpeedEngine, got {type(model).__name__}"
        )
    base = (
        module.get_base_model()
        if hasattr(module, "peft_config") and hasattr(module, "get_base_model")
        else module
    )
    if not callable(getattr(base, "save_pretrained", None)) or not hasattr(base, "config"):
        raise TypeError(
            f"model: {type(base).__name__} has no save_pretrained/config; export_hf writes transformers models"
        )
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            f"tokenizer: expected a tokenizer with save_pretrained, got {type(tokenizer).__name__}"
        )
    path = Path(path)
    rank = _rank()
    failed: BaseException | None = None
    try:
        state = _full_state_dict(base, keep=rank == 0, replace=replace)
        if rank == 0:
            temporary = path.with_name(f"{TMP_PREFIX}{path.name}")
            if temporary.exists():
                shutil.rmtree(temporary)
            temporary.mkdir(parents=True)
            base.save_pretrained(temporary, state_dict=state, max_shard_size=max_shard_size)
            if tokenizer is not None:
                tokenizer.save_pretrained(temporary)
            for name in os.listdir(temporary):
                if (temporary / name).is_file():
                    _fsync_file(temporary / name)
            _fsync_dir(temporary)
            if path.exists():
                _remove_tree(path)
            os.replace(temporary, path)
            _fsync_dir(path.parent)
    except BaseException as error:
        failed = error
    if _any_rank_failed(failed is not None):
        if failed is not None:
            raise failed
        raise CheckpointError(f"export_hf to {path} failed on another rank", folder=path)
    return path
