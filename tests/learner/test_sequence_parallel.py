"""Ulysses sequence parallelism (`rl_learner.sequence_parallel`): with two gloo ranks sharing each
packed micro-batch, log-probs, entropies, values, scores and every parameter gradient equal the
unsplit forward's to float32 rounding. The ranks run in subprocesses (`_worker_sequence_parallel.py`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from rl_data.transport import free_port

HERE = pathlib.Path(__file__).resolve().parent
TOLERANCE = 1e-5  # float32; gradients: relative to the largest gradient element when that exceeds 1


def run_ranks(
    worker: pathlib.Path, folder: pathlib.Path, world: int, *args: str, timeout: float = 600
) -> None:
    """Start `world` gloo ranks of `worker` (RANK/WORLD_SIZE/MASTER_* set), wait, fail with their logs."""
    port = free_port()
    started = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
        }
        log = open(folder / f"log{rank}.txt", "w")  # noqa: SIM115 (closed below)
        command = [sys.executable, str(worker), str(folder), *args]
        started.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for process, log in started:
        try:
            codes.append(process.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append("timeout")
        log.close()
    if any(code != 0 for code in codes):
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(folder.glob("log*.txt")))
        pytest.fail(f"{worker.name} ranks exited with {codes}\n{logs}")


@pytest.fixture(scope="module")
def diffs(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("sequence_parallel")
    run_ranks(HERE / "_worker_sequence_parallel.py", folder, 2)
    return [json.loads((folder / f"diffs{rank}.json").read_text()) for rank in range(2)]


def test_the_batch_has_a_sequence_longer_than_a_ranks_share(diffs):
    start, end = diffs[0]["local_range"]
    assert diffs[0]["longest"] > end - start
    assert diffs[0]["odd_num_tokens"] % 2 == 1  # the padded case is covered too


@pytest.mark.parametrize("rank", [0, 1])
def test_sequence_parallel_outputs_and_gradients_equal_the_unsplit_forward(diffs, rank):
    cases = {key: value for key, value in diffs[rank].items() if key.startswith(("policy/", "critic/"))}
    assert len(cases) == 14  # 2 attentions × (4 policy + 2 critic) + odd length + empty
    for key, case in cases.items():
        for quantity in ("logprobs", "entropy", "values", "scores"):
            if quantity in case:
                assert case[quantity] <= TOLERANCE, (key, quantity, case[quantity])
        assert case["gradients"] <= TOLERANCE * max(1.0, case["gradient_scale"]), (key, case)
    assert diffs[rank]["policy/sdpa/share=False/only_actions=False"]["nonzero_logprobs"] > 0


def test_heads_that_do_not_divide_by_sp_are_refused_by_name(diffs):
    assert "num_key_value_heads = 2, which is not divisible by 4" in diffs[0]["heads_error"]
