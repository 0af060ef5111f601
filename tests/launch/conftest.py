"""Shared set-up of the launcher tests: a short Ray temp folder per run, checked for leftovers, or
the session's shared Ray for runs that do not test a local Ray's own start and stop; the logging
state a CLI run in the test's own process changes, put back."""

from __future__ import annotations

import pytest

from tests.launch.launching import SharedRay, ray_temp_dir


@pytest.fixture
def ray_temp():
    """(temp folder, env) for one run's local Ray; fails if a Ray process of it outlives the test."""
    with ray_temp_dir() as value:
        yield value


@pytest.fixture(scope="session")
def shared_ray():
    """The session's `SharedRay` (one per xdist worker), started by the first test that asks."""
    cluster = SharedRay()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def joined_ray(shared_ray):
    """(the options that join the session's shared Ray, env) for a run that does not test a local
    Ray's own start and stop; fails if an actor of the test's runs outlives it."""
    yield shared_ray.args, shared_ray.env
    left = shared_ray.wait_for_no_actors()
    assert not left, f"actors outlived the test's runs: {left}"


@pytest.fixture
def in_process():
    """For a test that calls the CLI's `main` in its own process: puts back the logging state of
    transformers and datasets that a run turns down (`rl_launch.tracking.quiet_third_party_output`),
    for the tests after it."""
    import datasets
    from transformers.utils import logging as transformers_logging

    state = (
        transformers_logging.get_verbosity(),
        transformers_logging.is_progress_bar_enabled(),
        datasets.logging.get_verbosity(),
        datasets.is_progress_bar_enabled(),
    )
    yield
    transformers_logging.set_verbosity(state[0])
    (transformers_logging.enable_progress_bar if state[1] else transformers_logging.disable_progress_bar)()
    datasets.logging.set_verbosity(state[2])
    (datasets.enable_progress_bars if state[3] else datasets.disable_progress_bars)()


@pytest.fixture(scope="session")
def arithmetic_teacher(preset_root):
    """(preset root, teacher folder): the arithmetic preset built once per run under the shared
    `preset_root` (what `--preset_root` reads) and its distillation teacher
    (`presets.arithmetic.build_teacher`: the preset's model fine-tuned 50 more steps on right
    answers only)."""
    from rl_launch.presets.arithmetic import build_teacher

    return str(preset_root), build_teacher(preset_root)


@pytest.fixture
def fake_ray_one_thread(monkeypatch):
    """The PPO step loop on in-process fake actors (`tests.launch.fakes`): `import ray` gives the
    fake, and torch runs one thread. The toy tensors hold a few dozen numbers: with two threads on a
    busy machine, each tiny op waits for the other thread (torch.repeat_interleave: ~10 ms instead of
    ~10 us)."""
    import torch

    from tests.launch.fakes import use_fake_ray

    use_fake_ray(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def zygotes():
    """The processes `start_driver` forks the runs' drivers from (tests/launch/driver_zygote.py) and
    the runs' Ray workers are forked from (tests/launch/worker_zygote.py), stopped at the session's
    end."""
    from tests.launch.driver_zygote import close_zygotes
    from tests.launch.worker_zygote import close_worker_zygotes

    yield
    close_zygotes()
    close_worker_zygotes()
