"""One rank (world size 1): policy steps of a tiny Qwen2-MoE with and without the router
load-balancing term (`PolicyLossConfig.aux_loss_coef`); writes results.json."""

from __future__ import annotations

import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience, fill_policy_slots

from rl_algos import load_balancing_loss
from rl_data.tiny import build_tiny_model, build_tiny_tokenizer
from rl_learner import DeepSpeedConfig, OptimizerConfig, PolicyLearner, PolicyLossConfig
from rl_learner.models import RouterCapture, packed_logprobs

COEF = 0.5


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    tokenizer = build_tiny_tokenizer()
    ds = DeepSpeedConfig(zero_stage=0, dtype="fp32")
    optim = OptimizerConfig(lr=1e-3)
    results: dict = {}
    batch = experience()
    model = build_tiny_model(tokenizer, architecture="qwen2_moe", seed=0)
    with torch.no_grad(), RouterCapture(model) as routers:
        # the learner runs a prompt shared by a group once (ds.shares_prefix): its routers see it once
        logprobs = packed_logprobs(model, batch, only_actions=True, share_prefix=ds.shares_prefix)
    results["shares_prefix"] = ds.shares_prefix
    results["expected_aux"] = float(load_balancing_loss(routers.logits, routers.top_k))
    fill_policy_slots(batch, logprobs.float())
    halves = [batch.select(range(0, 4)), batch.select(range(4, 8))]
    routers_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp.gate." in n}
    for name, coef, micro_batches in (("off", 0.0, [batch]), ("on", COEF, [batch]), ("split", COEF, halves)):
        learner = PolicyLearner(
            build_tiny_model(tokenizer, architecture="qwen2_moe", seed=0),
            deepspeed=ds,
            optimizer=optim,
            total_steps=2,
        )
        loss = PolicyLossConfig(name="ppo", aux_loss_coef=coef)
        learner.engine.zero_grad()
        results[name] = learner.train_step(micro_batches, loss)
        after = {n: p.detach() for n, p in learner.engine.module.named_parameters() if ".mlp.gate." in n}
        results[name]["router_change"] = max(float((after[n] - routers_before[n]).abs().max()) for n in after)
        if name == "on":
            results["on_params"] = {n: p.tolist() for n, p in after.items()}
        if name == "off":
            results["off_params"] = {n: p.tolist() for n, p in after.items()}
    dense = PolicyLearner(build_tiny_model(tokenizer, seed=0), deepspeed=ds, optimizer=optim, total_steps=2)
    try:
        dense.train_step([batch], PolicyLossConfig(name="ppo", aux_loss_coef=COEF))
        results["dense_error"] = "no error"
    except ValueError as error:
        results["dense_error"] = str(error)
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
