"""`rl-launch sft` / `kto` on a Ray actor group of two ranks (`rl_launch.trainers.learners`).

Each test runs the real CLI on the arithmetic demo once on one rank in the driver (the default;
through the CLI's main in this process, as tests/launch/test_trainers.py does) and on
`--ray.learner.num_actors 2` Ray actors of a local Ray bound to 127.0.0.1 (a process of its own:
DeepSpeed's process-group state and Ray's must not stay in the pytest worker), checked for
leftovers after the test. The two must take the same steps: the same loss at every step and the
same exported weights, although the two ranks split each step's items between them (kto, ZeRO-3)
or each hold half of every sequence (sft, sequence parallel, on the FSDP2 backend), in smaller micro-batches
(`train.micro_batch_tokens`). In the sft test a rank is killed mid-run: the run stops with a
diagnosis that names it and the checkpoint a resume uses, and the resume continues from it to
the one rank's weights.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launching import actor_pid, kill_processes, launch, read_metrics

pytestmark = pytest.mark.slow

STEPS = 4


def _run(
    command: str, out: pathlib.Path, tmp_path: pathlib.Path, ray_temp, *args: str
) -> subprocess.CompletedProcess:
    ray_dir, env = ray_temp
    own = ["--preset_root", str(tmp_path / "presets"), "--log.output_dir", str(out)]
    own += ["--log.progress_bar", "false", "--ray.temp_dir", ray_dir, "--train.max_steps", str(STEPS)]
    return launch([*own, *args], env, timeout=600, command=command)


def _weights(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _in_process(command: str, out: pathlib.Path, tmp_path: pathlib.Path, capsys, *args: str) -> None:
    """`rl-launch <command>` on one rank in the driver, through the CLI's main in this process (no
    Ray, no second rank: a process of its own would add only its imports)."""
    from rl_launch.cli import main

    capsys.readouterr()
    code = main(
        [
            command,
            "--preset_root", str(tmp_path / "presets"),
            "--log.output_dir", str(out),
            "--log.progress_bar", "false",
            "--train.max_steps", str(STEPS),
            *args,
        ]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]


def _same_steps(command: str, key: str, one: pathlib.Path, two: pathlib.Path, steps: int) -> None:
    """The runs in `one` and `two` logged the same `steps` steps and exported the same weights."""
    first, second = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in first] == list(range(1, steps + 1))
    assert [r["step"] for r in second] == list(range(1, steps + 1))
    assert [r[key] for r in second] == pytest.approx([r[key] for r in first], rel=1e-5, abs=1e-6)
    assert first[-1][key] != pytest.approx(first[0][key], rel=1e-3)  # the model did train
    assert [r[f"{command}/sequences"] for r in second] == [r[f"{command}/sequences"] for r in first]
    grad_norm = f"{command}/grad_norm"
    assert [r[grad_norm] for r in second] == pytest.approx([r[grad_norm] for r in first], rel=1e-4)
    expected, got = _weights(one / "final"), _weights(two / "final")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_two_zero3_ray_ranks_take_the_steps_of_one_rank(tmp_path, ray_temp, capsys, in_process):
    # two data-parallel ranks, ZeRO-3 shards, a reference model on each rank, KTO's reference
    # point from KL pairs made over the whole step and reduced over the ranks
    one, two = tmp_path / "one", tmp_path / "two"
    _in_process("kto", one, tmp_path, capsys, "--train.zero_stage", "3")
    ranks = ("--ray.learner.num_actors", "2", "--train.micro_batch_tokens", "64")
    done = _run("kto", two, tmp_path, ray_temp, "--train.zero_stage", "3", *ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 Ray actors (world size 2" in done.stdout + done.stderr
    assert (two / "logs" / "policy-1.log").is_file()
    _same_steps("kto", "kto/loss", one, two, STEPS)


def test_two_sequence_parallel_ray_ranks_one_killed_and_resumed_take_the_steps_of_one_rank(
    tmp_path, ray_temp, capsys, in_process
):
    """One group of two sequence-parallel ranks on FSDP2 (each holds half of every micro-batch, the
    parameters sharded over both), rank 1 killed after step 2: the run stops with a diagnosis that names it and the checkpoint a resume
    uses; resumed on two fresh ranks from that checkpoint, it ends where one rank does.

    The learning rate is constant (`train.min_lr_ratio 1`, the preset's warmup is 0), so a step's
    update does not depend on `train.max_steps`: the killed run is given 400 steps (it must not end
    before the kill), the resume and the one-rank run as many as the resume ends at."""
    two = tmp_path / "two"
    killed: list[int] = []

    def kill_rank_1_after_step_2() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (two / "metrics.jsonl").is_file() and len(read_metrics(two)) >= 2:
                killed.append(actor_pid(two, "policy-1"))
                kill_processes(killed)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_rank_1_after_step_2, daemon=True)
    watcher.start()
    options = (
        "--train.min_lr_ratio",
        "1",
        "--ray.learner.num_actors",
        "2",
        "--train.micro_batch_tokens",
        "64",
    )
    # the two ranks on the FSDP2 backend (its checkpoint is torch.distributed.checkpoint's), the
    # one-rank run on DeepSpeed: the same steps either way
    ranks = (*options, "--model.sequence_parallel_size", "2", "--train.backend", "fsdp2")
    # later flags win: a run that would not end before the kill
    done = _run("sft", two, tmp_path, ray_temp, *ranks, "--train.max_steps", "400", "--ckpt.save_steps", "1")
    watcher.join(timeout=10)
    err = done.stderr
    assert killed, "the run ended before rank 1 could be killed"
    assert done.returncode == 1, err[-3000:]
    assert "2 Ray actors (world size 2" in done.stdout + err
    assert "not used by train.backend fsdp2" in done.stdout + err  # the start-up line of an FSDP2 run
    assert list(two.glob("checkpoints/**/dcp/.metadata")), "no torch.distributed.checkpoint folder"
    assert "policy-1 died" in err
    assert str(two / "logs" / "policy-1.log") in err
    assert "--ckpt.load_checkpoint true continues from it" in err
    saved = int(re.search(r"the last checkpoint on disk stays valid: step (\d+)", err).group(1))
    assert saved >= 2
    steps = max(STEPS, saved + 1)

    # the run's own checkpoint, on two fresh ranks: to `steps`, then the export
    again = _run(
        "sft",
        two,
        tmp_path,
        ray_temp,
        *ranks,
        "--ckpt.load_checkpoint",
        "true",
        "--train.max_steps",
        str(steps),
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"from step {saved}" in again.stdout + again.stderr

    one = tmp_path / "one"
    _in_process("sft", one, tmp_path, capsys, "--train.min_lr_ratio", "1", "--train.max_steps", str(steps))
    _same_steps("sft", "sft/loss", one, two, steps)
