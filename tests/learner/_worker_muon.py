"""One process of a real DeepSpeed-on-CPU SFT step with OptimizerConfig(name="muon"), started by
test_muon.py.

    python _worker_muon.py OUT_DIR STAGE [STAGE ...]

Environment: RANK=0, WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT, DS_ACCELERATOR=cpu.

For each ZeRO stage: the tiny policy takes one `SFTLearner.sft_step` with DeepSpeed's Muon, and
a plain-torch copy computes the gradient G of the same loss. Every parameter's change Δ is
written next to what it should be: for DeepSpeed's Muon matrices (≥ 2-D, no "embed" / "lm_head"
in the name) −muon_lr · NS(G) · √max(1, rows / cols) with `newton_schulz` below, for the rest
torch's AdamW step from the same gradient. Writes OUT_DIR/muon.json.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import tiny_policy

from rl_data.tiny import build_tiny_tokenizer
from rl_learner import DeepSpeedConfig, OptimizerConfig, SFTLearner, pack_sequences

OPTIMIZER = OptimizerConfig(
    name="muon",
    lr=1e-3,
    muon_lr=0.02,
    muon_momentum=0.9,
    warmup_ratio=0.0,
    scheduler="constant",
    grad_clip=0.0,  # ZeRO 1-3 would clip the orthogonalised update (OptimizerConfig.name)
)


def newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic Newton–Schulz iteration of Muon (Jordan et al. 2024), in float64.

    X₀ = M / ‖M‖_F (transposed to have rows ≤ cols), X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ and
    (a, b, c) = (3.4445, −4.7750, 2.0315): the singular vectors of M with every singular value
    pushed towards 1 (into about [0.7, 1.2] after 5 steps).
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def newton_schulz_dtype() -> str:
    """The precision of DeepSpeed's Newton–Schulz on this accelerator: it runs in a 16-bit type
    where the accelerator reports one (a CPU with AVX512-FP16 / AMX reports fp16 and bf16), else
    in float32. The CPU accelerator's answer depends on the machine, so the test's bound does."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return "float16"
    return "bfloat16" if accelerator.is_bf16_supported() else "float32"


def samples(generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(6):
        prompt = int(torch.randint(2, 6, (1,), generator=generator))
        response = int(torch.randint(2, 7, (1,), generator=generator))
        ids = torch.randint(3, 400, (prompt + response,), generator=generator)
        mask = torch.zeros(prompt + response, dtype=torch.bool)
        mask[prompt:] = True
        out.append((ids, mask))
    return out


def reference_gradients(model: torch.nn.Module, data: list) -> dict[str, torch.Tensor]:
    """Gradients of the token-mean NLL of the response tokens (the SFT loss), one sequence at a time."""
    model = copy.deepcopy(model)
    count = sum(int(mask[1:].sum()) for _, mask in data)
    for ids, mask in data:
        logits = model(ids[None]).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        (-logprobs[mask[1:]].sum() / count).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def expected_adamw(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """torch's AdamW step from `param` with `grad` (OPTIMIZER's AdamW settings)."""
    copy_ = torch.nn.Parameter(param.detach().clone())
    copy_.grad = grad.clone()
    optimizer = torch.optim.AdamW(
        [copy_],
        lr=OPTIMIZER.lr,
        betas=OPTIMIZER.betas,
        eps=OPTIMIZER.eps,
        weight_decay=OPTIMIZER.weight_decay,
    )
    optimizer.step()
    return copy_.detach() - param.detach()


def run(stage: int, model: torch.nn.Module, data: list, grads: dict[str, torch.Tensor]) -> dict:
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    learner = SFTLearner(
        copy.deepcopy(model), deepspeed=DeepSpeedConfig(zero_stage=stage, dtype="fp32"), optimizer=OPTIMIZER
    )
    basic = type(learner.engine.basic_optimizer).__name__
    lr = learner.lr
    metrics = learner.sft_step([pack_sequences(data)])
    params = dict(learner.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        after = {name: p.detach().clone() for name, p in params.items()}
    report: dict = {
        "basic_optimizer": basic,
        "lr": lr,
        "skipped": metrics["skipped"],
        "newton_schulz_dtype": newton_schulz_dtype(),
        # graphs torch.compile captured in this process so far (rl_learner runs Muon eager on CPU)
        "compiled_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "params": {},
    }
    for name, start in before.items():
        delta = after[name].double() - start.double()
        muon = start.dim() >= 2 and "embed" not in name and "lm_head" not in name
        if muon:
            rows, cols = start.shape
            expected = -OPTIMIZER.muon_lr * newton_schulz(grads[name]) * math.sqrt(max(1.0, rows / cols))
            # singular values of the gradient's directions that carry weight (σ / ‖G‖_F > 0.01; a
            # small batch's gradient is low-rank): Newton–Schulz brings all of them near 1
            raw = torch.linalg.svdvals(grads[name].double())
            raw = raw / raw.norm()
            rank = int((raw > 0.01).sum())
            update = delta / (OPTIMIZER.muon_lr * math.sqrt(max(1.0, rows / cols)))
            singular = torch.linalg.svdvals(update)[:rank]
            extra = {
                "rank": rank,
                "singular_min": float(singular.min()),
                "singular_max": float(singular.max()),
                "gradient_singular_ratio": float(raw[0] / raw[rank - 1]),
            }
        else:
            expected = expected_adamw(start, grads[name]).double()
            extra = {}
        error = float((delta - expected).norm() / expected.norm().clamp_min(1e-30))
        largest = float((delta - expected).abs().max())
        report["params"][name] = {"muon": muon, "relative_error": error, "max_abs_error": largest, **extra}
    return report


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    stages = [int(stage) for stage in sys.argv[2:]]
    torch.manual_seed(0)
    model = tiny_policy(build_tiny_tokenizer())
    data = samples(torch.Generator().manual_seed(1))
    grads = reference_gradients(model, data)
    results = {str(stage): run(stage, model, data, grads) for stage in stages}
    (out / "muon.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
