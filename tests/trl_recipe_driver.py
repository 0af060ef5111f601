"""rl-algos' README "Coming from TRL" recipes run inside TRL's GRPOTrainer (run by tests/test_release.py
in a venv holding torch, transformers, trl and the rl-algos wheel, nothing else):

    python trl_recipe_driver.py README.md CHECKPOINT OUTPUT_DIR

Both README classes train a tiny local model for two optimizer steps from one generation batch (so
the second step's ratios differ from 1), and on every micro-batch their loss and its gradient equal
TRL's own `_compute_loss` on the same inputs: `dapo` (ppo, token-mean), `cispo` (cap E = 1 + ε) and
`grpo` with sequence-level importance sampling (gspo, seq-mean-token-mean). The advantages recipe
gives TRL's own advantages with `preset="trl"` and RLOO's leave-one-out values with `rloo`.
Prints one `ok ...` line per configuration.
"""

from __future__ import annotations

import pathlib
import re
import sys

import torch


def readme_classes(readme: pathlib.Path, recording_base: type) -> dict:
    """Exec the README's TRL blocks with `trl.GRPOTrainer` bound to `recording_base`."""
    import trl

    blocks = [b for b in re.findall(r"```python\n(.+?)```", readme.read_text(), re.S) if "GRPOTrainer" in b]
    assert len(blocks) == 2, f"expected the loss and the advantages blocks, found {len(blocks)}"
    original, trl.GRPOTrainer = trl.GRPOTrainer, recording_base
    try:
        namespace: dict = {}
        for block in blocks:
            exec(compile(block, "README.md (Coming from TRL)", "exec"), namespace)
    finally:
        trl.GRPOTrainer = original
    return namespace


def make_recording_base():
    from trl import GRPOTrainer

    class Recording(GRPOTrainer):
        """TRL's own advantages, before a README subclass replaces them."""

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.trl_advantages = output["advantages"].clone()
            return output

    return Recording


def checked(readme_class: type, trl_class: type, clip: tuple[float, float] | None, sequence: bool) -> type:
    """The README class, its loss compared with TRL's on every micro-batch."""

    class Checked(readme_class):
        steps = 0
        clipped = 0

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.ours_advantages = output["advantages"].clone()  # the README's (TRL's without an estimator)
            return output

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ours = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            theirs = trl_class.compute_loss(self, model, inputs)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
            params = [p for p in model.parameters() if p.requires_grad]
            ours_grad = torch.autograd.grad(ours, params, retain_graph=True)
            theirs_grad = torch.autograd.grad(theirs, params)
            for name, a, b in zip(
                [n for n, p in model.named_parameters() if p.requires_grad], ours_grad, theirs_grad
            ):
                torch.testing.assert_close(
                    a, b, rtol=1e-4, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
                )
            self.steps += 1
            self.clipped += self.count_clipped(model, inputs, clip, sequence)
            return ours

        def count_clipped(self, model, inputs, clip, sequence) -> int:
            """Tokens (sequences) whose ratio left the clip range: the clip was exercised."""
            if clip is None or "old_per_token_logps" not in inputs:
                return 0
            mask = inputs["completion_mask"].float()
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, attention, mask.size(1))
            log_ratio = (logps - inputs["old_per_token_logps"]) * mask
            if sequence:
                log_ratio, mask = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)), (mask.sum(-1) > 0).float()
            ratio = log_ratio.exp()
            outside = ((ratio < 1 - clip[0]) | (ratio > 1 + clip[1])) & (mask > 0)
            return int(outside.sum())

    return Checked


def reward(completion_ids, **_):
    """A reward that differs within a group: the share of completion tokens divisible by 3."""
    return [sum(i % 3 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


CONFIGS = [
    # (name, GRPOConfig options, README options, clip range (ε_low, ε_high) to see exercised, sequence level)
    ("dapo/ppo", {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28},
     {"loss": ("ppo", {"epsilon_low": 0.2, "epsilon_high": 0.28})}, (0.2, 0.28), False),
    ("cispo", {"loss_type": "cispo", "epsilon_high": 1.1},
     {"loss": ("cispo", {"epsilon_high": 0.1}), "estimator": ("grpo", {"preset": "trl"})}, (1.0, 0.1), False),
    ("grpo+sequence/gspo", {"loss_type": "grpo", "importance_sampling_level": "sequence",
                            "epsilon": 3e-4, "epsilon_high": 4e-4},
     {"loss": ("gspo", {"epsilon_low": 3e-4, "epsilon_high": 4e-4}), "aggregation": "seq-mean-token-mean",
      "estimator": ("rloo", {})}, (3e-4, 4e-4), True),
]  # fmt: skip


def run(readme: pathlib.Path, checkpoint: str, out: pathlib.Path) -> None:
    import importlib.util

    siblings = [
        n for n in ("rl_data", "rl_rollout", "rl_learner", "rl_launch") if importlib.util.find_spec(n)
    ]
    assert not siblings, f"the venv holds sibling packages: {siblings}"
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)  # a tiny model: a second thread only contends with the suite's other workers

    classes = readme_classes(readme, make_recording_base())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    dataset = Dataset.from_dict({"prompt": [f"count {i} to {i + 3}" for i in range(8)]})
    for name, trl_options, ours, clip, sequence in CONFIGS:
        torch.manual_seed(0)
        base = classes["RLAlgosAdvantagesGRPOTrainer" if "estimator" in ours else "RLAlgosGRPOTrainer"]
        trainer_class = checked(base, GRPOTrainer, clip, sequence)
        args = GRPOConfig(
            output_dir=str(out / name.replace("/", "-")), use_cpu=True, bf16=False, report_to=[],
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, learning_rate=0.05,
            per_device_train_batch_size=4, num_generations=4, steps_per_generation=4,
            gradient_accumulation_steps=2, max_steps=2, max_completion_length=6, beta=0.0,
            **trl_options,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        trainer = trainer_class(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            **ours,
        )
        trainer.train()
        assert trainer.steps == 4, f"{name}: {trainer.steps} micro-batches, expected 4"
        assert trainer.clipped > 0, (
            f"{name}: no ratio left the clip range; the check would not see a wrong clip"
        )
        if "estimator" in ours:
            check_advantages(name, trainer, ours["estimator"][0])
        print(
            f"ok {name}: loss and gradient equal TRL's on {trainer.steps} micro-batches, {trainer.clipped} clipped"
        )


def check_advantages(name: str, trainer, estimator: str) -> None:
    rewards, theirs = trainer.rl_rewards, trainer.trl_advantages
    ours = trainer.ours_advantages
    if estimator == "grpo":
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    else:
        grouped = rewards.view(-1, trainer.num_generations)
        others = (grouped.sum(1, keepdim=True) - grouped) / (grouped.shape[1] - 1)
        torch.testing.assert_close(ours, (grouped - others).flatten(), rtol=1e-5, atol=1e-6)
    assert ours.abs().sum() > 0, f"{name}: every advantage is 0; the rewards did not differ within groups"


if __name__ == "__main__":
    run(pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3]))
