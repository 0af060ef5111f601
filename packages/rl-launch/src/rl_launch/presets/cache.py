"""Built once, reused after: the build cache that presets and demos share.

A build writes a folder named by a hash of its recipe (every argument that changes what it
makes, and a version for what the arguments do not capture). The folder is written under a
staging name, renamed into place, and a marker file (JSON: the recipe and what the build
measured) goes in last: a folder with its marker is complete; one without is an interrupted
build and is built again. A reader therefore never sees a half-written model. Builders of one folder take turns (an
exclusive `flock` on `.<folder name>.lock` beside it): two runs started together on one machine,
or two test workers, build it once and the second reads what the first built.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..tracking import third_party_bars_off

__all__ = ["cached_build", "recipe_hash"]


def recipe_hash(recipe: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of `recipe` as sorted-key JSON."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def cached_build(
    folder: str | os.PathLike[str], marker: str, build: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """The marker `folder/marker`'s content, after building `folder` if it has no marker.

    `build(staging)` writes the folder's files into `staging` (an empty folder beside `folder`,
    named `.<folder name>.tmp-<pid>`) and returns the marker's content (JSON-serialisable). On
    success the staging folder becomes `folder` and the marker is written; on any error or
    interruption the staging folder is removed and the error propagates. A caller that finds
    another process building the same folder waits for it (the lock) and reads its marker.
    The build runs with transformers' progress bars off (`tracking.third_party_bars_off`).
    """
    folder = Path(folder)
    marker_path = folder / marker
    if marker_path.is_file():
        return json.loads(marker_path.read_text())
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if marker_path.is_file():  # built by whoever held the lock before
            return json.loads(marker_path.read_text())
        if folder.exists():  # an interrupted build: no marker
            shutil.rmtree(folder)
        staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            with third_party_bars_off():  # the console keeps the run's own lines
                content = build(staging)
            staging.rename(folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        text = json.dumps(content, indent=2, sort_keys=True)
        marker_path.write_text(text)  # last: the folder is complete
    return json.loads(text)
