"""One rank of a learner run with sequence parallelism, started by tests/learner/test_sequence_parallel.py.

    python _worker_sequence_parallel_learner.py OUT_DIR STAGES SP      (WORLD_SIZE = SP here: dp = 1)

For each ZeRO stage in STAGES (comma-separated, one after the other in this process), a
PolicyLearner and a ValueLearner (float32, `sequence_parallel_size` SP) each compute inference
results and take NUM_STEPS train steps on the same micro-batches on every rank (two halves of a
batch with a sequence longer than a rank's share, plus an empty one). Rank 0 writes
OUT_DIR/zero{stage}/policy.safetensors, critic.safetensors (the gathered weights after training)
and metrics.json; the test compares SP = 2 with a one-rank SP = 1 run.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")


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
    optim = OptimizerConfig(lr=LR, warmup_ratio=0.25, weight_decay=0.01)
    results: dict = {}

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
    results["policy_metrics"] = [
        policy.train_step(micro, PolicyLossConfig(**POLICY_LOSS)) for _ in range(NUM_STEPS)
    ]
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

    critic = ValueLearner(tiny_critic(tokenizer), deepspeed=ds, optimizer=optim, total_steps=TOTAL_STEPS)
    values = critic.values([batch])[0].cpu()
    results["values"] = values.tolist()
    fill_value_slots(batch, values)
    micro = [batch.select(range(0, 4)), batch.select(range(4, batch.num_sequences)), ExperienceBatch.empty()]
    results["critic_metrics"] = [critic.train_step(micro, ValueLossConfig()) for _ in range(NUM_STEPS)]
    state = gathered_state(critic)
    if rank == 0:
        save_file(state, str(out / "critic.safetensors"))
        (out / "metrics.json").write_text(json.dumps(results))


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    stages, sp = [int(stage) for stage in sys.argv[2].split(",")], int(sys.argv[3])
    for stage in stages:
        folder = out / f"zero{stage}"
        folder.mkdir(exist_ok=True)
        run(folder, stage, sp)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
