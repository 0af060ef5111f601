"""One gloo rank of `test_sync.py`'s FSDP2 test: a `fully_shard` tiny model takes an optimizer step
and sends its weights through the "file" transport (`python _worker_fsdp2_sync.py FOLDER`).

Every rank trains the same sharded model on its own tokens, then calls `make_sender(spec, model)`
and `send(version=3)`, as a team's own FSDP2 loop would. Rank 0 also writes the full weights
(`full_tensor()` of each parameter: what the unsharded model would hold) and its report; each rank
writes `rank-<r>.json` (whether it sent, whether its report is None, its own `sync_layout`).
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist

from rl_data import encode
from rl_data.sync import WeightSyncSpec
from rl_data.tiny import build_tiny_model, build_tiny_tokenizer
from rl_learner.sync import make_sender, sync_layout

SMALL_BUCKETS = 64 * 1024  # several buckets even for the tiny model


def main(folder: pathlib.Path) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(3, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()

    layout = sync_layout(model, bucket_bytes=SMALL_BUCKETS)
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(folder / "sync"))
    sender = make_sender(spec, model)
    report = sender.send(version=3)
    state = {name: param.full_tensor() for name, param in model.named_parameters()}
    if rank == 0:
        (folder / "state.msgpack").write_bytes(encode(state))
        (folder / "report.msgpack").write_bytes(encode(report))
    info = {
        "is_sender": sender.is_sender,
        "report_is_none": report is None,
        "buckets": len(layout.buckets),
        "sharded": all(param.to_local().numel() < param.numel() for param in model.parameters()),
    }
    (folder / f"rank-{rank}.json").write_text(json.dumps(info))
    sender.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
