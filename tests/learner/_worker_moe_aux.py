"""One rank (world size 1): policy steps of a tiny Qwen2-MoE with and without the router
load-balancing term (`PolicyLossConfig.aux_loss_coef`), and with routing replay
(`PolicyLossConfig.router_replay` R3) of the model's own routes and of other routes; writes
results.json."""

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
from rl_learner.routing import MoERouting

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
    replay_runs(results, tokenizer, ds, optim, batch)
    dense = PolicyLearner(build_tiny_model(tokenizer, seed=0), deepspeed=ds, optimizer=optim, total_steps=2)
    try:
        dense.train_step([batch], PolicyLossConfig(name="ppo", aux_loss_coef=COEF))
        results["dense_error"] = "no error"
    except ValueError as error:
        results["dense_error"] = str(error)
    (out / "results.json").write_text(json.dumps(results))


def replay_runs(results: dict, tokenizer, ds, optim, batch) -> None:
    """R3 on the policy's own routes (the same step as without replay), on routes of other experts
    (another step), and the old-log-prob forward with replay; the MoE metrics of each."""
    model = build_tiny_model(tokenizer, architecture="qwen2_moe", seed=0)
    with torch.no_grad(), MoERouting(model, replay=False) as routing:
        routing.load(None)
        packed_logprobs(model, batch, routing=routing)
        own = torch.stack(routing.own, dim=1).to(torch.int16)  # [N, L, K]
    other = (own + 1) % model.config.num_experts
    for name, routes in (("replay_own", own), ("replay_other", other)):
        learner = PolicyLearner(
            build_tiny_model(tokenizer, architecture="qwen2_moe", seed=0),
            deepspeed=ds,
            optimizer=optim,
            total_steps=2,
        )
        batch.routed_experts = routes
        old = learner.logprobs([batch], only_actions=True, router_replay="R3")[0]
        results[f"{name}_old_logprobs"] = old.tolist()
        learner.engine.zero_grad()
        results[name] = learner.train_step([batch], PolicyLossConfig(name="ppo", router_replay="R3"))
    batch.routed_experts = None
    results["plain_old_logprobs"] = packed_logprobs(model, batch, only_actions=True).tolist()


if __name__ == "__main__":
    main()
