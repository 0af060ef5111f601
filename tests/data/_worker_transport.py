"""A receiver (or sender) process for tests/data/test_transport.py: one broadcast sync over gloo.

usage: python _worker_transport.py ROLE PORT RANK WORLD OUT_DIR [BUCKET_BYTES]
The layout and the tensors are rebuilt here from a fixed seed, the same way the test builds them.
"""

from __future__ import annotations

import pathlib
import sys

import torch

from rl_data import encode, pack_bucket, plan_buckets
from rl_data.sync import WeightSyncError
from rl_data.sync.broadcast import SyncGroup, broadcast_buckets, receive_buckets


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(97, 33, generator=generator),
        "layer.0.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
        "layer.0.weight": torch.randn(64, 48, generator=generator),
        "layer.1.weight": torch.randn(3000, generator=generator).to(torch.float16),
        "head.scale": torch.randn((), generator=generator),
    }


def layout(bucket_bytes: int = 8192):
    return plan_buckets(
        ((name, tensor.dtype, tensor.shape) for name, tensor in weights().items()), bucket_bytes=bucket_bytes
    )


def main() -> None:
    role, port, rank, world, out = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    bucket_bytes = int(sys.argv[6]) if len(sys.argv) > 6 else 8192
    out_dir = pathlib.Path(out)
    group = SyncGroup(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60)
    meta = layout(bucket_bytes)
    if role == "send":
        tensors = weights()

        try:
            for version in (1, 2):
                report = broadcast_buckets(
                    group,
                    meta,
                    lambda bucket, buffer: pack_bucket(bucket, tensors, out=buffer),
                    version=version,
                )
        except WeightSyncError as error:
            (out_dir / "error-0.txt").write_text(str(error))
            return
        (out_dir / "sent.msgpack").write_bytes(encode(report))
    else:
        received: dict[str, torch.Tensor] = {}
        try:
            for _ in (1, 2):
                report = receive_buckets(
                    group,
                    meta,
                    lambda bucket, views: received.update({k: v.clone() for k, v in views.items()}),
                )
        except WeightSyncError as error:
            (out_dir / f"error-{rank}.txt").write_text(str(error))
            return
        (out_dir / f"received-{rank}.msgpack").write_bytes(encode(report))
        (out_dir / f"tensors-{rank}.msgpack").write_bytes(encode(received))
    group.close()


if __name__ == "__main__":
    main()
