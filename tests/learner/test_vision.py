"""Vision-language models in the learner: loading, the packed forward with images (Qwen2-VL mRoPE,
vision tower embeddings) exact against per-sample HF forwards, freezing the tower, a train step,
checkpoint and weight sync (the last ones in a one-rank DeepSpeed worker, `_worker_vision.py`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from rl_algos import entropy_from_logits, logprobs_from_logits
from rl_data import ImageInputs, Trajectory, build_experience
from rl_data.vision import VisionProcessor, vision_token_ids
from rl_learner.models import load_causal_lm, load_value_model, mrope_position_ids, packed_logprobs


@pytest.fixture(scope="module")
def processor(tiny_vl_checkpoint):
    return VisionProcessor.from_pretrained(tiny_vl_checkpoint)


def _noise(seed: int, size=(56, 56)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _tokens(seed: int, count: int) -> list[int]:
    return torch.randint(10, 300, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def vl_records(processor) -> list[Trajectory]:
    """Sequences with 1, 0, 2 images, a multi-turn one whose response holds an environment image,
    and a GRPO-like pair: the same prompt and image twice, then the same prompt ids with another image."""
    records = []
    ids, images, _ = processor.render("<image>what?", [_noise(1)])
    records.append(Trajectory(prompt_ids=ids, response_ids=_tokens(1, 5), images=images))
    records.append(Trajectory(prompt_ids=torch.tensor(_tokens(2, 7)), response_ids=_tokens(3, 4)))
    ids, images, _ = processor.render("<image>and<image>which?", [_noise(2), _noise(3, (112, 56))])
    records.append(Trajectory(prompt_ids=ids, response_ids=_tokens(4, 3), images=images))
    ids, images, _ = processor.render("<image>go", [_noise(4)])
    turn_ids, turn_images = processor.image_turn([_noise(5)])
    first, second = _tokens(5, 3), _tokens(6, 4)
    records.append(
        Trajectory(
            prompt_ids=ids,
            response_ids=first + turn_ids.tolist() + second,
            action_mask=torch.tensor([True] * 3 + [False] * len(turn_ids) + [True] * 4),
            images=ImageInputs.concat([images, turn_images]),
        )
    )
    ids, images, _ = processor.render("<image>same?", [_noise(6)])
    records += [
        Trajectory(prompt_ids=ids, response_ids=_tokens(7 + i, 3), images=images, group_id=1)
        for i in range(2)
    ]
    _, other, _ = processor.render("<image>same?", [_noise(7)])
    records.append(Trajectory(prompt_ids=ids, response_ids=_tokens(9, 3), images=other, group_id=1))
    return records


def per_sample_reference(model, batch, image_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] log-probs and entropies from one unpacked HF forward per sequence (the model computes mRoPE)."""
    bounds = batch.cu_seqlens.tolist()
    counts = batch.image_counts.tolist()
    first_image = [0, *np.cumsum(counts).tolist()]
    patches = batch.image_grid_thw.prod(-1)
    first_patch = [0, *patches.cumsum(0).tolist()]
    logprobs, entropy = torch.zeros(batch.num_tokens), torch.zeros(batch.num_tokens)
    for sequence, (start, end) in enumerate(itertools.pairwise(bounds)):
        ids = batch.input_ids[start:end]
        images = {}
        if counts[sequence]:
            low, high = first_image[sequence], first_image[sequence + 1]
            images = dict(
                pixel_values=batch.pixel_values[first_patch[low] : first_patch[high]],
                image_grid_thw=batch.image_grid_thw[low:high],
                mm_token_type_ids=(ids == image_token_id).int()[None],
            )
        with torch.no_grad():
            logits = model(input_ids=ids[None], **images).logits[0, :-1]
        # the placeholder tokens are outside the policy's support (rl_data.vision.vision_token_ids)
        logits = logits.index_fill(-1, torch.tensor(vision_token_ids(model.config)), float("-inf"))
        picked = logprobs_from_logits(logits, ids[1:])
        # a placeholder token is never an action: log-prob 0, like the learner's
        logprobs[start + 1 : end] = torch.where(
            torch.isin(ids[1:], torch.tensor(vision_token_ids(model.config))), 0.0, picked
        )
        entropy[start + 1 : end] = entropy_from_logits(logits)
    return logprobs, entropy


def test_load_causal_lm_loads_a_vl_folder_and_value_models_refuse_it(tiny_vl_checkpoint):
    model = load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    names = [name for name, _ in model.named_parameters()]
    assert any(name.startswith("model.visual.") for name in names)
    with pytest.raises(ValueError, match=r"vision-language model.*critic-free estimator"):
        load_value_model(tiny_vl_checkpoint)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_vl_logprobs_equal_per_sample_hf_forwards(tiny_vl_checkpoint, processor, attn):
    batch = build_experience(vl_records(processor))
    assert batch.image_counts.tolist() == [1, 0, 2, 2, 1, 1, 1]
    model = load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32, attn_implementation=attn)
    reference = load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32, attn_implementation=attn)
    expected_logprobs, expected_entropy = per_sample_reference(reference, batch, processor.image_token_id)
    # the batch exercises mRoPE: image tokens get grid positions, later text jumps past them
    mrope = mrope_position_ids(model.model, batch)
    assert not torch.equal(mrope[1], batch.position_ids)
    actions = (batch.action_mask & (batch.position_ids > 0)).float()
    for options in ({}, {"only_actions": True}, {"share_prefix": True}):
        logprobs, entropy = packed_logprobs(model, batch, with_entropy=True, **options)
        scale = actions if options.get("only_actions") else 1.0
        torch.testing.assert_close(logprobs.detach(), expected_logprobs * scale, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy.detach(), expected_entropy * scale, atol=1e-5, rtol=0)
    # gradients reach the vision tower (patch embedding to merger)
    logprobs.sum().backward()
    for name in ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "merger.mlp.2.weight"):
        gradient = model.model.visual.get_parameter(name).grad
        assert gradient is not None, name
        assert gradient.abs().sum() > 0, name


def test_shared_prefix_groups_equal_prompts_only_with_equal_images(processor):
    from rl_learner.models import shared_prefix

    batch = build_experience(vl_records(processor))
    sharing = shared_prefix(batch)
    bounds = batch.cu_seqlens.tolist()
    # sequences 4 and 5 share prompt and image: 5 reads its prompt from 4; 6 has another image
    prompt = len(vl_records(processor)[4].prompt_ids)
    assert sharing.saved_tokens == prompt
    own = sharing.own.tolist()
    keep = set(sharing.keep.tolist())
    assert all(t not in keep for t in range(bounds[5], bounds[5] + prompt))
    assert all(t in keep for t in range(bounds[6], bounds[7]))
    assert own[bounds[5]] == own[bounds[4]]


def test_text_only_micro_batch_still_runs_the_tower_with_zero_gradient(tiny_vl_checkpoint, processor):
    batch = build_experience(vl_records(processor)).select([1])
    model = load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32)
    packed_logprobs(model, batch).sum().backward()
    gradient = model.model.visual.patch_embed.proj.weight.grad
    assert gradient is not None  # every rank runs the tower (ZeRO-3 gathers collectively)
    assert not gradient.any()


def test_image_batch_on_a_text_model_and_mismatched_placeholders_are_refused(
    tiny_checkpoint, tiny_vl_checkpoint, processor
):
    batch = build_experience(vl_records(processor)[:1])
    with pytest.raises(ValueError, match="is not a vision-language model"):
        packed_logprobs(load_causal_lm(tiny_checkpoint, dtype=torch.float32), batch)
    records = vl_records(processor)[:1]
    records[0].prompt_ids = torch.cat([records[0].prompt_ids, torch.tensor([processor.image_token_id])])
    with pytest.raises(ValueError, match=r"5 image placeholder tokens.*gives 4"):
        packed_logprobs(load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32), build_experience(records))


@pytest.fixture(scope="module")
def learner_runs(tiny_vl_checkpoint, tmp_path_factory) -> dict:
    """`_worker_vision.py` in one single-rank process: ZeRO-2, ZeRO-2 with the tower frozen, ZeRO-3."""
    import json
    import pathlib
    import subprocess
    import sys

    from tests.learner.single_rank import single_rank_env

    folder = tmp_path_factory.mktemp("vision-learner")
    worker = pathlib.Path(__file__).parent / "_worker_vision.py"
    done = subprocess.run(
        [sys.executable, str(worker), str(folder), str(tiny_vl_checkpoint)],
        env=single_rank_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((folder / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("run", ["2-False", "2-True", "3-False"])
def test_vl_learner_step_export_and_sync(learner_runs, run):
    result = learner_runs[run]
    # through the DeepSpeed engine (ZeRO-3 hooks gather the tower's weights) as per-sample HF forwards
    assert result["logprob_error"] < 1e-5
    assert result["text_moved"] == result["text_parameters"]
    if run == "2-True":
        assert result["vision_moved"] == 0  # freeze_visual_encoder: the whole model.visual bit-identical
    else:
        assert result["vision_moved"] == result["vision_parameters"]
    assert result["export_class"] == "Qwen2VLForConditionalGeneration"
    assert result["export_max_difference"] == 0.0
    names = result["sync_names"]
    assert len(names) == result["vision_parameters"] + result["text_parameters"]
    assert sum(name.startswith("model.visual.") for name in names) == result["vision_parameters"]
    assert all(name.startswith(("model.visual.", "model.language_model.", "lm_head.")) for name in names)
    assert result["sync_checksum_mismatches"] == 0
    assert result["sync_max_difference"] == 0.0


def test_sequence_parallelism_with_a_vl_model_is_refused_naming_what_to_use(tiny_vl_checkpoint, processor):
    from rl_learner.models import packed_model_inputs
    from rl_learner.sequence_parallel import SequenceParallelGroup

    model = load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32)
    group = SequenceParallelGroup.__new__(SequenceParallelGroup)  # never used: refused before any collective
    with pytest.raises(ValueError, match="sequence_parallel_size 1"):
        packed_model_inputs(model, build_experience(vl_records(processor)[:1]), sequence_parallel=group)


def test_freeze_visual_encoder_and_all_linear_lora_leave_the_tower_alone(tiny_checkpoint, tiny_vl_checkpoint):
    from rl_learner import apply_lora
    from rl_learner.lora import LoraOptions
    from rl_learner.models import freeze_visual_encoder

    model = load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32)
    frozen = freeze_visual_encoder(model)
    assert frozen == [name for name, _ in model.named_parameters() if name.startswith("model.visual.")]
    assert any(".merger." in name for name in frozen)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in frozen)
    with pytest.raises(ValueError, match="has no vision tower"):
        freeze_visual_encoder(load_causal_lm(tiny_checkpoint, dtype=torch.float32))
    adapted = apply_lora(load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32), LoraOptions(rank=4))
    adapters = [name for name, _ in adapted.named_parameters() if "lora_A" in name]
    assert adapters
    assert not [name for name in adapters if ".visual." in name]  # peft's all-linear alone would adapt 10
    # a tower module named explicitly is adapted: asked for
    asked = apply_lora(
        load_causal_lm(tiny_vl_checkpoint, dtype=torch.float32), LoraOptions(rank=4, target_modules=["qkv"])
    )
    asked_adapters = [name for name, _ in asked.named_parameters() if "lora_A" in name]
    assert len(asked_adapters) == 2
    assert all(".visual." in name for name in asked_adapters)
