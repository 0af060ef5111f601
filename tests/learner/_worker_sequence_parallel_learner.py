"""One rank of a learner run with sequence parallelism, started by tests/learner/test_sequence_parallel.py.

    python _worker_sequence_parallel_learner.py OUT_DIR STAGES SP [--diffs]   (WORLD_SIZE = SP: dp = 1)

With --diffs (SP = 2) the ranks first run `_worker_sequence_parallel.diffs` (OUT_DIR/diffs{rank}.json):
one two-rank world for both, its start-up paid once.

For each ZeRO stage in STAGES (comma-separated, one after the other in this process), a
PolicyLearner and a ValueLearner (float32, `sequence_parallel_size` SP) each compute inference
results and take NUM_STEPS train steps on the same micro-batches on every rank (two halves of a
batch with a sequence longer than a rank's share, plus an empty one), and the inference-only
roles (a reference: PolicyLearner(optimizer=None); a reward model: ValueLearner(optimizer=None))
compute log-probs and scores of the batch. Rank 0 writes OUT_DIR/zero{stage}/policy.safetensors,
critic.safetensors (the gathered weights after training) and metrics.json.

At ZeRO-0 the supervised learners (SFTLearner, DPOLearner with its reference, RewardModelLearner)
also take one step each on two micro-batches, one of them with a sequence longer than a rank's
share, plus an empty one: rank 0 writes their per-token / per-sequence values before the step,
the step's metrics (supervised.json) and every parameter's gradient as the optimizer received it
(supervised_grads.safetensors, read by a step pre-hook on the client AdamW). The test compares
SP = 2 with a one-rank SP = 1 run.
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
    experience_with_a_long_sequence,
    fill_policy_slots,
    fill_value_slots,
    tiny_critic,
    tiny_policy,
)
from _worker_learner import POLICY_LOSS, gathered_state

from rl_data import ExperienceBatch
from rl_data.datasets import PreferencePair
from rl_data.tiny import build_tiny_tokenizer


def run(out: pathlib.Path, stage: int, sp: int) -> None:
    from safetensors.torch import save_file

    from rl_learner import (
        DeepSpeedConfig,
        OptimizerConfig,
        PolicyLearner,
        PolicyLossConfig,
        ValueLearner,
        ValueLossConfig,
    )

    rank = int(os.environ["RANK"])
    tokenizer = build_tiny_tokenizer()
    ds = DeepSpeedConfig(zero_stage=stage, dtype="fp32", sequence_parallel_size=sp)
    # Adam's step lr·m/(√v + eps) turns a float32 rounding difference δ of a gradient element far
    # below eps into a weight difference of about lr·δ/eps (1e-3 / 1e-8 = 1e5 × δ: 1.2e-5 seen for
    # layer 0's k_proj with its gradients of 5e-10); eps 1e-6 keeps the weights comparable at 1e-5.
    # The gradients themselves are compared at ZeRO-0 (grads.safetensors).
    optim = OptimizerConfig(lr=LR, warmup_ratio=0.25, weight_decay=0.01, eps=1e-6)
    results: dict = {}
    grads: dict[str, torch.Tensor] = {}

    def captured(role: str, learner, train_step) -> list[dict]:
        """NUM_STEPS × train_step(learner); at ZeRO-0 keep every step's gradients under role/step/name."""
        capture = GradientCapture(learner) if stage == 0 else None
        out = [train_step(learner) for _ in range(NUM_STEPS)]
        for index, step_grads in enumerate(capture.steps if capture is not None else []):
            grads.update({f"{role}/{index}/{name}": grad for name, grad in step_grads.items()})
        return out

    batch = experience_with_a_long_sequence()
    halves = [batch.select(range(0, 4)), batch.select(range(4, batch.num_sequences))]
    policy = PolicyLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=optim, total_steps=TOTAL_STEPS)
    logprobs, entropy = policy.logprobs([batch], with_entropy=True)[0]
    results["logprobs"] = logprobs.cpu().tolist()
    results["entropy"] = entropy.cpu().tolist()
    fill_policy_slots(batch, logprobs.cpu())
    micro = [
        batch.select(range(0, 4)),
        batch.select(range(4, batch.num_sequences)),
        ExperienceBatch.empty(with_rollout_logprobs=True),
    ]
    results["policy_metrics"] = captured(
        "policy", policy, lambda learner: learner.train_step(micro, PolicyLossConfig(**POLICY_LOSS))
    )
    results["logprobs_after"] = policy.logprobs(halves)[1].cpu().tolist()
    state = gathered_state(policy)
    if rank == 0:
        save_file(state, str(out / "policy.safetensors"))
    if sp > 1 and stage == 0:  # the ranks of a group given different micro-batches: refused on every rank
        try:
            policy.logprobs([halves[rank % 2]])
            results["mismatch_error"] = "no error"
        except ValueError as error:
            results["mismatch_error"] = str(error)
    del policy

    reference = PolicyLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=None)
    results["reference_logprobs"] = reference.logprobs([batch], only_actions=True)[0].cpu().tolist()
    del reference
    reward_model = ValueLearner(tiny_critic(tokenizer), deepspeed=ds, optimizer=None)
    results["reward_scores"] = reward_model.scores(halves)[0].cpu().tolist()
    del reward_model

    critic = ValueLearner(tiny_critic(tokenizer), deepspeed=ds, optimizer=optim, total_steps=TOTAL_STEPS)
    values = critic.values([batch])[0].cpu()
    results["values"] = values.tolist()
    fill_value_slots(batch, values)
    micro = [batch.select(range(0, 4)), batch.select(range(4, batch.num_sequences)), ExperienceBatch.empty()]
    results["critic_metrics"] = captured(
        "critic", critic, lambda learner: learner.train_step(micro, ValueLossConfig())
    )
    state = gathered_state(critic)
    if rank == 0:
        save_file(state, str(out / "critic.safetensors"))
        (out / "metrics.json").write_text(json.dumps(results))
        if grads:
            save_file(grads, str(out / "grads.safetensors"))


# ----------------------------------------------------------------------------- supervised learners


def _sample(generator: torch.Generator, prompt: int, response: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 400, (prompt + response,), generator=generator)
    mask = torch.zeros(prompt + response, dtype=torch.bool)
    mask[prompt:] = True
    return ids, mask


def sft_micro_batches() -> list[ExperienceBatch]:
    """Two micro-batches and an empty one; the first has 4 short samples and one longer than half its row."""
    from rl_learner import pack_sequences

    generator = torch.Generator().manual_seed(11)
    first = [_sample(generator, 2, 4) for _ in range(4)] + [_sample(generator, 5, 45)]
    second = [_sample(generator, 3, 5) for _ in range(3)]
    return [pack_sequences(first), pack_sequences(second), pack_sequences([])]


def pair_micro_batches() -> list[ExperienceBatch]:
    """Pair micro-batches (chosen first): 3 pairs whose first chosen side is longer than half the row,
    2 short pairs, and an empty one."""
    from rl_learner import pack_pairs

    generator = torch.Generator().manual_seed(12)

    def pair(index: int, chosen: int) -> PreferencePair:
        prompt = torch.randint(3, 400, (3,), generator=generator)
        sides = []
        for response in (chosen, 3 + index % 3):
            ids = torch.cat([prompt, torch.randint(3, 400, (response,), generator=generator)])
            mask = torch.zeros(ids.numel(), dtype=torch.bool)
            mask[3:] = True
            sides.append((ids, mask))
        (cid, cmask), (rid, rmask) = sides
        return PreferencePair(
            chosen_ids=cid, chosen_mask=cmask, rejected_ids=rid, rejected_mask=rmask, margin=0.1 * index
        )

    first = [pair(0, 49), pair(1, 4), pair(2, 5)]
    second = [pair(3, 2), pair(4, 6)]
    return [pack_pairs(first), pack_pairs(second), pack_pairs([])]


class GradientCapture:
    """Every parameter's gradient as the client optimizer's step receives it, one dict per step
    (ZeRO-0 only: the params' .grad, which DeepSpeed's averaging of world_size × the loss has
    already summed over the ranks)."""

    def __init__(self, learner) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        names = {id(p): name for name, p in learner.module.named_parameters()}

        def keep(optimizer, *_):
            self.steps.append(
                {
                    names[id(param)]: param.grad.detach().clone()
                    for group in optimizer.param_groups
                    for param in group["params"]
                    if param.grad is not None
                }
            )

        learner.engine.optimizer.register_step_pre_hook(keep)


def run_supervised(out: pathlib.Path, sp: int) -> None:
    from safetensors.torch import save_file

    from rl_learner import (
        DeepSpeedConfig,
        DPOLearner,
        DPOLossConfig,
        OptimizerConfig,
        PolicyLearner,
        RewardModelLearner,
        SFTLearner,
    )

    rank = int(os.environ["RANK"])
    tokenizer = build_tiny_tokenizer()
    ds = DeepSpeedConfig(zero_stage=0, dtype="fp32", sequence_parallel_size=sp)
    optim = OptimizerConfig(lr=LR, warmup_ratio=0.0, scheduler="constant")
    results: dict = {}
    grads: dict[str, torch.Tensor] = {}

    def step(name: str, learner, values: list[torch.Tensor], train) -> None:
        capture = GradientCapture(learner)
        results[name] = {"values": [v.cpu().tolist() for v in values], "metrics": train()}
        (step_grads,) = capture.steps
        grads.update({f"{name}/{key}": grad for key, grad in step_grads.items()})

    sft_batches = sft_micro_batches()
    sft = SFTLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=optim)
    results["sft_longest"] = max(sft_batches[0].sequence_lengths.tolist())
    results["sft_num_tokens"] = sft_batches[0].num_tokens
    step("sft", sft, sft.logprobs(sft_batches, only_actions=True), lambda: sft.sft_step(sft_batches))

    pairs = pair_micro_batches()
    results["pairs_longest"] = max(pairs[0].sequence_lengths.tolist())
    results["pairs_num_tokens"] = pairs[0].num_tokens
    reference_model = tiny_policy(tokenizer)
    with torch.no_grad():  # a reference that differs from the policy: the DPO margin does not start at 0
        for parameter in reference_model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)))
    reference = PolicyLearner(reference_model, deepspeed=ds, optimizer=None)
    for batch, values in zip(pairs, reference.logprobs(pairs, only_actions=True), strict=True):
        batch.ref_logprobs = values
    del reference
    dpo = DPOLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=optim)
    loss = DPOLossConfig(beta=0.5)
    values = [batch.ref_logprobs for batch in pairs] + dpo.logprobs(pairs, only_actions=True)
    step("dpo", dpo, values, lambda: dpo.dpo_step(pairs, loss))

    rm = RewardModelLearner(tiny_critic(tokenizer), deepspeed=ds, optimizer=optim)
    step("rm", rm, rm.scores(pairs), lambda: rm.reward_step(pairs, use_margin=True))
    if rank == 0:
        (out / "supervised.json").write_text(json.dumps(results))
        save_file(grads, str(out / "supervised_grads.safetensors"))


def main() -> None:
    import torch.distributed as dist

    out = pathlib.Path(sys.argv[1])
    stages, sp = [int(stage) for stage in sys.argv[2].split(",")], int(sys.argv[3])
    if "--diffs" in sys.argv[4:]:
        from _worker_sequence_parallel import diffs

        dist.init_process_group("gloo")  # the learners' DeepSpeed start-up adopts this group
        diffs(out)
    for stage in stages:
        folder = out / f"zero{stage}"
        folder.mkdir(exist_ok=True)
        run(folder, stage, sp)
        if stage == 0:
            run_supervised(folder, sp)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
