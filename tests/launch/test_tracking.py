"""rl_launch.tracking: the metrics file, resume, argument checks, summary table, curves PNG,
missing optional backends, the phase timer and the progress bar."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time

import pytest

from rl_launch.tracking import PhaseTimer, Summary, Tracker, TrackingError


def strict_json(line: str) -> dict:
    def reject(constant: str) -> None:
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


def write_lines(path, records, torn_tail: str = "") -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + torn_tail)


def test_log_writes_one_strict_json_line_per_step_with_nan_and_inf_as_null(tmp_path):
    with Tracker(tmp_path / "run", total_steps=3, progress_bar=False) as tracker:
        tracker.log(1, {"reward/mean": 0.25, "count": 7})
        tracker.log(2, {"reward/mean": math.nan, "count": 8})
        tracker.log(3, {"reward/mean": math.inf, "loss": -math.inf})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [strict_json(line) for line in lines]
    assert [record["step"] for record in records] == [1, 2, 3]
    assert all(isinstance(record["time"], float) and record["time"] > 1e9 for record in records)
    assert {key: records[0][key] for key in ("reward/mean", "count")} == {"reward/mean": 0.25, "count": 7}
    assert isinstance(records[0]["count"], int)
    assert records[1]["reward/mean"] is None
    assert records[2] == {"step": 3, "time": records[2]["time"], "reward/mean": None, "loss": None}
    assert tracker.nonfinite == {"reward/mean": 2, "loss": 1}


def test_each_line_is_flushed_before_close(tmp_path):
    tracker = Tracker(tmp_path, total_steps=5, progress_bar=False)
    tracker.log(1, {"a": 1.5})
    tracker.log(2, {"a": 2.5})
    assert [strict_json(line)["a"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1.5,
        2.5,
    ]
    tracker.close()


def test_resume_keeps_lines_up_to_start_step_and_drops_a_torn_last_line(tmp_path):
    old = [{"step": step, "time": 1.0, "reward/mean": step / 10} for step in range(1, 6)]
    write_lines(tmp_path / "metrics.jsonl", old, torn_tail='{"step": 6, "time": 1.0, "rew')
    with Tracker(tmp_path, total_steps=10, start_step=3, progress_bar=False) as tracker:
        tracker.log(4, {"reward/mean": 0.9})
    records = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9)]
    summary = tracker.close()
    assert summary.steps == 4
    assert summary.first == {"reward/mean": 0.1}
    assert summary.last == {"reward/mean": 0.9}
    assert not list(tmp_path.glob(".metrics.jsonl.*")), "the temporary file is renamed, not left behind"


def test_restore_step_writes_the_checkpoints_line_only_where_the_file_lacks_it(tmp_path):
    from rl_launch.tracking import step_metrics

    kept = step_metrics({"reward/mean": 0.25, "count": 3, "kl": float("nan")})
    assert kept == {"reward/mean": 0.25, "count": 3, "kl": None}
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "time": 1.0, "reward/mean": 0.1}])
    with Tracker(tmp_path, total_steps=4, start_step=2, progress_bar=False) as tracker:
        tracker.restore_step(2, kept)  # killed after step 2's checkpoint, before its line
        tracker.log(3, {"reward/mean": 0.5})
    records = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 0.1), (2, 0.25), (3, 0.5)]
    assert records[1]["kl"] is None
    assert records[1]["count"] == 3

    with Tracker(tmp_path, total_steps=4, start_step=3, progress_bar=False) as tracker:
        tracker.restore_step(3, {"reward/mean": 9.0})  # the file has step 3: kept as it is
    records = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 0.1), (2, 0.25), (3, 0.5)]


def test_resume_drops_a_torn_last_line_even_when_all_steps_are_kept(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "time": 1.0, "a": 1}], torn_tail='{"step": 2, "ti')
    Tracker(tmp_path, total_steps=4, start_step=4, progress_bar=False).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step":1,"time":1.0,"a":1}\n'


def test_resume_rejects_a_corrupt_line_before_the_last_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 1.0}\nnot json\n{"step": 3, "time": 1.0}\n')
    with pytest.raises(TrackingError, match=r"metrics\.jsonl:2: not a JSON line"):
        Tracker(tmp_path, total_steps=5, start_step=2, progress_bar=False)
    assert path.read_text().splitlines()[1] == "not json", "the file is left as it was"


def test_start_step_zero_replaces_an_existing_metrics_file(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "time": 1.0, "old": 1.0}])
    with Tracker(tmp_path, total_steps=2, progress_bar=False) as tracker:
        tracker.log(1, {"new": 2.0})
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert "old" not in strict_json(line)
    assert strict_json(line)["new"] == 2.0


def test_non_increasing_step_is_rejected_naming_both_steps(tmp_path):
    with Tracker(tmp_path, total_steps=10, start_step=4, progress_bar=False) as tracker:
        with pytest.raises(TrackingError, match=r"step 4 must be greater than the start step 4"):
            tracker.log(4, {"a": 1.0})
        tracker.log(6, {"a": 1.0})
        with pytest.raises(TrackingError, match=r"step 6 must be greater than the last logged step 6"):
            tracker.log(6, {"a": 1.0})
        with pytest.raises(TrackingError, match=r"step 5 must be greater than the last logged step 6"):
            tracker.log(5, {"a": 1.0})
    assert tracker.close().steps == 1


def test_a_fresh_run_may_log_step_zero_first_and_only_first(tmp_path):
    with Tracker(tmp_path, total_steps=3, progress_bar=False) as tracker:
        tracker.log(0, {"eval/reward/mean": 0.1})  # before any update
        with pytest.raises(TrackingError, match=r"step 0 must be greater than the last logged step 0"):
            tracker.log(0, {"eval/reward/mean": 0.1})
        tracker.log(1, {"reward/mean": 0.5, "eval/reward/mean": 0.4})
    summary = tracker.close()
    assert summary.steps == 1  # training steps; step 0 is what came before
    assert summary.first["eval/reward/mean"] == 0.1
    resumed = Tracker(tmp_path, total_steps=3, start_step=1, progress_bar=False)
    with pytest.raises(TrackingError, match=r"step 0 must be greater than the start step 1"):
        resumed.log(0, {"a": 1.0})
    resumed.close()


@pytest.mark.parametrize(
    ("value", "type_name"), [("0.5", "str"), (None, "NoneType"), (True, "bool"), ([1.0], "list")]
)
def test_non_number_value_is_rejected_naming_the_key_and_nothing_is_written(tmp_path, value, type_name):
    with Tracker(tmp_path, total_steps=3, progress_bar=False) as tracker:
        with pytest.raises(
            TrackingError, match=rf"step 1: metric 'loss/policy' has value .* of type {type_name}"
        ):
            tracker.log(1, {"reward/mean": 1.0, "loss/policy": value})
        tracker.log(1, {"reward/mean": 1.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_numpy_and_torch_scalars_are_numbers_but_tensors_are_not(tmp_path):
    import numpy as np
    import torch

    with Tracker(tmp_path, total_steps=3, progress_bar=False) as tracker:
        tracker.log(1, {"a": np.float32(0.5), "b": np.int64(3)})
        with pytest.raises(
            TrackingError, match=r"metric 'c' .* type Tensor; expected a float or int \(call \.item"
        ):
            tracker.log(2, {"c": torch.tensor(1.0)})
    assert strict_json((tmp_path / "metrics.jsonl").read_text())["b"] == 3


def test_reserved_and_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(TrackingError, match=r"start_step 5 is beyond total_steps 3"):
        Tracker(tmp_path, total_steps=3, start_step=5)
    with pytest.raises(TrackingError, match=r"total_steps must be >= 0, got -1"):
        Tracker(tmp_path, total_steps=-1)
    tracker = Tracker(tmp_path, total_steps=3, progress_bar=False)
    with pytest.raises(TrackingError, match=r"metric name 'time' is reserved"):
        tracker.log(1, {"time": 1.0})
    tracker.close()
    with pytest.raises(TrackingError, match=r"step 2: the tracker is closed"):
        tracker.log(2, {"a": 1.0})


def test_summary_table_golden_values(tmp_path):
    series = {
        "reward/mean": [0.1, 0.5, 0.3],
        "time/step": [2.0, 3.0, 4.5],
        "loss/policy": [-1.0, -0.5, -0.25],
        "kl/mean": [0.01, math.nan, 0.0123456],
    }
    with Tracker(tmp_path, total_steps=3, progress_bar=False) as tracker:
        for index in range(3):
            tracker.log(index + 1, {key: values[index] for key, values in series.items()})
    summary = tracker.close()
    expected = "\n".join(
        [
            "metric       first     last   min      max     mean",
            "reward/mean    0.1      0.3   0.1      0.5      0.3",
            "kl/mean       0.01  0.01235  0.01  0.01235  0.01117",
            "time/step        2      4.5     2      4.5    3.167",
            "loss/policy     -1    -0.25    -1    -0.25  -0.5833",
            "non-finite values (null in metrics.jsonl, left out of min/max/mean): kl/mean 1",
        ]
    )
    assert summary.table == expected
    assert (tmp_path / "summary.txt").read_text() == expected + "\n"
    assert summary.first == {"reward/mean": 0.1, "time/step": 2.0, "loss/policy": -1.0, "kl/mean": 0.01}
    assert summary.last == {"reward/mean": 0.3, "time/step": 4.5, "loss/policy": -0.25, "kl/mean": 0.0123456}
    assert summary.nonfinite == {"kl/mean": 1}
    assert summary.steps == 3
    assert summary.metrics_path == str(tmp_path / "metrics.jsonl")


def test_close_is_idempotent_and_prints_the_headline_rows_on_stdout(tmp_path, capsys):
    with Tracker(tmp_path, total_steps=1, progress_bar=False) as tracker:
        tracker.log(1, {"reward/mean": 0.5, "time/training": 2.0, "policy/grad_norm": 1.5})
    summary = tracker.close()
    assert tracker.close() is summary
    assert isinstance(summary, Summary)
    out = capsys.readouterr().out
    assert out.count("summary of 1 steps") == 1
    assert str(tmp_path / "summary.txt") in out
    assert "reward/mean" in out
    assert "time/training" in out
    assert "policy/grad_norm" not in out  # only in summary.txt
    assert "policy/grad_norm" in summary.table
    assert summary.table in (tmp_path / "summary.txt").read_text()


def test_curves_png_is_a_valid_image(tmp_path):
    from matplotlib.image import imread

    with Tracker(tmp_path, total_steps=20, progress_bar=False) as tracker:
        for step in range(1, 21):
            metrics = {"reward/mean": step / 20, "kl/mean": 0.001 * step}
            if step % 5 == 0:
                metrics["eval/reward/mean"] = step / 25
            tracker.log(step, metrics)
    summary = tracker.close()
    path = tmp_path / "curves.png"
    assert summary.plot_path == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    image = imread(path)
    assert image.shape == (600, 800, 4)
    assert image[..., :3].std() > 0.05, "the image is not blank"


def test_curves_png_without_kl_still_draws_and_no_steps_gives_no_plot(tmp_path):
    with Tracker(tmp_path / "reward_only", total_steps=2, progress_bar=False) as tracker:
        tracker.log(1, {"reward/mean": 1.0})
    assert tracker.close().plot_path == str(tmp_path / "reward_only" / "curves.png")
    empty = Tracker(tmp_path / "empty", total_steps=2, progress_bar=False).close()
    assert empty.plot_path is None
    assert empty.steps == 0
    assert empty.table == "no metrics logged"
    assert not (tmp_path / "empty" / "curves.png").exists()


def test_tensorboard_requested_but_not_installed_fails_before_touching_the_metrics_file(tmp_path):
    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed")
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "time": 1.0}])
    with pytest.raises(
        TrackingError, match=r"log\.use_tensorboard .* pip install 'rl-launch\[tensorboard\]'"
    ):
        Tracker(tmp_path, total_steps=3, tensorboard=True)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "time": 1.0}\n'


def test_wandb_requested_but_not_installed_raises_naming_option_and_extra(tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    with pytest.raises(
        TrackingError, match=r"log\.use_wandb .* wandb package .* pip install 'rl-launch\[wandb\]'"
    ):
        Tracker(tmp_path, total_steps=3, wandb=True)


def test_phase_timer_accumulates_repeated_phases_in_order_of_first_use():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("generation"):
            time.sleep(0.002)
        with timer.phase("training"):
            time.sleep(0.001)
    with timer.phase("sync"):
        pass
    metrics = timer.metrics()
    assert list(metrics) == ["time/generation", "time/training", "time/sync", "time/step"]
    assert metrics["time/generation"] >= 0.004
    assert metrics["time/training"] >= 0.002
    assert metrics["time/step"] == math.fsum(
        metrics[k] for k in ("time/generation", "time/training", "time/sync")
    )
    assert list(timer.metrics(prefix="t.")) == ["t.generation", "t.training", "t.sync", "t.step"]
    timer.reset()
    assert timer.metrics() == {}


def test_phase_timer_counts_a_phase_that_raised_and_rejects_nesting_a_phase_in_itself():
    timer = PhaseTimer()
    with pytest.raises(KeyError), timer.phase("generation"):
        raise KeyError("boom")
    assert timer.metrics()["time/generation"] > 0
    with (
        timer.phase("training"),
        pytest.raises(TrackingError, match=r"'training' is already running"),
        timer.phase("training"),
    ):
        pass
    with pytest.raises(TrackingError, match=r"'step' is reserved"), timer.phase("step"):
        pass


def test_progress_bar_disabled_writes_nothing_to_stderr(tmp_path, capsys):
    with Tracker(tmp_path, total_steps=3, progress_bar=False) as tracker:
        for step in (1, 2, 3):
            tracker.log(step, {"reward/mean": 0.412, "time/step": 3.1})
    assert capsys.readouterr().err == ""


def test_progress_bar_shows_reward_kl_and_step_time(tmp_path, capsys):
    with Tracker(tmp_path, total_steps=4, start_step=1, progress_bar=True) as tracker:
        tracker.log(2, {"reward/mean": 0.41234, "kl/mean": 0.0123456, "time/step": 3.14})
        tracker.log(4, {"reward/mean": 0.5})
    err = capsys.readouterr().err
    # The bar redraws at most every 0.1 s; its last line (drawn by close) has the last values,
    # keeping kl and step time from step 2 because step 4 did not log them.
    assert "4/4" in err
    assert err.rstrip().endswith("reward=0.500 kl=0.0123 step=3.1s]")


def test_importing_the_module_imports_no_plotting_or_tracking_backend():
    code = (
        "import sys, rl_launch; before = set(sys.modules); import rl_launch.tracking; "
        "print(sorted(m for m in set(sys.modules) - before "
        "if m.split('.')[0] in ('torch', 'matplotlib', 'tensorboard', 'wandb')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_completions_go_to_their_own_file_and_a_resume_drops_the_lines_after_its_step(tmp_path):
    with Tracker(tmp_path, total_steps=4, progress_bar=False) as tracker:
        for step in (1, 2, 3):
            tracker.log(step, {"reward/mean": 0.5})
            tracker.log_completions(
                step, [{"prompt": f"p{step}", "reward": 1.0}, {"prompt": "q", "reward": 0.0}]
            )
    lines = [strict_json(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(line["step"], line["prompt"]) for line in lines] == [
        (1, "p1"), (1, "q"), (2, "p2"), (2, "q"), (3, "p3"), (3, "q")
    ]  # fmt: skip
    with Tracker(tmp_path, total_steps=4, start_step=2, progress_bar=False) as tracker:
        tracker.log(3, {"reward/mean": 0.7})
        tracker.log_completions(3, [{"prompt": "again"}])
    lines = [strict_json(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(line["step"], line["prompt"]) for line in lines] == [
        (1, "p1"),
        (1, "q"),
        (2, "p2"),
        (2, "q"),
        (3, "again"),
    ]
