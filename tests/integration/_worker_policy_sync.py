"""The learner side of the whole-loop test in tests/rollout/test_vllm_engine.py
(`test_vllm_rollout_trains_a_zero3_learner_whose_weights_come_back_to_the_engine`), one real
DeepSpeed rank (ZeRO-3, CPU).

    python _worker_policy_sync.py CHECKPOINT RECORDS SPEC OUT_DIR VERSION

Reads the rollout records (rl_data wire format) and the weight-sync spec, then:
1. computes the policy's log-probs of the sampled responses (they must match the engine's);
2. GRPO advantages, one PPO train step on the whole batch (4 micro-batches);
3. sends the new weights to the engine as VERSION with the spec's sender (ZeRO-3 gathered per bucket);
4. exports the trained policy as an HF folder, for the test to compare the engine against.
Writes OUT_DIR/result.json (log-prob mismatch, train metrics, the sender's report).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    import torch

    from rl_algos import compute_advantages
    from rl_data import Trajectory, build_experience, decode, micro_batches, plan_micro_batches
    from rl_data.sync import WeightSyncSpec
    from rl_data.sync.broadcast import free_port
    from rl_learner import (
        DeepSpeedConfig,
        OptimizerConfig,
        PolicyLearner,
        PolicyLossConfig,
        deepspeed_config,
        export_hf,
        load_causal_lm,
        make_sender,
    )

    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    checkpoint, records_path, spec_path, out, version = sys.argv[1:6]
    out_dir = pathlib.Path(out)
    records = decode(pathlib.Path(records_path).read_bytes(), list[Trajectory])
    spec = decode(pathlib.Path(spec_path).read_bytes(), WeightSyncSpec)

    ds = DeepSpeedConfig(zero_stage=3, dtype="fp32")
    optim = OptimizerConfig(lr=3e-3, warmup_ratio=0.0)
    model = load_causal_lm(
        checkpoint, dtype=torch.float32, zero3_config=deepspeed_config(ds, optim, world_size=1)
    )
    learner = PolicyLearner(model, deepspeed=ds, optimizer=optim, total_steps=1)

    batch = build_experience(records)
    advantages, _ = compute_advantages(
        "grpo",
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        action_mask=batch.response_action_mask(),
        preset="verl",
    )
    batch.advantages = batch.from_response_view(advantages).float()
    plan = plan_micro_batches(
        batch.sequence_lengths.tolist(), max_tokens=10_000, num_ranks=1, min_micro_batches=4
    )
    parts = micro_batches(batch, plan, 0)
    logprobs = learner.logprobs(parts)
    mismatch = 0.0
    for part, part_logprobs in zip(parts, logprobs, strict=True):
        gap = (part_logprobs - part.rollout_logprobs)[part.action_mask].abs().max()
        mismatch = max(mismatch, float(gap))
        part.old_logprobs = part_logprobs
    metrics = learner.train_step(parts, PolicyLossConfig(name="ppo"))

    sender = make_sender(spec, learner.engine)
    report = sender.send(version=int(version))
    sender.close()
    export_hf(learner.engine, out_dir / "trained")
    (out_dir / "result.json").write_text(
        json.dumps(
            {
                "logprob_mismatch": mismatch,
                "metrics": metrics,
                "checksums": [str(c) for c in report.checksums],
                "num_bytes": report.num_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
