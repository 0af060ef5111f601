"""One gloo rank of `test_fsdp2.py`'s two-rank test (`python _worker_fsdp2.py FOLDER`).

1. A team's own FSDP2 loop: a `fully_shard` tiny model takes an AdamW step and sends its weights
   through the "file" transport with `make_sender(spec, model).send(version=3)` on every rank.
   Rank 0 writes the full weights (`full_tensor()`: what the unsharded model holds) and its report.
2. The FSDP2 learner backend: `PolicyLearner(backend="fsdp2")` takes one step, rank r on
   micro-batch r of `experience(8)` (sequences 4r..4r+3); rank 0 writes the metrics and weights.
   The ranks save that state (two-ckpt/), then load the test's one-rank checkpoint of the same
   step (one-ckpt/, resharded by torch.distributed.checkpoint) and take the next step from it.
3. The same for a `ValueLearner` critic (its score head's local shard shape: critic-head-<r>.json).
4. FSDP × TP = 1 × 2 (`tensor_parallel_size=2`): the policy's step over both micro-batches on each
   rank, its weights, a "file" sync of them and its checkpoint (tp-*); the critic's step.
5. FSDP2 with sequence parallelism 2 (`sequence_parallel_size=2`): the policy's step over both
   micro-batches on each rank, each rank running half of every row's tokens, and its weights
   (sp-*); the critic's step.
6. LoRA on FSDP2 (`lora_policy`, peft adapters on the tiny policy): the step as in 2, its full
   weights, a merged "file" sync and an adapter-only one, and its checkpoint (lora-*).

Each rank writes `rank-<r>.json` (whether it sent, whether its report is None, the number of
buckets, whether its parameters were sharded).
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience, fill_policy_slots, fill_value_slots, tiny_critic, tiny_policy

from rl_data import encode
from rl_data.sync import WeightSyncSpec
from rl_data.tiny import build_tiny_model, build_tiny_tokenizer
from rl_learner import (
    DeepSpeedConfig,
    LoraOptions,
    OptimizerConfig,
    PolicyLearner,
    PolicyLossConfig,
    TrainingState,
    ValueLearner,
    ValueLossConfig,
    adapter_layout,
    apply_lora,
    load_checkpoint,
    lora_adapter,
    save_checkpoint,
)
from rl_learner.models import packed_logprobs, packed_values
from rl_learner.sync import make_sender, sync_layout

SMALL_BUCKETS = 64 * 1024  # several buckets even for the tiny model
# test_fsdp2.py's one-rank learner is built with the same settings
OPTIMIZER = OptimizerConfig(lr=1e-3, warmup_ratio=0.0)
LOSS = PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01)
VALUE_LOSS = ValueLossConfig(clip_range=0.2)
LORA = LoraOptions(rank=4, alpha=8.0)


def own_loop(folder: pathlib.Path, tokenizer, rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

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


def fsdp2_policy(tokenizer, **deepspeed) -> PolicyLearner:
    """The tiny policy on the FSDP2 backend, fp32, as the test's one-rank learner is built
    (`deepspeed`: more DeepSpeedConfig keywords, e.g. tensor_parallel_size)."""
    config = DeepSpeedConfig(backend="fsdp2", dtype="fp32", **deepspeed)
    return PolicyLearner(tiny_policy(tokenizer), deepspeed=config, optimizer=OPTIMIZER, total_steps=4)


def lora_policy(tokenizer):
    """The tiny policy with LoRA adapters (rank 4), the same adapters on every rank and in the test."""
    torch.manual_seed(0)  # peft draws lora_A's initial values from the global RNG
    return apply_lora(tiny_policy(tokenizer), LORA)


def lora_syncs(model, folder: pathlib.Path, name: str) -> tuple[Any, Any]:
    """A merged "file" sync (`name`-merged) and an adapter-only one (`name`-adapter) of `model`,
    on every rank together: the reports (None where this rank does not send)."""
    reports = []
    for kind, layout, adapter in (
        ("merged", sync_layout(model, bucket_bytes=SMALL_BUCKETS), None),
        ("adapter", adapter_layout(model, bucket_bytes=SMALL_BUCKETS), lora_adapter(model)),
    ):
        folder_of = str(folder / f"{name}-{kind}")
        spec = WeightSyncSpec(transport="file", layout=layout, directory=folder_of, adapter=adapter)
        with make_sender(spec, model) as sender:
            reports.append(sender.send(version=2))
    return reports[0], reports[1]


def fsdp2_critic(tokenizer, **deepspeed) -> ValueLearner:
    """The tiny critic on the FSDP2 backend, fp32 (`deepspeed` as for `fsdp2_policy`)."""
    config = DeepSpeedConfig(backend="fsdp2", dtype="fp32", **deepspeed)
    return ValueLearner(tiny_critic(tokenizer), deepspeed=config, optimizer=OPTIMIZER, total_steps=4)


def policy_batch(tokenizer):
    """Eight sequences with the policy step's slots filled from the tiny policy (as the test's)."""
    batch = experience(8)
    with torch.no_grad():
        fill_policy_slots(batch, packed_logprobs(tiny_policy(tokenizer), batch).float())
    return batch


def value_batch(tokenizer):
    """Eight sequences with the critic step's slots filled from the tiny critic (as the test's)."""
    batch = experience(8)
    with torch.no_grad():
        fill_value_slots(batch, packed_values(tiny_critic(tokenizer), batch).float())
    return batch


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (DTensor `full_tensor`), by name."""
    return {name: p.full_tensor().detach() for name, p in module.named_parameters()}


def learner_step(folder: pathlib.Path, tokenizer, rank: int) -> None:
    batch = policy_batch(tokenizer)
    learner = fsdp2_policy(tokenizer)
    metrics = learner.train_step([batch.select(range(4 * rank, 4 * rank + 4))], LOSS)
    state = full_state(learner.module)
    if rank == 0:
        (folder / "learner-metrics.json").write_text(json.dumps(metrics))
        (folder / "learner-state.msgpack").write_bytes(encode(state))
    save_checkpoint(folder / "two-ckpt", 1, {"policy": learner.engine}, TrainingState(step=1), save_rng=False)

    # The one-rank checkpoint the test saved after the same step, resharded onto two ranks.
    resumed = fsdp2_policy(tokenizer)
    load_checkpoint(folder / "one-ckpt", {"policy": resumed.engine}, restore_rng=False)
    metrics = resumed.train_step([batch.select(range(4 * rank, 4 * rank + 4))], LOSS)
    state = full_state(resumed.module)
    if rank == 0:
        (folder / "resumed-metrics.json").write_text(json.dumps({**metrics, "step": resumed.step}))
        (folder / "resumed-state.msgpack").write_bytes(encode(state))


def critic_step(folder: pathlib.Path, tokenizer, rank: int) -> None:
    """The FSDP2 critic (its [1, hidden] score head: one row on rank 0, an empty shard on rank 1)."""
    batch = value_batch(tokenizer)
    learner = fsdp2_critic(tokenizer)
    head = tuple(learner.module.score.weight.to_local().shape)
    metrics = learner.train_step([batch.select(range(4 * rank, 4 * rank + 4))], VALUE_LOSS)
    state = full_state(learner.module)
    (folder / f"critic-head-{rank}.json").write_text(json.dumps(head))
    if rank == 0:
        (folder / "critic-metrics.json").write_text(json.dumps(metrics))
        (folder / "critic-state.msgpack").write_bytes(encode(state))


def tensor_parallel_step(folder: pathlib.Path, tokenizer, rank: int) -> None:
    """FSDP × TP = 1 × 2: both ranks take the same two micro-batches (one TP group), each holding
    half of every decoder layer's heads and MLP columns; rank 0 writes the metrics, the full
    weights and the report of a "file" sync of them (gathered bucket by bucket)."""
    batch = policy_batch(tokenizer)
    learner = fsdp2_policy(tokenizer, tensor_parallel_size=2)
    q_proj = learner.module.model.layers[0].self_attn.q_proj.weight
    metrics = learner.train_step([batch.select(range(4)), batch.select(range(4, 8))], LOSS)
    state = full_state(learner.module)
    spec = WeightSyncSpec(
        transport="file",
        layout=sync_layout(learner.module, bucket_bytes=SMALL_BUCKETS),
        directory=str(folder / "tp-sync"),
    )
    sender = make_sender(spec, learner.module)
    report = sender.send(version=5)
    sender.close()
    save_checkpoint(folder / "tp-ckpt", 1, {"policy": learner.engine}, TrainingState(step=1), save_rng=False)
    if rank == 0:
        info = {**metrics, "q_proj_local": list(q_proj.to_local().shape), "q_proj": list(q_proj.shape)}
        (folder / "tp-metrics.json").write_text(json.dumps(info))
        (folder / "tp-state.msgpack").write_bytes(encode(state))
        (folder / "tp-report.msgpack").write_bytes(encode(report))

    values = value_batch(tokenizer)  # the critic: its score head whole on both ranks
    critic = fsdp2_critic(tokenizer, tensor_parallel_size=2)
    metrics = critic.train_step([values.select(range(4)), values.select(range(4, 8))], VALUE_LOSS)
    if rank == 0:
        (folder / "tp-critic-metrics.json").write_text(json.dumps(metrics))


def sequence_parallel_step(folder: pathlib.Path, tokenizer, rank: int) -> None:
    """FSDP2 with sequence parallelism 2 (one SP group of both ranks, the parameters sharded over
    both): the ranks take the same two micro-batches, each running half of every packed row's
    tokens (Ulysses all-to-alls around attention); rank 0 writes the metrics and full weights."""
    batch = policy_batch(tokenizer)
    learner = fsdp2_policy(tokenizer, sequence_parallel_size=2)
    metrics = learner.train_step([batch.select(range(4)), batch.select(range(4, 8))], LOSS)
    state = full_state(learner.module)
    if rank == 0:
        group = learner.sequence_parallel  # both ranks in it: each ran half of every row
        info = {**metrics, "sp_group": [group.size, group.rank], "gradient_ranks": learner.gradient_ranks}
        (folder / "sp-metrics.json").write_text(json.dumps(info))

    values = value_batch(tokenizer)  # the critic: its sharded score head on each rank's tokens
    critic = fsdp2_critic(tokenizer, sequence_parallel_size=2)
    metrics = critic.train_step([values.select(range(4)), values.select(range(4, 8))], VALUE_LOSS)
    if rank == 0:
        (folder / "sp-critic-metrics.json").write_text(json.dumps(metrics))
        (folder / "sp-state.msgpack").write_bytes(encode(state))


def lora_step(folder: pathlib.Path, tokenizer, rank: int) -> None:
    """The LoRA policy on FSDP2: rank r on micro-batch r; rank 0 writes the metrics, the full
    weights (base and adapters, peft's names) and both syncs' reports; the ranks save the state."""
    batch = policy_batch(tokenizer)
    config = DeepSpeedConfig(backend="fsdp2", dtype="fp32")
    learner = PolicyLearner(lora_policy(tokenizer), deepspeed=config, optimizer=OPTIMIZER, total_steps=4)
    metrics = learner.train_step([batch.select(range(4 * rank, 4 * rank + 4))], LOSS)
    state = full_state(learner.module)
    merged, adapter = lora_syncs(learner.engine, folder, "lora")
    save_checkpoint(
        folder / "lora-ckpt", 1, {"policy": learner.engine}, TrainingState(step=1), save_rng=False
    )
    if rank == 0:
        (folder / "lora-metrics.json").write_text(json.dumps(metrics))
        (folder / "lora-state.msgpack").write_bytes(encode(state))
        (folder / "lora-reports.msgpack").write_bytes(encode([merged, adapter]))


def main(folder: pathlib.Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokenizer = build_tiny_tokenizer()
    own_loop(folder, tokenizer, rank)
    learner_step(folder, tokenizer, rank)
    critic_step(folder, tokenizer, rank)
    tensor_parallel_step(folder, tokenizer, rank)
    sequence_parallel_step(folder, tokenizer, rank)
    lora_step(folder, tokenizer, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
