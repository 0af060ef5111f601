"""One rank (world size 1): SFT, DPO and RM steps of a tiny Qwen2-MoE with the router
load-balancing term off and on (`aux_loss_coef`), the batch whole and in two micro-batches;
writes OUT_DIR/results.json. Started by test_supervised.py."""

from __future__ import annotations

import copy
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _worker_supervised import pairs, sft_samples, split

from rl_algos import load_balancing_loss
from rl_data.tiny import build_tiny_model, build_tiny_tokenizer
from rl_learner import (
    DeepSpeedConfig,
    DPOLearner,
    DPOLossConfig,
    OptimizerConfig,
    PolicyLearner,
    RewardModelLearner,
    SFTLearner,
    pack_pairs,
    pack_sequences,
)
from rl_learner.models import RouterCapture, packed_logprobs

COEF = 0.5
DS = DeepSpeedConfig(zero_stage=0, dtype="fp32")
OPTIMIZER = OptimizerConfig(lr=1e-3, warmup_ratio=0.0, scheduler="constant")


def gates(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if ".mlp.gate." in n}


def moe_value_model(policy):
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    torch.manual_seed(0)
    critic = AutoModelForSequenceClassification.from_config(config)
    critic.load_state_dict(policy.state_dict(), strict=False)
    return critic


def step(kind: str, model, coef: float, batches) -> tuple[dict, dict]:
    if kind == "sft":
        learner = SFTLearner(model, deepspeed=DS, optimizer=OPTIMIZER, total_steps=2)
        metrics = learner.sft_step(batches, aux_loss_coef=coef)
    elif kind == "rm":
        learner = RewardModelLearner(model, deepspeed=DS, optimizer=OPTIMIZER, total_steps=2)
        metrics = learner.reward_step(batches, aux_loss_coef=coef)
    else:
        reference = PolicyLearner(copy.deepcopy(model), deepspeed=DS, optimizer=None)
        for batch in batches:
            batch.ref_logprobs = reference.logprobs([batch], only_actions=True)[0]
        learner = DPOLearner(model, deepspeed=DS, optimizer=OPTIMIZER, total_steps=2)
        metrics = learner.dpo_step(batches, DPOLossConfig(), aux_loss_coef=coef)
    return metrics, gates(learner.engine.module)


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    tokenizer = build_tiny_tokenizer()
    generator = torch.Generator().manual_seed(0)
    samples, preference = sft_samples(generator), pairs(generator)
    policy = build_tiny_model(tokenizer, architecture="qwen2_moe", seed=0)
    whole = {
        "sft": [pack_sequences(samples)],
        "dpo": [pack_pairs(preference)],
        "rm": [pack_pairs(preference)],
    }
    halves = {
        "sft": [pack_sequences(part) for part in split(samples, 2)],
        "dpo": [pack_pairs(part) for part in split(preference, 2)],
        "rm": [pack_pairs(part) for part in split(preference, 2)],
    }
    results: dict = {}
    with torch.no_grad(), RouterCapture(policy) as routers:
        packed_logprobs(policy, whole["sft"][0], only_actions=True, share_prefix=DS.shares_prefix)
    results["sft_expected_aux"] = float(load_balancing_loss(routers.logits, routers.top_k))
    for kind in ("sft", "dpo", "rm"):
        start = policy if kind != "rm" else moe_value_model(policy)
        before = gates(start)
        runs = {}
        for name, coef, batches in (("off", 0.0, whole), ("on", COEF, whole), ("split", COEF, halves)):
            metrics, after = step(kind, copy.deepcopy(start), coef, copy.deepcopy(batches[kind]))
            metrics["router_change"] = max(float((after[n] - before[n]).abs().max()) for n in after)
            runs[name] = metrics
            if name != "split":
                runs[f"{name}_gates"] = {n: p.tolist() for n, p in after.items()}
        runs["gates_differ"] = runs.pop("on_gates") != runs.pop("off_gates")
        results[kind] = runs
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
