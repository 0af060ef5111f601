"""One rank of a real DeepSpeed-on-CPU learner run (gloo), started by tests/learner/test_learner.py.

    python _worker_learner.py FOLDER RUN [RUN ...]
        RUN: STAGE,DTYPE or STAGE,DTYPE,checks (DTYPE: float64 or float32)

Environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, DS_ACCELERATOR=cpu.

The runs go one after the other in this process: one world pays its interpreter, import and
DeepSpeed start-up once, not once per configuration; every run builds its own engines from the
seeded tiny models. Each run writes into OUT_DIR = FOLDER/zero<STAGE> (rank 0 for shared
results, every rank for per-rank ones):
  policy.safetensors   policy parameters after NUM_STEPS train steps on the fixed batch, split
                       over WORLD_SIZE ranks × (4 / WORLD_SIZE) micro-batches, plus one empty
                       micro-batch on every rank;
  critic.safetensors   the same for a critic (clipped value loss);
  metrics.json         train-step metrics, inference results and the checks below.
With `checks` also: non-finite inputs on rank WORLD_SIZE − 1 (skip leaves everything bit-identical,
raise names micro-batch/rank/quantity), a non-finite loss from finite inputs, and the loss going
down over several steps on a fixed batch.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import (
    LR,
    NUM_STEPS,
    TOTAL_STEPS,
    experience,
    fill_policy_slots,
    fill_value_slots,
    tiny_critic,
    tiny_policy,
)

from rl_data import ExperienceBatch, micro_batches, plan_micro_batches
from rl_data.tiny import build_tiny_tokenizer

POLICY_LOSS = dict(
    name="ppo",
    options={"epsilon_low": 0.2, "epsilon_high": 0.28, "dual_clip": 3.0},
    aggregation="seq-mean-token-mean",
    kl_coef=0.05,
    kl_estimator="k3",
    distill_coef=0.1,
    distill_estimator="k2",
    entropy_coef=0.01,
    correction="tis",
)


def gathered_state(learner) -> dict[str, torch.Tensor]:
    """Full parameters (ZeRO-3 gathered), cloned to the CPU."""
    import deepspeed

    params = dict(learner.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=learner.ds.zero_stage == 3):
        return {name: p.detach().cpu().clone() for name, p in params.items()}


def my_micro_batches(batch: ExperienceBatch, rank: int, world: int) -> list[ExperienceBatch]:
    lengths = batch.sequence_lengths.tolist()
    plan = plan_micro_batches(lengths, max_tokens=64, num_ranks=world, min_micro_batches=4 // world)
    assert plan.num_micro_batches == 4 // world, plan
    return [*micro_batches(batch, plan, rank), ExperienceBatch.empty(with_rollout_logprobs=True)]


def optimizer_fingerprint(learner) -> list[float]:
    """Adam step counts and state sums of the client optimizer (ZeRO: its flat partitions)."""
    inner = getattr(learner.engine.optimizer, "optimizer", learner.engine.optimizer)
    out = []
    for state in inner.state.values():
        for value in state.values():
            out.append(float(torch.as_tensor(value, dtype=torch.float64).sum()))
    return out


def run(out_dir: pathlib.Path, stage: int, dtype: torch.dtype, checks: bool) -> None:
    """One configuration, written into `out_dir` (the module docstring)."""
    from safetensors.torch import save_file

    from rl_learner.config import DeepSpeedConfig, OptimizerConfig
    from rl_learner.learner import (
        NonFiniteError,
        PolicyLearner,
        PolicyLossConfig,
        ValueLearner,
        ValueLossConfig,
    )

    out_dir.mkdir(exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results: dict = {"rank": rank, "world_size": world}

    tokenizer = build_tiny_tokenizer()
    ds = DeepSpeedConfig(zero_stage=stage, dtype="fp32")
    optim = OptimizerConfig(lr=LR, warmup_ratio=0.25, weight_decay=0.01)

    # Policy: equivalence run.
    policy = PolicyLearner(
        tiny_policy(tokenizer, dtype), deepspeed=ds, optimizer=optim, total_steps=TOTAL_STEPS
    )
    full = experience()
    logprobs = policy.logprobs([full])[0].cpu()
    results["full_logprobs"] = logprobs.tolist()
    fill_policy_slots(full, logprobs)
    mine = my_micro_batches(full, rank, world)
    results["inference_logprobs"] = [t.cpu().tolist() for t in policy.logprobs(mine)]
    loss = PolicyLossConfig(**POLICY_LOSS)
    results["policy_metrics"] = [policy.train_step(mine, loss) for _ in range(NUM_STEPS)]
    results["policy_step"] = policy.step
    state = gathered_state(policy)
    if rank == 0:
        save_file(state, str(out_dir / "policy.safetensors"))

    if checks:
        # A float32 policy (a float64 loss would not overflow below), on the same micro-batches.
        policy = PolicyLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=optim, total_steps=TOTAL_STEPS)
        policy.train_step(mine, loss)  # a first step, so that the optimizer has a state
        # Non-finite advantages on the last rank's micro-batch 1: every rank skips.
        bad = list(mine)
        if rank == world - 1:
            broken = bad[1].select(range(bad[1].num_sequences))
            broken.advantages = broken.advantages.clone()
            broken.advantages[-1] = float("nan")
            bad[1] = broken
        before, fingerprint, lr = gathered_state(policy), optimizer_fingerprint(policy), policy.lr
        skipped = policy.train_step(bad, loss)
        after = gathered_state(policy)
        results["nan_skip"] = {
            "skipped": skipped["skipped"],
            "identical": all(torch.equal(before[k], after[k]) for k in before),
            "optimizer_unchanged": fingerprint == optimizer_fingerprint(policy),
            "lr_unchanged": lr == policy.lr,
        }
        policy.on_non_finite = "raise"
        try:
            policy.train_step(bad, loss)
            results["nan_raise"] = "no error"
        except NonFiniteError as error:
            results["nan_raise"] = str(error)
        results["nan_raise_identical"] = all(
            torch.equal(after[k], v) for k, v in gathered_state(policy).items()
        )
        policy.on_non_finite = "skip"
        # A non-finite loss from finite inputs (advantages near the float32 maximum).
        huge = [b.select(range(b.num_sequences)) for b in mine]
        for b in huge:
            if b.advantages is not None:
                b.advantages = torch.where(b.action_mask, torch.full_like(b.advantages, 3e38), 0.0)
        huge_metrics = policy.train_step(huge, loss)
        results["huge_loss"] = {
            "skipped": huge_metrics["skipped"],
            "identical": all(torch.equal(after[k], v) for k, v in gathered_state(policy).items()),
            "optimizer_unchanged": fingerprint == optimizer_fingerprint(policy),
        }
        # Usage errors are raised on every rank before any collective could hang.
        errors = {}
        uneven = mine if rank == 0 else mine[:-1]
        unfilled = [mine[0].select(range(mine[0].num_sequences)), *mine[1:]]
        if rank == world - 1:  # only one rank lacks a slot: the others must not wait for it
            unfilled[0].advantages = None
        for name, call in [
            ("uneven", lambda: policy.train_step(uneven, loss)),
            ("unfilled", lambda: policy.train_step(unfilled, loss)),
        ]:
            try:
                call()
                errors[name] = "no error"
            except ValueError as error:
                errors[name] = str(error)
        results["usage_errors"] = errors
        # The loss goes down on a fixed batch (old log-probs refreshed each step: on-policy PPO).
        losses = []
        for _ in range(6):
            fresh = policy.logprobs(mine)
            for b, lp in zip(mine, fresh, strict=True):
                b.old_logprobs = lp.cpu()
            step = policy.train_step(mine, PolicyLossConfig(name="reinforce"))
            losses.append(step["loss"])
        results["policy_losses"] = losses

    # Reference model (inference only): same log-probs as the trained-from policy at init.
    reference = PolicyLearner(tiny_policy(tokenizer, dtype), deepspeed=ds, optimizer=None)
    results["reference_logprobs"] = reference.logprobs([full])[0].cpu().tolist()
    try:
        reference.train_step(mine, loss)
        results["reference_train"] = "no error"
    except RuntimeError as error:
        results["reference_train"] = str(error)

    if stage == 3:
        # Loading from a checkpoint straight into ZeRO-3 shards (HfDeepSpeedConfig during from_pretrained).
        import torch.distributed as dist

        from rl_learner.models import load_causal_lm, load_value_model

        checkpoint = out_dir / "tiny"
        if rank == 0:
            tokenizer.save_pretrained(checkpoint)
            tiny_policy(tokenizer, dtype).save_pretrained(checkpoint)
        dist.barrier()
        zero3 = policy.deepspeed_config
        sharded = load_causal_lm(checkpoint, dtype=dtype, zero3_config=zero3)
        results["zero3_loaded_sharded"] = all(hasattr(p, "ds_id") for p in sharded.parameters())
        loaded = PolicyLearner(sharded, deepspeed=ds, optimizer=None)
        results["zero3_loaded_logprobs"] = loaded.logprobs([full])[0].cpu().tolist()
        value_model = load_value_model(checkpoint, dtype=dtype, zero3_config=zero3)
        results["zero3_value_sharded"] = all(hasattr(p, "ds_id") for p in value_model.parameters())
        results["zero3_values"] = (
            ValueLearner(value_model, deepspeed=ds, optimizer=None).values([full])[0].cpu().tolist()
        )

    # Critic: equivalence run.
    critic_learner = ValueLearner(
        tiny_critic(tokenizer, dtype), deepspeed=ds, optimizer=optim, total_steps=TOTAL_STEPS
    )
    values = critic_learner.values([full])[0].cpu()
    fill_value_slots(full, values)
    results["critic_scores"] = critic_learner.scores([full])[0].cpu().tolist()
    critic_batches = my_micro_batches(full, rank, world)
    results["critic_metrics"] = [
        critic_learner.train_step(critic_batches, ValueLossConfig()) for _ in range(NUM_STEPS)
    ]
    critic_state = gathered_state(critic_learner)
    if rank == 0:
        save_file(critic_state, str(out_dir / "critic.safetensors"))
    (out_dir / f"metrics_rank{rank}.json").write_text(json.dumps(results))


def main() -> None:
    folder = pathlib.Path(sys.argv[1])
    for spec in sys.argv[2:]:
        stage, dtype, *checks = spec.split(",")
        dtypes = {"float64": torch.float64, "float32": torch.float32}
        run(folder / f"zero{stage}", int(stage), dtypes[dtype], checks == ["checks"])
    # Leave together: rank 0 holds the rendezvous store, and a rank still talking to it when rank 0
    # exits aborts ("terminate called without an active exception", exit -6).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
