"""One rank (world size 1): a policy step with old log-probs from a separate forward vs from the
training forward itself (`PolicyLossConfig.old_logprobs_from_forward`); writes results.json."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience, fill_policy_slots, tiny_policy

from rl_data.tiny import build_tiny_tokenizer
from rl_learner import DeepSpeedConfig, OptimizerConfig, PolicyLearner, PolicyLossConfig


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    tokenizer = build_tiny_tokenizer()
    ds = DeepSpeedConfig(zero_stage=0, dtype="fp32")
    optim = OptimizerConfig(lr=1e-3)
    results = {}
    states = {}
    for mode in ("separate", "from_forward"):
        learner = PolicyLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=optim, total_steps=2)
        batch = experience()
        logprobs = learner.logprobs([batch])[0].cpu()
        fill_policy_slots(batch, logprobs)
        batch.old_logprobs = logprobs.clone()  # what the separate forward gives: ratio 1
        if mode == "from_forward":
            expected_gap = ((batch.old_logprobs - batch.rollout_logprobs).abs() * batch.action_mask).sum()
            results["expected_mismatch_mean"] = float(expected_gap / batch.action_mask.sum())
            batch.old_logprobs = None
        loss = PolicyLossConfig(
            name="ppo", correction="tis", old_logprobs_from_forward=mode == "from_forward"
        )
        results[mode] = learner.train_step([batch], loss)
        states[mode] = {name: p.detach().clone() for name, p in learner.engine.module.named_parameters()}
    results["max_weight_difference"] = max(
        float((states["separate"][name] - states["from_forward"][name]).abs().max())
        for name in states["separate"]
    )
    # a model with dropout is refused: its training forward is not the scoring forward
    model = tiny_policy(tokenizer)
    model.config.attention_dropout = 0.1
    learner = PolicyLearner(model, deepspeed=ds, optimizer=optim, total_steps=1)
    batch = fill_policy_slots(experience(), learner.logprobs([experience()])[0].cpu())
    try:
        learner.train_step([batch], PolicyLossConfig(old_logprobs_from_forward=True))
        results["dropout_error"] = None
    except ValueError as error:
        results["dropout_error"] = str(error)
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
