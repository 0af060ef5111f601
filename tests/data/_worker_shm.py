"""A sender or receiver process for tests/data/test_shm.py: the shm transport between processes.

usage:
  python _worker_shm.py send DIRECTORY OUT_DIR DELAY_S END VERSION...
      Waits DELAY_S, then publishes each VERSION (the tensors of `weights(version)`) with an
      `ShmPublisher` in DIRECTORY and writes OUT_DIR/sent-<version>.msgpack (its report). END
      says how it ends: "close" (a receiver takes part: each version after the first is
      published once the previous one was received, as a driver syncs, and the publisher is
      closed once the last one was), "exit" (return without closing, the
      finalizer runs at exit), "kill" (SIGKILL itself, nothing runs), "raise" (an exception).
  python _worker_shm.py recv DIRECTORY OUT_DIR VERSION...
      Reads each VERSION with an `ShmReader` (waiting for it) and writes
      OUT_DIR/received-<version>.msgpack (its report) and tensors-<version>.msgpack (copies).
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

import torch

from rl_data import encode, pack_bucket, plan_buckets
from rl_data.sync.shm import ShmPublisher, ShmReader


def weights(version: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes that differ per version (a fixed seed per version)."""
    generator = torch.Generator().manual_seed(100 + version)
    return {
        "embed.weight": torch.randn(97, 33, generator=generator),
        "layer.0.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
        "layer.0.weight": torch.randn(64, 48, generator=generator),
        "layer.1.weight": torch.randn(3000, generator=generator).to(torch.float16),
        "head.scale": torch.randn((), generator=generator),
    }


def layout(bucket_bytes: int = 8192):
    return plan_buckets(
        ((name, tensor.dtype, tensor.shape) for name, tensor in weights(0).items()), bucket_bytes=bucket_bytes
    )


def await_file(path: pathlib.Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def send(directory: str, out: pathlib.Path, delay_s: float, end: str, versions: list[int]) -> None:
    time.sleep(delay_s)
    publisher = ShmPublisher(directory, layout(), timeout_s=60)
    for index, version in enumerate(versions):
        if end == "close" and index > 0:  # lockstep, as the driver syncs: the previous one was received
            await_file(out / f"received-{versions[index - 1]}.msgpack")
        tensors = weights(version)
        report = publisher.publish(
            lambda b, buffer, tensors=tensors: pack_bucket(b, tensors, out=buffer), version=version
        )
        (out / f"sent-{version}.msgpack").write_bytes(encode(report))
    if end == "close":
        await_file(out / f"received-{versions[-1]}.msgpack")
        publisher.close()
    elif end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif end == "raise":
        raise RuntimeError("the sender failed on purpose")


def receive(directory: str, out: pathlib.Path, versions: list[int]) -> None:
    with ShmReader(directory, layout(), timeout_s=60) as reader:
        for version in versions:
            received: dict[str, torch.Tensor] = {}
            report = reader.read(
                lambda b, views, received=received: received.update({k: v.clone() for k, v in views.items()}),
                version=version,
            )
            (out / f"received-{version}.msgpack").write_bytes(encode(report))
            (out / f"tensors-{version}.msgpack").write_bytes(encode(received))


def main() -> None:
    role, directory, out = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    if role == "send":
        send(directory, out, float(sys.argv[4]), sys.argv[5], [int(v) for v in sys.argv[6:]])
    else:
        receive(directory, out, [int(v) for v in sys.argv[4:]])


if __name__ == "__main__":
    main()
