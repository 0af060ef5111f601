"""Experiment tracking for the training loops: metrics file, progress bar, optional backends, summary.

A loop logs one mapping of float metrics per training step; `Tracker` sends it everywhere it
should go, and `PhaseTimer` measures where the step's wall-clock time went:

    timer = PhaseTimer()
    with Tracker(out, total_steps=100, start_step=resumed_step, tensorboard=cfg.log.use_tensorboard) as tracker:
        for step in range(resumed_step + 1, 101):
            timer.reset()
            with timer.phase("generation"):
                ...
            with timer.phase("training"):
                ...
            tracker.log(step, {**train_metrics, **timer.metrics()})
    # tracker.close() ran on exit: summary.txt and curves.png are in `out`

Where the metrics go:
- `output_dir/metrics.jsonl`, the record of the run: one strict JSON object per `log` call,
  `{"step": step, "time": unix seconds, **metrics}`, flushed after every line so that a killed
  run keeps every step it logged. NaN and ±inf are written as `null` (strict JSON has neither)
  and counted per key.
- a tqdm progress bar on stderr whose postfix shows `reward/mean`, `kl/mean` and `time/step`.
- TensorBoard (`output_dir/tensorboard`) and Weights & Biases, each only when asked for; asking
  for one whose package is not installed fails in `Tracker.__init__`, before any long work.

Resume. A run restarted from the checkpoint of step k passes `start_step=k`: the metrics file
keeps only the lines with step <= k (the killed run may have logged steps after its last
checkpoint, which the resumed run logs again) and loses a torn last line (the kill came in the
middle of a write). The file is rewritten atomically (temporary file, then `os.replace`). A step's
checkpoint is written before its line, so a checkpoint keeps the line (`step_metrics`) and
`Tracker.restore_step` writes it when the kill came between the two.

Summary. `Tracker.close` reads the whole metrics file back, so a resumed run is summarised over
all its steps, and writes `summary.txt` (per metric: first, last, min, max and mean of the finite
values) and `curves.png` (reward and KL against step; the policy's entropy where no KL is logged). The console gets the headline rows of
that table: rewards, KL, response length and where the step time went.

Importing this module imports neither torch, matplotlib, tensorboard nor wandb: each is imported
by the function that needs it.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
from tqdm import tqdm

__all__ = [
    "PhaseTimer",
    "StartupLines",
    "Summary",
    "Tracker",
    "TrackingError",
    "print_outputs",
    "quiet_third_party_output",
    "third_party_bars_off",
]

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
SUMMARY_FILE = "summary.txt"
PLOT_FILE = "curves.png"
TENSORBOARD_DIR = "tensorboard"

_RESERVED_KEYS = ("step", "time")
# Shown first in the summary table, in this order; the other keys follow sorted.
_LEADING_KEYS = ("reward/mean", "kl/mean", "time/step")
# The rows of the summary printed on the console (with every time/* row); summary.txt has them all.
_HEADLINE_KEYS = (
    "reward/mean",
    "eval/reward/mean",
    "kl/mean",
    "distill/kl_to_teacher",
    "response_length/mean",
)
_TABLE_COLUMNS = ("metric", "first", "last", "min", "max", "mean")
# Progress-bar postfix, in this order: (metric key, label, format spec, unit).
_POSTFIX = (
    ("reward/mean", "reward", ".3f", ""),
    ("kl/mean", "kl", ".3g", ""),
    ("time/step", "step", ".1f", "s"),
)


class TrackingError(RuntimeError):
    """A tracking backend was asked for but is not installed, or a tracking call got a bad argument."""


class StartupLines:
    """One console line per start-up phase, with the seconds it took: `prefix: text (1.2 s)`."""

    def __init__(self, prefix: str, stream: Any = None) -> None:
        self.prefix = prefix
        self.stream = stream
        self._since = time.perf_counter()

    def say(self, text: str) -> None:
        now = time.perf_counter()
        print(
            f"{self.prefix}: {text} ({now - self._since:.1f} s)", file=self.stream or sys.stdout, flush=True
        )
        self._since = now

    def warn(self, text: str) -> None:
        """A line on stderr at any time of the run (`prefix: text`), e.g. a stalled dependency."""
        print(f"{self.prefix}: {text}", file=sys.stderr, flush=True)


def quiet_third_party_output() -> None:
    """Turn off the progress bars and INFO chatter of transformers and datasets in this process
    (saving shards, generating splits), so the console keeps the run's own lines."""
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    with contextlib.suppress(ImportError):
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


@contextlib.contextmanager
def third_party_bars_off() -> Iterator[None]:
    """transformers' progress bars (and the Hugging Face hub's, which they switch with them) off
    for the block and as they were after it: a preset's build saves its model without "Writing
    model shards 0% ... 100%" on the console, and a caller's own bars come back."""
    try:
        from huggingface_hub import utils as hub_utils
        from transformers.utils import logging as transformers_logging
    except ImportError:
        yield
        return
    bars_on, hub_bars_off = (
        transformers_logging.is_progress_bar_enabled(),
        hub_utils.are_progress_bars_disabled(),
    )
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars_on:
            transformers_logging.enable_progress_bar()
            if hub_bars_off:
                hub_utils.disable_progress_bars()


class PhaseTimer:
    """Wall-clock seconds per named phase of one step (generation, experience, training, sync, ...).

    `phase(name)` accumulates `time.perf_counter()` seconds under `name`, so a phase entered
    several times in one step (one generation per prompt batch, say) reports its total.
    `metrics()` returns `{prefix + name: seconds}` in order of first use plus
    `prefix + "step"`, the sum over phases; call `reset()` at the start of every step.
    Phases of different names may nest, but then their time is counted twice in the sum.
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._open: set[str] = set()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not name:
            raise TrackingError(f"PhaseTimer.phase: name must be a non-empty string, got {name!r}")
        if name == "step":
            raise TrackingError("PhaseTimer.phase: name 'step' is reserved for the total of all phases")
        if name in self._open:
            raise TrackingError(f"PhaseTimer.phase: phase {name!r} is already running (nested in itself)")
        self._open.add(name)
        self._seconds.setdefault(name, 0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start
            self._open.discard(name)

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        """`{prefix + phase: seconds, ..., prefix + "step": sum}`; empty when no phase ran."""
        if not self._seconds:
            return {}
        result = {f"{prefix}{name}": seconds for name, seconds in self._seconds.items()}
        result[f"{prefix}step"] = math.fsum(self._seconds.values())
        return result

    def reset(self) -> None:
        if self._open:
            raise TrackingError(f"PhaseTimer.reset: phases {sorted(self._open)} are still running")
        self._seconds.clear()


class Summary(msgspec.Struct):
    """What `Tracker.close` returns, computed from the whole metrics file.

    `steps`: number of logged steps; `table`: the text of `summary.txt`; `plot_path`: the curves
    PNG, None when no step was logged; `metrics_path`: the metrics file; `first` / `last`: the
    first and last logged value of every key (NaN where `null` was logged); `nonfinite`: per key,
    how many values were NaN or ±inf (keys with none are left out).
    """

    steps: int
    table: str
    plot_path: str | None
    metrics_path: str
    first: dict[str, float]
    last: dict[str, float]
    nonfinite: dict[str, int] = {}


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TrackingError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise TrackingError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _import_backend(module: str, option: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise TrackingError(
            f"{option} is on but the {module} package is not installed: pip install 'rl-launch[{extra}]'"
        ) from error


def _read_records(path: pathlib.Path) -> list[dict[str, Any]]:
    """The records of a metrics file, in file order; a torn last line is dropped.

    A line that does not parse is a torn write only when it is the last line; anywhere else the
    file is corrupt and a TrackingError names the file and the line.
    """
    lines = path.read_bytes().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = msgspec.json.decode(line)
        except msgspec.DecodeError as error:
            if number == len(lines):
                break
            raise TrackingError(f"{path}:{number}: not a JSON line ({error})") from error
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise TrackingError(
                f"{path}:{number}: expected a JSON object with an int 'step', got {line[:80]!r}"
            )
        records.append(record)
    return records


def step_metrics(metrics: Mapping[str, Any]) -> dict[str, float | int | None]:
    """A step's metrics as plain JSON numbers (non-finite as None), to keep in the step's
    checkpoint for `Tracker.restore_step`."""
    plain: dict[str, float | int | None] = {}
    for key, value in metrics.items():
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            plain[key] = int(value)
        elif isinstance(value, numbers.Real):
            plain[key] = float(value) if math.isfinite(float(value)) else None
    return plain


def _as_float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _format_number(value: float) -> str:
    return f"{value:.4g}"


def _table_keys(records: list[dict[str, Any]], leading_keys: Sequence[str] = _LEADING_KEYS) -> list[str]:
    keys = {key for record in records for key in record if key not in _RESERVED_KEYS}
    leading = [key for key in leading_keys if key in keys]
    return leading + sorted(keys - set(leading))


def _summary_table(keys: list[str], records: list[dict[str, Any]], nonfinite: dict[str, int]) -> str:
    if not keys:
        return "no metrics logged"
    rows = []
    for key in keys:
        values = [_as_float(record[key]) for record in records if key in record]
        finite = [value for value in values if math.isfinite(value)]
        if finite:
            low, high, mean = min(finite), max(finite), math.fsum(finite) / len(finite)
        else:
            low = high = mean = math.nan
        rows.append([key, *(_format_number(value) for value in (values[0], values[-1], low, high, mean))])
    widths = [max(len(row[column]) for row in [list(_TABLE_COLUMNS), *rows]) for column in range(6)]

    def render(cells: list[str]) -> str:
        numbers_part = "  ".join(cell.rjust(width) for cell, width in zip(cells[1:], widths[1:]))
        return f"{cells[0].ljust(widths[0])}  {numbers_part}"

    lines = [render(list(_TABLE_COLUMNS)), *(render(row) for row in rows)]
    if nonfinite:
        counts = ", ".join(f"{key} {count}" for key, count in nonfinite.items())
        lines.append(f"non-finite values (null in {METRICS_FILE}, left out of min/max/mean): {counts}")
    return "\n".join(lines)


def _plot_curves(
    path: pathlib.Path, records: list[dict[str, Any]], headline: Sequence[str] | None = None
) -> None:
    # Figure + FigureCanvasAgg draws without pyplot, so the process-wide backend stays untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def series(key: str) -> tuple[list[int], list[float]]:
        pairs = [(record["step"], _as_float(record[key])) for record in records if key in record]
        return [step for step, _ in pairs], [value for _, value in pairs]

    figure = Figure(figsize=(8, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    reward_axes, lower_axes = figure.subplots(2, 1, sharex=True)
    # A run without a KL (no reference model) shows its KL to a distillation teacher below, or
    # else the policy's entropy
    has_kl = any("kl/mean" in record for record in records)
    has_teacher = any("distill/kl_to_teacher" in record for record in records)
    has_entropy = any("policy/entropy" in record for record in records)
    lower = ("KL", "kl/mean") if has_kl or not has_entropy else ("policy entropy", "policy/entropy")
    if has_teacher and not has_kl:
        lower = ("KL to the teacher", "distill/kl_to_teacher")
    panels = (
        (reward_axes, "reward", "reward/mean", "eval/reward/mean"),
        (lower_axes, *lower, None),
    )
    if headline:  # another loop's own metrics: its first two headline keys
        keys = [*headline[:2], *headline[:1]][:2]
        panels = ((reward_axes, keys[0], keys[0], None), (lower_axes, keys[1], keys[1], None))
    for axes, title, key, points_key in panels:
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.set_ylabel(key)
        axes.grid(True, alpha=0.3)
        steps, values = series(key)
        if steps:
            axes.plot(steps, values, label=key)
        if points_key is not None:
            point_steps, point_values = series(points_key)
            if point_steps:
                axes.plot(point_steps, point_values, "o", label=points_key)
        if steps or (points_key is not None and series(points_key)[0]):
            axes.legend(loc="best")
        else:
            axes.text(0.5, 0.5, "no data", transform=axes.transAxes, ha="center", va="center")
    figure.savefig(path)


class Tracker:
    """Logs one mapping of metrics per step to the metrics file, the progress bar and the backends.

    Arguments: `output_dir` (created), `total_steps` and `start_step` (the bar's total and
    starting point; `start_step > 0` resumes, see the module docstring), `progress_bar`,
    `tensorboard` / `wandb` (backends, each needs its `rl-launch[...]` extra), `wandb_project`
    (default "rl-launch"), `wandb_entity`, `wandb_group`, `run_name` and `config` (passed to
    `wandb.init`), `tensorboard_dir` (None: `<output_dir>/tensorboard`), and `headline`: the
    metric keys of a loop other than ppo's (e.g. ("sft/loss",)); they then lead the summary, make
    its console rows, the progress-bar postfix (with time/step) and the panels of curves.png.
    Use as a context manager or call `close()` (idempotent) at the end.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        total_steps: int,
        start_step: int = 0,
        progress_bar: bool = True,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        headline: Sequence[str] | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
        wandb_entity: str | None = None,
        wandb_group: str | None = None,
    ) -> None:
        total_steps = _check_int("Tracker: total_steps", total_steps, 0)
        start_step = _check_int("Tracker: start_step", start_step, 0)
        if start_step > total_steps:
            raise TrackingError(f"Tracker: start_step {start_step} is beyond total_steps {total_steps}")
        # Backends first: a missing package must fail before the metrics file is touched.
        summary_writer_class = None
        wandb_module = None
        if tensorboard:
            _import_backend("tensorboard", "log.use_tensorboard", "tensorboard")
            summary_writer_class = _import_backend(
                "torch.utils.tensorboard", "log.use_tensorboard", "tensorboard"
            ).SummaryWriter
        if wandb:
            wandb_module = _import_backend("wandb", "log.use_wandb", "wandb")

        self.output_dir = pathlib.Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.start_step = start_step
        self.total_steps = total_steps
        self.last_step: int | None = None
        self.nonfinite: dict[str, int] = {}
        self._summary: Summary | None = None
        self._tensorboard = None
        self._wandb_run = None
        self._completions: Any = None

        self._kept_last_step: int | None = None  # on resume: the last step the metrics file kept
        if start_step > 0 and self.metrics_path.exists():
            kept = self._truncate_lines(start_step)
            self._kept_last_step = kept[-1]["step"] if kept else None
            self._file = open(self.metrics_path, "ab")  # noqa: SIM115 (open for the tracker's lifetime)
        else:
            self._file = open(self.metrics_path, "wb")  # noqa: SIM115
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            file=sys.stderr,
            disable=not progress_bar,
            dynamic_ncols=True,
        )
        self._bar_position = start_step
        self.headline = tuple(headline) if headline else None
        self._postfix_spec = _POSTFIX
        if self.headline:
            self._postfix_spec = (
                *((key, key.rsplit("/", 1)[-1], ".4g", "") for key in self.headline),
                ("time/step", "step", ".1f", "s"),
            )
        self._postfix = {key: "" for key, _, _, _ in self._postfix_spec}  # fixes the order of the postfix
        try:
            if summary_writer_class is not None:
                events = self.output_dir / TENSORBOARD_DIR if tensorboard_dir is None else tensorboard_dir
                self._tensorboard = summary_writer_class(str(events))
            if wandb_module is not None:
                self._wandb_run = wandb_module.init(
                    project=wandb_project or "rl-launch",
                    entity=wandb_entity,
                    group=wandb_group,
                    name=run_name,
                    config=dict(config or {}),
                    dir=str(self.output_dir),
                )
        except BaseException:
            self._close_backends(exit_code=1)
            raise

    @classmethod
    def for_run(cls, config: Any, *, start_step: int, headline: Sequence[str] | None = None) -> Tracker:
        """The tracker of a command's run: `log.output_dir`, `train.max_steps` and the `log.*`
        switches of its config (progress bar, TensorBoard, wandb, run name)."""
        log = config.log
        return cls(
            log.output_dir,
            total_steps=config.train.max_steps,
            start_step=start_step,
            progress_bar=log.progress_bar,
            tensorboard=log.use_tensorboard,
            wandb=log.use_wandb,
            wandb_project=log.wandb_project,
            run_name=log.run_name,
            config=msgspec.to_builtins(config),
            headline=headline,
            tensorboard_dir=log.tensorboard_dir,
            wandb_entity=log.wandb_entity,
            wandb_group=log.wandb_group,
        )

    def _truncate_lines(self, start_step: int, path: pathlib.Path | None = None) -> list[dict[str, Any]]:
        path = path or self.metrics_path
        records = _read_records(path)
        kept = [record for record in records if record["step"] <= start_step]
        with tempfile.NamedTemporaryFile(
            "wb", dir=self.output_dir, prefix=f".{path.name}.", suffix=".tmp", delete=False
        ) as temporary:
            for record in kept:
                temporary.write(msgspec.json.encode(record) + b"\n")
            temporary.flush()
            os.fsync(temporary.fileno())
        os.replace(temporary.name, path)
        return kept

    def restore_step(self, step: int, metrics: Mapping[str, float | int | None] | None) -> None:
        """On resume from the checkpoint of `step` (= `start_step`): write the line of `step` that
        the checkpoint kept (`metrics`, as `step_metrics` returns it) when the metrics file lacks
        it, i.e. the process was killed after the checkpoint was written and before its line was."""
        if not metrics or step != self.start_step or step <= 0 or self.last_step is not None:
            return
        if self._kept_last_step is not None and self._kept_last_step >= step:
            return
        self._file.write(msgspec.json.encode({"step": step, "time": time.time(), **metrics}) + b"\n")
        self._file.flush()

    def log_completions(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append `{"step": step, **row}` per row to `output_dir/completions.jsonl` (flushed); on
        resume, the lines after `start_step` are dropped first, as for the metrics file."""
        if self._completions is None:
            path = self.output_dir / COMPLETIONS_FILE
            if self.start_step > 0 and path.exists():
                self._truncate_lines(self.start_step, path)
                self._completions = open(path, "ab")  # noqa: SIM115 (open for the tracker's lifetime)
            else:
                self._completions = open(path, "wb")  # noqa: SIM115
        for row in rows:
            self._completions.write(msgspec.json.encode({"step": step, **row}) + b"\n")
        self._completions.flush()

    def _clean_metrics(self, step: int, metrics: Mapping[str, float | int]) -> dict[str, float | int | None]:
        if not isinstance(metrics, Mapping):
            raise TrackingError(
                f"log: metrics must be a mapping of name to number, got {type(metrics).__name__}"
            )
        clean: dict[str, float | int | None] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key:
                raise TrackingError(f"log: step {step}: metric names must be non-empty strings, got {key!r}")
            if key in _RESERVED_KEYS:
                raise TrackingError(
                    f"log: step {step}: metric name {key!r} is reserved (reserved: {_RESERVED_KEYS})"
                )
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TrackingError(
                    f"log: step {step}: metric {key!r} has value {value!r} of type {type(value).__name__}; "
                    "expected a float or int (call .item() on tensors)"
                )
            if isinstance(value, numbers.Integral):
                clean[key] = int(value)
                continue
            number = float(value)
            if math.isfinite(number):
                clean[key] = number
            else:
                clean[key] = None
                if key not in self.nonfinite:
                    self.message(f"warning: step {step}: metric {key!r} is {number} (written as null)")
                self.nonfinite[key] = self.nonfinite.get(key, 0) + 1
        return clean

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        """Write one step's metrics to the file (flushed), the bar and the backends.

        Steps must increase; a fresh run may log step 0 first (what it measured before training).
        """
        if self._summary is not None:
            raise TrackingError(f"log: step {step}: the tracker is closed")
        step = _check_int("log: step", step, 0)
        previous = self.last_step if self.last_step is not None else self.start_step
        before_training = (
            step == self.start_step == 0 and self.last_step is None
        )  # e.g. an eval before any update
        if step <= previous and not before_training:
            what = "last logged step" if self.last_step is not None else "start step"
            raise TrackingError(f"log: step {step} must be greater than the {what} {previous}")
        clean = self._clean_metrics(step, metrics)
        self._file.write(msgspec.json.encode({"step": step, "time": time.time(), **clean}) + b"\n")
        self._file.flush()
        self.last_step = step

        # The postfix keeps the last value seen of each key, so a step without one does not blank it.
        for key, label, spec, unit in self._postfix_spec:
            if clean.get(key) is not None:
                self._postfix[key] = f"{label}={clean[key]:{spec}}{unit}"
        postfix = " ".join(text for text in self._postfix.values() if text)
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(step - self._bar_position)
        self._bar_position = step

        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, float(value), step)
        if self._wandb_run is not None:
            self._wandb_run.log({key: float(value) for key, value in metrics.items()}, step=step)

    def message(self, text: str) -> None:
        """Print a line on stdout without breaking the progress bar."""
        tqdm.write(text, file=sys.stdout)

    def _close_backends(self, exit_code: int) -> None:
        self._bar.close()
        self._file.close()
        if self._completions is not None:
            self._completions.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=exit_code)
            self._wandb_run = None

    def close(self, *, exit_code: int = 0) -> Summary:
        """Close bar, file and backends; write summary.txt and curves.png; return the Summary.

        Calling it again returns the same Summary. `exit_code` is passed to `wandb` (non-zero
        marks the run failed; the context manager passes 1 when the block raised).
        """
        if self._summary is not None:
            return self._summary
        self._close_backends(exit_code)
        records = _read_records(self.metrics_path)
        keys = _table_keys(records, (*self.headline, "time/step") if self.headline else _LEADING_KEYS)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        nonfinite: dict[str, int] = {}
        for record in records:
            for key, value in record.items():
                if key in _RESERVED_KEYS:
                    continue
                number = _as_float(value)
                first.setdefault(key, number)
                last[key] = number
                if not math.isfinite(number):
                    nonfinite[key] = nonfinite.get(key, 0) + 1
        nonfinite = {key: nonfinite[key] for key in keys if key in nonfinite}
        table = _summary_table(keys, records, nonfinite)
        (self.output_dir / SUMMARY_FILE).write_text(table + "\n")
        plot_path = None
        if records:
            plot_path = self.output_dir / PLOT_FILE
            _plot_curves(plot_path, records, self.headline)
        steps = sum(record["step"] > 0 for record in records)  # step 0: measured before training
        headline = [
            key for key in keys if key in (self.headline or _HEADLINE_KEYS) or key.startswith("time/")
        ]
        self.message(
            f"summary of {steps} steps (every metric: {self.output_dir / SUMMARY_FILE}):\n"
            + _summary_table(headline, records, nonfinite)
        )
        self._summary = Summary(
            steps=steps,
            table=table,
            plot_path=None if plot_path is None else str(plot_path),
            metrics_path=str(self.metrics_path),
            first=first,
            last=last,
            nonfinite=nonfinite,
        )
        return self._summary

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


def print_outputs(
    output_dir: pathlib.Path,
    summary: Summary,
    ckpt_root: pathlib.Path,
    *,
    final: pathlib.Path | None = None,
    log_dir: str | None = None,
) -> None:
    """The closing lines of a run: where its metrics, plot, checkpoints, model and logs are."""
    print(f"outputs in {output_dir.resolve()}:")
    print(f"  metrics   {pathlib.Path(summary.metrics_path).resolve()}")
    if summary.plot_path:
        print(f"  plot      {pathlib.Path(summary.plot_path).resolve()}")
    print(f"  checkpoints {ckpt_root.resolve()}")
    if final is not None:
        print(f"  model     {final.resolve()}")
    if log_dir is not None:
        print(f"  actor logs {pathlib.Path(log_dir).resolve()}")
