"""Chaos: `rl-launch ppo` stopped again and again at random moments, resumed each time, ends where
an uninterrupted run of the same arguments ends.

A harness driven by a seeded `random.Random` (its seed is in every failure message; set
RL_CHAOS_SEED to replay one) runs GRPO for `STEPS` steps in sync mode (HF engine, fixed seeds, no
checkpoint cadence: `ckpt.save_steps -1`, so every checkpoint is one a stop wrote or the last
step's) and, a random moment after a random step, stops one process of the run:
the driver with SIGTERM (a cluster's preemption), the engine actor or the policy learner with
SIGKILL (the OOM killer); every kind once, in a shuffled order. A SIGTERM saves the last finished
step; a dead engine lets the learners save it; a dead policy leaves the last checkpoint on disk
(or none: the resume starts again from step 0). It resumes with
`--ckpt.load_checkpoint true` after each stop until a start runs to the end. Then:

- metrics.jsonl holds every step once, in order, each line equal to the uninterrupted run's in
  every key but the timing ones, exactly (sync mode on CPU with fixed seeds is deterministic, and
  a resume restores the loader, the group ids, the KL coefficient and the learners' RNG);
- every stop ended the run within a bound with its kind's exit code (143 for SIGTERM, 1 for a dead
  actor); a dead actor's diagnosis named it, why, its log and the checkpoint a resume continues
  from; and the stop left nothing: no Ray process of its temp folder, no actor process, no
  /dev/shm folder of its weight sync (a killed policy's folder is swept at shutdown).
  (These runs pass `--rollout.engine_restarts 0`, so that a dead engine stops the run.)

The engine-restart case: with the default `rollout.engine_restarts`, the engine actor's process
(vLLM with the shm weight sync; HF with the broadcast one, whose group is formed again) SIGKILLed mid-run is restarted in place (`rl_launch.supervisor`) and the run finishes every
step with exit 0; the console says which engine died, why, and how long its restart took; the
metrics go on from the step it died in (every step once, in order; engine/restarts 1 from then
on). It prints the seconds from the kill to the driver noticing it (detect), of the restart
(start and weight sync) and from the restart to that step's line (resume).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import ray

from rl_launch.cli import main
from tests.launch.launching import (
    actor_pid,
    actor_pids,
    comparable,
    interrupt_after_step,
    kill_processes,
    launch,
    ray_processes,
    read_metrics,
    start_driver,
    stop_driver,
    write_sum_prompts,
)

pytestmark = pytest.mark.slow

STEPS = 12
KILLS = ("driver", "engine-0", "policy-0")  # SIGTERM to the driver, SIGKILL to an actor's process
EXIT_CODES = {"driver": 143, "engine-0": 1, "policy-0": 1}
MAX_DELAY_S = 0.05  # the kill lands this long at most after the step's line (a step: 0.04-0.25 s)


def _args(tiny_checkpoint, prompts, run_dir, ray_dir) -> list[str]:
    return [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "2",
        "--rollout.generate_max_len", "4",
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", str(STEPS),
        "--ckpt.save_steps", "-1",
        "--ckpt.save_hf_model", "false",
        "--ckpt.preemption_timeout_s", "60",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
        "--rollout.engine_restarts", "0",
    ]  # fmt: skip


def _saved_step(run_dir) -> int:
    """The step of the policy's newest complete checkpoint, 0 before the first."""
    latest = run_dir / "checkpoints" / "policy" / "latest"
    return int(latest.read_text().strip().removeprefix("step_")) if latest.exists() else 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _left_running(ray_dir: str, pids: set[int], timeout_s: float = 15.0) -> dict[int, str]:
    """The run's processes still alive after `timeout_s` (Ray's daemons exit just after the driver)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = ray_processes(ray_dir) | {pid: "actor" for pid in pids if _alive(pid)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _check_diagnosis(err: str, target: str, run_dir, context: str) -> None:
    """What the console says when `target` (engine-0 or policy-0) was killed with SIGKILL."""
    log = (run_dir / "logs" / f"{target}.log").resolve()
    assert re.search(rf"{target} died: .*pid: \d+", err), context
    assert f"its log: {log}" in err, context
    step = _saved_step(run_dir)
    folder = run_dir.resolve() / "checkpoints" / "policy" / f"step_{step:08d}"
    on_disk = (
        f"the last checkpoint on disk stays valid: step {step} ({folder}); "
        "--ckpt.load_checkpoint true continues from it"
        if step
        else "a new run starts from step 0"
    )
    if target == "policy-0":
        assert "why: its process ended with no error in its log, as SIGKILL ends one" in err, context
        assert f"its log: {log}, last lines:\n    " in err, context
        assert "the policy's trained state was in policy-0's process: nothing newer can be saved" in err
        assert on_disk in err, context
        return
    saved = re.search(r"checkpoint of step (\d+) saved", err)
    if saved:  # the engine died while generating: the learners saved the last finished step
        assert step == int(saved.group(1)), context
    else:  # it died in the weight sync: the learners had trained on, nothing older to save
        assert on_disk in err, context


def _stop_and_resume(rng, tiny_checkpoint, prompts, run_dir, ray_dir, env, seed) -> tuple[list, set, set]:
    """Start the run, stop one of its processes at random (every kind of `KILLS` once, shuffled),
    resume, until every kind was stopped; checks each stop's exit and leftovers. (what happened,
    the runs' /dev/shm folders, the actors' pids)."""
    args = _args(tiny_checkpoint, prompts, run_dir, ray_dir)
    kinds = list(KILLS)
    rng.shuffle(kinds)
    history: list[str] = []  # what happened, for the failure messages
    folders: set[str] = set()  # the runs' /dev/shm folders (weight sync)
    pids: set[int] = set()
    for index, target in enumerate(kinds):
        done = _saved_step(run_dir)
        # Lines after the checkpoint (a dead policy saves nothing) stay in the file until the resumed
        # run's tracker drops them: the stop waits for a step beyond every line already there.
        logged = max((line["step"] for line in read_metrics(run_dir)), default=0) if index else 0
        # a random step after the last saved one, leaving three steps for each stop still to come
        after = max(logged + 1, done + 1, min(done + rng.randint(1, 2), STEPS - 3 * (len(kinds) - index)))
        delay = rng.uniform(0.0, MAX_DELAY_S)
        resume = ["--ckpt.load_checkpoint", "true"] if index else []
        stopped, seconds = interrupt_after_step([*args, *resume], env, run_dir, after, target, delay_s=delay)
        history.append(
            f"{target} stopped {delay:.2f} s after step {after} (saved before: {done}): exit "
            f"{stopped.returncode} in {seconds if seconds is None else round(seconds, 1)} s, "
            f"saved now: {_saved_step(run_dir)}"
        )
        context = f"seed {seed} (RL_CHAOS_SEED); {'; '.join(history)}\n{stopped.stderr[-3000:]}"
        assert seconds is not None, f"the run ended before the stop: {context}"
        assert stopped.returncode == EXIT_CODES[target], context
        assert seconds < 60, context
        if target != "driver":  # a dead actor: named, with why, its log and where a resume starts
            _check_diagnosis(stopped.stderr, target, run_dir, context)
        if target == "driver":  # a preemption: the last finished step saved, the summary written
            saved = _saved_step(run_dir)
            assert [line["step"] for line in read_metrics(run_dir)] == list(range(1, saved + 1)), context
            assert f"stopped after step {saved} (checkpoint of step {saved} saved" in stopped.stderr, context
            assert "summary of" in stopped.stdout, context
            assert (run_dir / "summary.txt").is_file(), context
        folders |= set(re.findall(r"shared memory \((\S+)\)", stopped.stdout))
        pids |= {pid for name in ("engine-0", "policy-0") for pid in actor_pids(run_dir, name)}
        assert not _left_running(ray_dir, pids), context
        assert not [folder for folder in folders if os.path.exists(folder)], context

    return history, folders, pids


def test_a_run_stopped_at_random_and_resumed_each_time_logs_what_an_uninterrupted_run_logs(
    tiny_checkpoint, ray_temp, tmp_path, capsys, in_process
):
    seed = int(os.environ.get("RL_CHAOS_SEED", random.randrange(2**31)))
    rng = random.Random(seed)
    ray_dir, env = ray_temp
    prompts = write_sum_prompts(tmp_path / "train.jsonl", 64)
    began = time.monotonic()

    # the uninterrupted run, beside the stopped ones: Ray's start-up and shutdown are partly waits
    reference_dir, reference_ray = tmp_path / "reference", tempfile.mkdtemp(prefix="rlt-", dir="/tmp")
    reference = start_driver("ppo", _args(tiny_checkpoint, prompts, reference_dir, reference_ray), env)
    try:
        history, folders, pids = _stop_and_resume(
            rng, tiny_checkpoint, prompts, tmp_path / "run", ray_dir, env, seed
        )
        reference_out, reference_err = reference.communicate(timeout=600)
    finally:
        stop_driver(reference)
        left = ray_processes(reference_ray)
        kill_processes(list(left))
        shutil.rmtree(reference_ray, ignore_errors=True)
    assert reference.returncode == 0, reference_err[-4000:]
    assert not left, f"the uninterrupted run's Ray processes outlived it: {left}"
    expected = [comparable(line) for line in read_metrics(reference_dir)]
    assert [line["step"] for line in expected] == list(range(1, STEPS + 1))

    run_dir = tmp_path / "run"
    args = _args(tiny_checkpoint, prompts, run_dir, ray_dir)
    final = launch([*args, "--ckpt.load_checkpoint", "true"], env)
    context = f"seed {seed} (RL_CHAOS_SEED); {'; '.join(history)}\n{final.stderr[-3000:]}"
    assert final.returncode == 0, context
    logged = [comparable(line) for line in read_metrics(run_dir)]
    assert [line["step"] for line in logged] == list(range(1, STEPS + 1)), context
    for line, reference_line in zip(logged, expected, strict=True):
        assert line == reference_line, f"step {line['step']}: {context}"
    folders |= set(re.findall(r"shared memory \((\S+)\)", final.stdout + reference_out))
    pids |= {pid for name in ("engine-0", "policy-0") for pid in actor_pids(tmp_path / "reference", name)}
    assert not _left_running(ray_dir, pids), context
    assert not [folder for folder in folders if os.path.exists(folder)], context
    capsys.readouterr()
    # without --ckpt.load_checkpoint: refused before Ray starts (the CLI's main in this process)
    assert main(["ppo", *args]) == 2
    refusal = capsys.readouterr().err
    assert "already holds a run" in refusal, refusal[-2000:]
    assert "--ckpt.load_checkpoint true" in refusal, refusal[-2000:]
    assert not ray.is_initialized()
    print(f"chaos seed {seed}: {'; '.join(history)}; {time.monotonic() - began:.0f} s in all")


RESTART_STEPS = 4
RESTART_AFTER = 2  # the engine is killed once this step's line is written


def _timed_lines(stream, lines: list[tuple[float, str]]) -> threading.Thread:
    """Read `stream` line by line on a thread, appending (unix time, line) to `lines`."""

    def read() -> None:
        for line in stream:
            lines.append((time.time(), line.rstrip("\n")))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("engine", "weight_sync", "mode"),
    [("vllm", "auto", []), ("hf", "broadcast", []), ("hf", "shm", ["--rollout.async_train", "true"])],
    # broadcast: the group is formed again with the new engine; async: the steps in flight on the
    # dead engine are issued again and its weight-sync receipts dropped
    ids=["vllm-shm", "hf-broadcast", "hf-shm-async"],
)
def test_a_killed_engine_is_restarted_and_the_run_logs_every_step_once(
    tiny_checkpoint, ray_temp, tmp_path, engine, weight_sync, mode
):
    if engine == "vllm":
        pytest.importorskip("vllm")
    ray_dir, env = ray_temp
    prompts = write_sum_prompts(tmp_path / "train.jsonl", 32)
    run_dir = tmp_path / "run"
    args = [
        *_args(tiny_checkpoint, prompts, run_dir, ray_dir)[:-2],  # the default rollout.engine_restarts
        "--rollout.engine", engine,
        "--rollout.weight_sync", weight_sync,
        *(["--rollout.enforce_eager", "true"] if engine == "vllm" else []),
        *mode,
        "--train.max_steps", str(RESTART_STEPS),
    ]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "rl_launch.cli", "ppo", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []
    readers = [_timed_lines(process.stdout, out), _timed_lines(process.stderr, err)]
    try:
        deadline = time.monotonic() + 600
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and any(line["step"] >= RESTART_AFTER for line in read_metrics(run_dir))):
            assert process.poll() is None, "\n".join(line for _, line in err[-60:])
            assert time.monotonic() < deadline, f"step {RESTART_AFTER} did not appear within 600 s"
            time.sleep(0.02)
        old_pid = actor_pid(run_dir, "engine-0")
        killed_at = time.time()
        os.kill(old_pid, signal.SIGKILL)
        process.wait(timeout=600)
    finally:
        stop_driver(process)
    for reader in readers:
        reader.join(timeout=10)
    console = "\n".join(line for _, line in err)
    assert process.returncode == 0, console[-6000:]

    logged = read_metrics(run_dir)
    assert [line["step"] for line in logged] == list(range(1, RESTART_STEPS + 1)), console[-3000:]
    died = [(when, line) for when, line in err if "engine-0 died" in line]
    restarted = [(when, line) for when, line in err if "engine-0 restarted in" in line]
    assert len(died) == 1, console[-6000:]
    assert len(restarted) == 1, console[-6000:]
    assert "restarting it (restart 1 of 3, rollout.engine_restarts)" in died[0][1]
    assert "why: its process ended with no error in its log, as SIGKILL ends one" in died[0][1]
    assert "generation call" in restarted[0][1]
    # the step the engine died in is logged once, with the restart; the steps before without one
    restarts = [line["engine/restarts"] for line in logged]
    first = restarts.index(1.0) + 1
    assert first == RESTART_AFTER + 1, restarts
    assert restarts == [0.0] * RESTART_AFTER + [1.0] * (RESTART_STEPS - RESTART_AFTER)
    assert logged[first - 1]["engine/restart_s"] > 0.0
    # a new engine process wrote its start into the same log; the killed one is gone
    pids = actor_pids(run_dir, "engine-0")
    assert pids[:1] == [old_pid], pids
    assert len(pids) == 2, pids
    assert not _alive(old_pid), pids
    assert logged[-1]["health/sync_checksum_match"] == 1.0
    detect = died[0][0] - killed_at
    restart = restarted[0][0] - died[0][0]
    resume = logged[first - 1]["time"] - restarted[0][0]
    print(
        f"engine restart: detect {detect:.2f} s, restart {restart:.2f} s "
        f"(engine/restart_s {logged[first - 1]['engine/restart_s']:.2f}), resume {resume:.2f} s "
        f"(to step {first}'s line); {restarted[0][1]}"
    )
