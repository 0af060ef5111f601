"""A weight-sync sender process for rollout tests: the learner's side of a broadcast sync, without rl_learner.

usage: python _worker_sender.py CHECKPOINT SPEC_FILE REPORT_DIR VERSION[:SEED] [VERSION[:SEED] ...]

It loads the checkpoint with transformers, reads the encoded `WeightSyncSpec` from SPEC_FILE
(the same spec the engines get), joins the sync group as rank 0 and, for each VERSION, sends
`perturbed_state(checkpoint, SEED)` (SEED defaults to VERSION) with `broadcast_buckets` +
`pack_bucket`, writing the sender's `WeightSyncReport` to REPORT_DIR/sent-VERSION.msgpack.
SEED 0 sends the checkpoint's own weights (`3:0`: version 3 restores the original weights). Tests import `perturbed_state` and `plan_layout` from this file to
build the receiving side's expectations the same way.
"""

from __future__ import annotations

import pathlib
import sys

import torch

from rl_data import decode, encode, pack_bucket, plan_buckets
from rl_data.sync import WeightSyncSpec
from rl_data.sync.broadcast import SyncGroup, broadcast_buckets

PERTURBATION_SCALE = 0.05


def checkpoint_state(checkpoint: str | pathlib.Path) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters (transformers names, float32), in `named_parameters` order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def perturbed_state(checkpoint: str | pathlib.Path, seed: int) -> dict[str, torch.Tensor]:
    """w + 0.05 · N(0, 1) noise from a generator seeded with `seed`, for every parameter w.

    Seed 0 is the checkpoint unchanged. Deterministic: the sender and the test build the same.
    """
    state = checkpoint_state(checkpoint)
    if seed == 0:
        return state
    generator = torch.Generator().manual_seed(int(seed))
    return {
        name: tensor + PERTURBATION_SCALE * torch.randn(tensor.shape, generator=generator)
        for name, tensor in state.items()
    }


def plan_layout(checkpoint: str | pathlib.Path, bucket_bytes: int = 1 << 15):
    """The bucket layout of the checkpoint's parameters; small buckets, so layers span buckets."""
    return plan_buckets(
        ((name, tensor.dtype, tensor.shape) for name, tensor in checkpoint_state(checkpoint).items()),
        bucket_bytes=bucket_bytes,
    )


def parse_version(argument: str) -> tuple[int, int]:
    """ "VERSION" or "VERSION:SEED" -> (version, seed); the seed defaults to the version."""
    version, _, seed = argument.partition(":")
    return int(version), int(seed or version)


def main() -> None:
    checkpoint, spec_file, report_dir = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    versions = [parse_version(argument) for argument in sys.argv[4:]]
    spec = decode(pathlib.Path(spec_file).read_bytes(), WeightSyncSpec)
    group = SyncGroup.from_spec(spec, rank=0)
    try:
        for version, seed in versions:
            state = perturbed_state(checkpoint, seed)

            def produce(bucket, out, state=state):
                return pack_bucket(bucket, state, out=out)

            report = broadcast_buckets(group, spec.layout, produce, version=version)
            (report_dir / f"sent-{version}.msgpack").write_bytes(encode(report))
    finally:
        group.close()


if __name__ == "__main__":
    main()
