"""One rank (world size 1): a VL policy learner on experience with images under ZeRO-2 and ZeRO-3.

For each run: inference log-probs through the engine vs per-sample HF forwards, one PPO step
(which weights moved: vision tower vs language model), the HF export loaded back with
AutoModelForImageTextToText, and the weight-sync layout and a file sync (names, checksums).
Writes results.json into the folder given as argv[1]; argv[2] is the tiny VL checkpoint."""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch
from _helpers_core import fill_policy_slots
from test_vision import per_sample_reference, vl_records

from rl_data import build_experience, compare_checksums
from rl_data.sync import WeightSyncSpec
from rl_data.sync.file import read_buckets
from rl_data.vision import VisionProcessor
from rl_learner import DeepSpeedConfig, OptimizerConfig, PolicyLearner, PolicyLossConfig, load_causal_lm
from rl_learner.checkpoint import export_hf
from rl_learner.config import deepspeed_config
from rl_learner.senders.file import FileSender
from rl_learner.sync import sync_layout


def full_parameters(learner) -> dict[str, torch.Tensor]:
    """Every parameter of the learner's model, gathered under ZeRO-3, as CPU copies."""
    import deepspeed

    out = {}
    for name, parameter in learner.module.named_parameters():
        context = (
            deepspeed.zero.GatheredParameters([parameter]) if hasattr(parameter, "ds_id") else _nothing()
        )
        with context:
            out[name] = parameter.detach().clone().cpu()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run(folder: pathlib.Path, path: str, stage: int, freeze: bool) -> dict:
    from transformers import AutoModelForImageTextToText

    processor = VisionProcessor.from_pretrained(path)
    ds = DeepSpeedConfig(zero_stage=stage, dtype="fp32", freeze_visual_encoder=freeze)
    optim = OptimizerConfig(lr=1e-2, warmup_ratio=0.0)
    zero3 = deepspeed_config(ds, optim, world_size=1) if stage == 3 else None
    learner = PolicyLearner(
        load_causal_lm(path, dtype=torch.float32, zero3_config=zero3), deepspeed=ds, optimizer=optim
    )
    batch = build_experience(vl_records(processor))
    reference = load_causal_lm(path, dtype=torch.float32)
    expected, _ = per_sample_reference(reference, batch, processor.image_token_id)
    logprobs = learner.logprobs([batch])[0].cpu()
    result = {"logprob_error": float((logprobs - expected).abs().max())}
    before = full_parameters(learner)
    fill_policy_slots(batch, logprobs)
    result["metrics"] = learner.train_step([batch], PolicyLossConfig(name="ppo"))
    after = full_parameters(learner)
    moved = {name: bool((before[name] != after[name]).any()) for name in before}
    vision = [name for name in moved if ".visual." in name]
    text = [name for name in moved if ".visual." not in name]
    result["vision_moved"] = sum(moved[name] for name in vision)
    result["vision_parameters"] = len(vision)
    result["text_moved"] = sum(moved[name] for name in text)
    result["text_parameters"] = len(text)
    # HF export: loads with AutoModelForImageTextToText and holds the trained weights
    exported = export_hf(learner.engine, folder / f"hf-{stage}-{freeze}")
    loaded = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32)
    state = dict(loaded.named_parameters())
    result["export_class"] = type(loaded).__name__
    result["export_max_difference"] = max(float((state[name] - after[name]).abs().max()) for name in after)
    # weight sync: the layout's names and a file sync whose checksums match
    layout = sync_layout(learner.engine)
    names = [param.name for bucket in layout.buckets for param in bucket.params]
    result["sync_names"] = names
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(folder / f"sync-{stage}-{freeze}"))
    received: dict[str, torch.Tensor] = {}
    with FileSender(learner.engine, spec) as sender:
        sent = sender.send(version=1)
    report = read_buckets(
        folder / f"sync-{stage}-{freeze}",
        layout,
        lambda bucket, views: received.update({k: v.clone() for k, v in views.items()}),
        version=1,
    )
    result["sync_checksum_mismatches"] = len(compare_checksums(sent, report))
    result["sync_max_difference"] = max(
        float((received[name] - after[name]).abs().max()) for name in received
    )
    return result


def main() -> None:
    folder, path = pathlib.Path(sys.argv[1]), sys.argv[2]
    results = {}
    for stage, freeze in ((2, False), (2, True), (3, False)):
        results[f"{stage}-{freeze}"] = run(folder, path, stage, freeze)
    (folder / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
