"""`PolicyLossConfig.old_logprobs_from_forward`: with one optimizer step per batch, the training
forward's own detached log-probs replace the separate old-log-prob forward exactly (rl-launch
skips that forward then). Real DeepSpeed on CPU, one rank, in a subprocess."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.learner.single_rank import single_rank_env

WORKER = pathlib.Path(__file__).resolve().parent / "_worker_old_from_forward.py"

# Every test reads the results of one DeepSpeed worker process (tens of seconds).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("old_from_forward")
    env = single_rank_env()
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def test_the_step_equals_the_one_with_a_separate_old_logprob_forward(results):
    separate, from_forward = results["separate"], results["from_forward"]
    assert from_forward["loss"] == pytest.approx(separate["loss"], abs=1e-7)
    assert from_forward["grad_norm"] == pytest.approx(separate["grad_norm"], rel=1e-6)
    assert from_forward["clip_fraction"] == separate["clip_fraction"] == 0.0  # ratio 1 either way
    assert results["max_weight_difference"] < 1e-7


def test_the_step_reports_the_engine_learner_mismatch_it_replaces(results):
    reported = results["from_forward"]["logprob_mismatch_mean"]
    assert reported == pytest.approx(results["expected_mismatch_mean"], rel=1e-5)
    assert results["from_forward"]["logprob_mismatch_max"] >= reported > 0


def test_a_model_with_dropout_is_refused(results):
    assert "dropout" in results["dropout_error"]
    assert "attention_dropout=0.1" in results["dropout_error"]
