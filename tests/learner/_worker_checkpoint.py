"""A training run for the checkpoint tests: run as a script, one process per rank.

Trains a tiny causal LM ("policy") and a value model with a `score` head ("critic") with real
DeepSpeed engines (gloo, CPU, fp32) for `--steps` steps, saving a checkpoint every
`--save-every` steps. Each step draws on every random stream a checkpoint must restore: the
`PromptLoader` position picks the rows, torch's RNG draws extra tokens, value targets and the
attention dropout, NumPy's picks a length and Python's the row order.

`--crash-at-save N` kills the process (SIGKILL) in the middle of the save at step N, after the
engines' files are written but before the manifest, leaving a partial `.tmp-*` folder. Before
that save it writes its result as an uninterrupted run of N steps would (the save changes no
weight and draws no random number): the reference the resumed run must equal.
`--resume` loads the latest checkpoint (or `--resume-tag`) and continues from its step (`--no-restore-rng`:
without the saved RNG states, a control that must diverge).

Each rank writes `<out>.rank<r>.json`: the losses per step (float.hex), a SHA-256 of the final
weights of each engine, the step it started from and the checkpoint root's listing (a crashing
run: as they were before the fatal save).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import msgspec
import numpy as np
import torch

ROW_LENGTH = 12
MICRO_BATCH = 2


def build_engine(model: torch.nn.Module, stage: int, world_size: int):
    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    config = {
        "train_batch_size": MICRO_BATCH * world_size,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def weights_digest(engine) -> str:
    import deepspeed

    digest = hashlib.sha256()
    for name, parameter in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([parameter], enabled=hasattr(parameter, "ds_id")):
            digest.update(name.encode())
            digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_result(args: argparse.Namespace, start: int, losses: dict, engines: dict) -> None:
    """`<out>.rank<r>.json` (the module docstring); on every rank (ZeRO-3 gathers the weights)."""
    from rl_learner.checkpoint import list_checkpoints

    result = {
        "start": start,
        "losses": losses,
        "weights": {name: weights_digest(engine) for name, engine in engines.items()},
        "checkpoints": [info.tag for info in list_checkpoints(args.root)],
        "root_entries": sorted(os.listdir(args.root)),
    }
    Path(f"{args.out}.rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--crash-at-save", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resume-tag", default=None)
    parser.add_argument("--no-restore-rng", action="store_true")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rl_data.datasets import PromptLoader
    from rl_learner.checkpoint import TrainingState, load_checkpoint, save_checkpoint
    from rl_learner.distributed import ensure_distributed

    # through rl_learner: DeepSpeed's own start would first compile its shared-memory allreduce op,
    # which gloo training never calls (rl_learner.distributed)
    ensure_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager")
    critic = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=1, attn_implementation="eager"
    )  # the `score` head is initialised from torch's RNG, seeded above
    for model in (policy, critic):
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.1  # so that torch's RNG shapes the losses
        model.train()
    engines = {
        "policy": build_engine(policy, args.stage, world),
        "critic": build_engine(critic, args.stage, world),
    }

    vocab = policy.config.vocab_size
    rows = torch.randint(3, vocab, (16, ROW_LENGTH), generator=torch.Generator().manual_seed(1))
    loader = PromptLoader(list(rows), batch_size=MICRO_BATCH * world, seed=7, shuffle=True)
    # Every rank seeds its streams alike, then makes them its own.
    random.seed(100 + rank)
    np.random.seed(200 + rank)  # noqa: NPY002
    torch.manual_seed(300 + rank)

    start = 0
    if args.resume:
        state = load_checkpoint(args.root, engines, tag=args.resume_tag, restore_rng=not args.no_restore_rng)
        loader.load_state_dict(state.data_state)
        start = state.step
        assert state.consumed_samples == loader.consumed_samples == start * MICRO_BATCH * world
        assert state.extra == {"world_size": world}

    losses: dict[int, list[str]] = {}
    batches = iter(loader)
    for step in range(start + 1, args.steps + 1):
        batch = torch.stack(next(batches))[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
        extra = torch.randint(3, vocab, (MICRO_BATCH, 3))
        length = int(np.random.randint(6, ROW_LENGTH + 1))  # noqa: NPY002
        if random.random() < 0.5:
            batch = batch.flip(0)
        input_ids = torch.cat([batch[:, :length], extra], dim=1)
        policy_loss = engines["policy"](input_ids=input_ids, labels=input_ids).loss
        engines["policy"].backward(policy_loss)
        engines["policy"].step()
        values = engines["critic"](input_ids=input_ids).logits[:, 0]
        critic_loss = torch.nn.functional.mse_loss(values, torch.rand(MICRO_BATCH))
        engines["critic"].backward(critic_loss)
        engines["critic"].step()
        losses[step] = [policy_loss.item().hex(), critic_loss.item().hex()]

        if step % args.save_every == 0:
            if step == args.crash_at_save:
                write_result(args, start, losses, engines)
                save_critic = engines["critic"].save_checkpoint

                def save_then_die(*a, _save=save_critic, **k):
                    _save(*a, **k)
                    os.kill(os.getpid(), signal.SIGKILL)

                engines["critic"].save_checkpoint = save_then_die
            state = TrainingState(
                step=step,
                consumed_samples=loader.consumed_samples,
                policy_version=step,
                data_state=msgspec.to_builtins(loader.state_dict()),
                extra={"world_size": world},
            )
            save_checkpoint(args.root, step, engines, state, keep_last=args.keep_last)

    write_result(args, start, losses, engines)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
