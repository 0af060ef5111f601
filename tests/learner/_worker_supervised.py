"""One process of a real DeepSpeed-on-CPU run of the supervised learners, started by test_supervised.py.

    python _worker_supervised.py OUT_DIR

Environment: RANK=0, WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT, DS_ACCELERATOR=cpu.

For each learner (sft, dpo, ipo, rm, kto), from the same initial weights:
  whole     one step with the batch as one micro-batch;
  split     one step with the batch in three micro-batches plus an empty one;
  reference the step's loss and pair metrics computed with plain transformers forwards (one
            sequence at a time, no packing) and the rl_algos loss on the whole batch;
  curve     the `whole` learner trained for more steps on the same batch.
Writes OUT_DIR/metrics.json.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import tiny_critic, tiny_policy

from rl_algos import dpo_loss, kto_loss, reward_model_loss
from rl_data.datasets import PreferencePair, UnpairedSample
from rl_data.tiny import build_tiny_tokenizer
from rl_learner import (
    DeepSpeedConfig,
    DPOLearner,
    DPOLossConfig,
    KTOLearner,
    KTOLossConfig,
    OptimizerConfig,
    PolicyLearner,
    RewardModelLearner,
    SFTLearner,
    pack_pairs,
    pack_sequences,
    pack_unpaired,
)

STEPS = 12
DS = DeepSpeedConfig(zero_stage=2, dtype="fp32")
OPTIMIZER = OptimizerConfig(lr=3e-3, warmup_ratio=0.0, scheduler="constant")


def sft_samples(generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    samples = []
    for _ in range(6):
        prompt = int(torch.randint(2, 6, (1,), generator=generator))
        response = int(torch.randint(2, 7, (1,), generator=generator))
        ids = torch.randint(3, 400, (prompt + response,), generator=generator)
        mask = torch.zeros(prompt + response, dtype=torch.bool)
        mask[prompt:] = True
        samples.append((ids, mask))
    return samples


def pairs(generator: torch.Generator) -> list[PreferencePair]:
    out = []
    for index in range(6):
        prompt = torch.randint(
            3, 400, (int(torch.randint(2, 5, (1,), generator=generator)),), generator=generator
        )
        sides = []
        for _ in range(2):
            response = torch.randint(
                3, 400, (int(torch.randint(2, 6, (1,), generator=generator)),), generator=generator
            )
            ids = torch.cat([prompt, response])
            mask = torch.zeros(ids.numel(), dtype=torch.bool)
            mask[prompt.numel() :] = True
            sides.append((ids, mask))
        (cid, cmask), (rid, rmask) = sides
        out.append(
            PreferencePair(
                chosen_ids=cid, chosen_mask=cmask, rejected_ids=rid, rejected_mask=rmask, margin=0.1 * index
            )
        )
    return out


def split(items: list, parts: int) -> list[list]:
    size = -(-len(items) // parts)
    return [items[i : i + size] for i in range(0, len(items), size)]


@torch.no_grad()
def hf_sequence_logprob(model, ids: torch.Tensor, mask: torch.Tensor) -> float:
    logits = model(ids[None]).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return float(logprobs[mask[1:]].sum())


def run_sft(generator: torch.Generator, tokenizer) -> dict:
    samples = sft_samples(generator)
    model = tiny_policy(tokenizer)
    ref_nll, count = 0.0, 0
    for ids, mask in samples:
        ref_nll -= hf_sequence_logprob(model, ids, mask)
        count += int(mask[1:].sum())
    whole = SFTLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    first = whole.sft_step([pack_sequences(samples)])
    splitter = SFTLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    parts = [pack_sequences(part) for part in split(samples, 3)] + [pack_sequences([])]
    second = splitter.sft_step(parts)
    curve = [first] + [whole.sft_step([pack_sequences(samples)]) for _ in range(STEPS - 1)]
    return {"whole": first, "split": second, "reference": {"loss": ref_nll / count}, "curve": curve}


def run_dpo(generator: torch.Generator, tokenizer, loss: DPOLossConfig) -> dict:
    data = pairs(generator)
    model = tiny_policy(tokenizer)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy: the margin does not start at 0
        for parameter in reference.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    logps = {
        name: torch.tensor(
            [
                [hf_sequence_logprob(m, p.chosen_ids, p.chosen_mask) for p in data],
                [hf_sequence_logprob(m, p.rejected_ids, p.rejected_mask) for p in data],
            ]
        )
        for name, m in (("policy", model), ("reference", reference))
    }
    losses, metrics = dpo_loss(
        logps["policy"][0],
        logps["policy"][1],
        logps["reference"][0],
        logps["reference"][1],
        beta=loss.beta,
        label_smoothing=loss.label_smoothing,
        loss_type=loss.loss_type,
    )
    ref_learner = PolicyLearner(reference, deepspeed=DS, optimizer=None)

    def with_ref(batches):
        for batch, values in zip(batches, ref_learner.logprobs(batches, only_actions=True), strict=True):
            batch.ref_logprobs = values
        return batches

    whole = DPOLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    full = with_ref([pack_pairs(data)])
    first = whole.dpo_step(full, loss)
    splitter = DPOLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    second = splitter.dpo_step(
        with_ref([pack_pairs(part) for part in split(data, 3)] + [pack_pairs([])]), loss
    )
    curve = [first] + [whole.dpo_step(full, loss) for _ in range(STEPS - 1)]
    reference_metrics = {key: float(value) for key, value in metrics.items()}
    return {
        "whole": first,
        "split": second,
        "reference": {"loss": float(losses.mean()), **reference_metrics},
        "curve": curve,
    }


def unpaired(data: list[PreferencePair]) -> tuple[list[UnpairedSample], list[UnpairedSample]]:
    """Each pair's sides as labelled completions, and KTO's KL pairs: the prompt of completion
    i + 1 (cyclically) followed by completion i."""
    samples = [
        UnpairedSample(input_ids=ids, loss_mask=mask, desirable=good)
        for pair in data
        for ids, mask, good in (
            (pair.chosen_ids, pair.chosen_mask, True),
            (pair.rejected_ids, pair.rejected_mask, False),
        )
    ]
    cut = [int(torch.nonzero(sample.loss_mask)[0]) for sample in samples]
    kl = []
    for index, sample in enumerate(samples):
        following = (index + 1) % len(samples)
        prompt, completion = samples[following].input_ids[: cut[following]], sample.input_ids[cut[index] :]
        mask = torch.cat(
            [torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(completion.numel(), dtype=torch.bool)]
        )
        kl.append(UnpairedSample(input_ids=torch.cat([prompt, completion]), loss_mask=mask, desirable=False))
    return samples, kl


def run_kto(generator: torch.Generator, tokenizer, loss: KTOLossConfig) -> dict:
    samples, kl = unpaired(pairs(generator))
    model = tiny_policy(tokenizer)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy: rewards and KL do not start at 0
        for parameter in reference.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))

    def logps(m, items):
        return torch.tensor([hf_sequence_logprob(m, item.input_ids, item.loss_mask) for item in items])

    losses, metrics = kto_loss(
        logps(model, samples),
        logps(reference, samples),
        torch.tensor([sample.desirable for sample in samples]),
        logps(model, kl),
        logps(reference, kl),
        beta=loss.beta,
        desirable_weight=loss.desirable_weight,
        undesirable_weight=loss.undesirable_weight,
    )
    ref_learner = PolicyLearner(reference, deepspeed=DS, optimizer=None)

    def with_ref(batches):
        for batch, values in zip(batches, ref_learner.logprobs(batches, only_actions=True), strict=True):
            batch.ref_logprobs = values
        return batches

    def step(learner, parts):  # parts: lists of positions in `samples`
        examples = with_ref([pack_unpaired([samples[i] for i in part]) for part in parts])
        kl_pairs = with_ref([pack_unpaired([kl[i] for i in part]) for part in parts])
        return learner.kto_step(examples, loss, reference_point=learner.reference_point(kl_pairs))

    everything = [list(range(len(samples)))]
    whole = KTOLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    first = step(whole, everything)
    splitter = KTOLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    second = step(splitter, [*split(list(range(len(samples))), 3), []])
    curve = [first] + [step(whole, everything) for _ in range(STEPS - 1)]
    return {
        "whole": first,
        "split": second,
        "reference": {"loss": float(losses.mean()), **{key: float(value) for key, value in metrics.items()}},
        "curve": curve,
    }


def run_rm(generator: torch.Generator, tokenizer) -> dict:
    data = pairs(generator)
    model = tiny_critic(tokenizer)
    with torch.no_grad():
        chosen = torch.stack([model(p.chosen_ids[None]).logits[0, 0] for p in data]).float()
        rejected = torch.stack([model(p.rejected_ids[None]).logits[0, 0] for p in data]).float()
    margins = torch.tensor([p.margin for p in data])
    losses, metrics = reward_model_loss(chosen, rejected, margin=margins)
    whole = RewardModelLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    first = whole.reward_step([pack_pairs(data)], use_margin=True)
    splitter = RewardModelLearner(copy.deepcopy(model), deepspeed=DS, optimizer=OPTIMIZER, total_steps=STEPS)
    second = splitter.reward_step(
        [pack_pairs(part) for part in split(data, 3)] + [pack_pairs([])], use_margin=True
    )
    curve = [first] + [whole.reward_step([pack_pairs(data)], use_margin=True) for _ in range(STEPS - 1)]
    reference_metrics = {key: float(value) for key, value in metrics.items()}
    return {
        "whole": first,
        "split": second,
        "reference": {"loss": float(losses.mean()), **reference_metrics},
        "curve": curve,
    }


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    results = {
        "sft": run_sft(torch.Generator().manual_seed(1), tokenizer),
        "dpo": run_dpo(torch.Generator().manual_seed(2), tokenizer, DPOLossConfig(beta=0.5)),
        "cdpo": run_dpo(
            torch.Generator().manual_seed(2), tokenizer, DPOLossConfig(beta=0.5, label_smoothing=0.2)
        ),
        "ipo": run_dpo(torch.Generator().manual_seed(2), tokenizer, DPOLossConfig(beta=0.5, loss_type="ipo")),
        "rm": run_rm(torch.Generator().manual_seed(3), tokenizer),
        "kto": run_kto(
            torch.Generator().manual_seed(4), tokenizer, KTOLossConfig(beta=0.5, undesirable_weight=1.5)
        ),
    }
    (out / "metrics.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
