"""Shared set-up of the launcher tests: a short Ray temp folder per run, checked for leftovers."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.launch.launching import launcher_env, ray_processes


def _ray_temp():
    temp_dir = tempfile.mkdtemp(prefix="rlt-", dir="/tmp")  # unix socket paths must stay short
    yield temp_dir, launcher_env()
    leftovers = ray_processes(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not leftovers, f"Ray processes outlived the run: {leftovers}"


@pytest.fixture
def ray_temp():
    """(temp folder, env) for one run's local Ray; fails if a Ray process of it outlives the test."""
    yield from _ray_temp()


@pytest.fixture(scope="module")
def module_ray_temp():
    """`ray_temp` for a run that several tests of a module read (a module-scoped fixture's run)."""
    yield from _ray_temp()
