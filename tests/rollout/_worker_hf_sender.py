"""The sender of tests/rollout/test_hf_engine.py's broadcast weight-sync tests (rank 0, gloo or NCCL).

usage: python _worker_hf_sender.py CHECKPOINT PORT OUT_DIR [BACKEND]
BACKEND: gloo (default; CPU buffers) or nccl (buffers on cuda:0; NCCL needs the receiver on another GPU).
Loads the checkpoint, perturbs every parameter deterministically (+0.01 · (arange % 7)), sends
the weights as version 5 with `broadcast_buckets` and writes its report to OUT_DIR/sent.msgpack.
"""

from __future__ import annotations

import pathlib
import sys

import torch

from rl_data import encode, pack_bucket, plan_buckets
from rl_data.sync.broadcast import SyncGroup, broadcast_buckets


def main() -> None:
    from transformers import AutoModelForCausalLM

    checkpoint, port, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
    backend = sys.argv[4] if len(sys.argv) > 4 else "gloo"
    device = "cuda:0" if backend == "nccl" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tensors = {
        name: param.detach() + 0.01 * (torch.arange(param.numel()).reshape(param.shape) % 7)
        for name, param in model.named_parameters()
    }
    layout = plan_buckets(
        ((name, torch.float32, t.shape) for name, t in tensors.items()), bucket_bytes=1 << 16
    )
    group = SyncGroup(
        host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=120, backend=backend, device=device
    )
    report = broadcast_buckets(
        group, layout, lambda bucket, buffer: pack_bucket(bucket, tensors, out=buffer), version=5
    )
    (out / "sent.msgpack").write_bytes(encode(report))
    group.close()


if __name__ == "__main__":
    main()
