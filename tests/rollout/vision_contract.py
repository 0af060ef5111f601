"""The engine contract for image prompts (vision-language models), as a base class of pytest tests.

An engine with `supports("images")` passes `EngineContract` for text and this one for prompts with
images. Plug it in like `EngineContract`: subclass `VisionEngineContract`, give a class-scoped
`engine` fixture that loads `checkpoint` (the session's `tiny_vl_checkpoint`, a tiny Qwen2-VL),
and declare `logprob_atol`.

What it pins, on prompts rendered by `rl_data.vision.VisionProcessor` (expanded layout: n image
tokens per image) with one image, two images of other sizes, none, and the first prompt's ids
with another image:
- shapes and order: `params.n` generations per prompt, in prompt order, with images;
- greedy tokens are the argmax and log-probs the teacher-forced log softmax of a float64
  `transformers` Qwen2-VL given the same pixel values (within `logprob_atol`);
- a batch of mixed prompts (images, several images, text) gives what each prompt gives alone;
- the images matter: the same ids with another image give other log-probs, as in the reference;
- seeded sampling with images is reproducible; `agenerate` from concurrent callers with images
  gives what `generate` gives;
- images that do not fit their prompt (another count of entries, of image tokens, a prompt with
  image tokens and no images) raise EngineError naming the prompt;
- weight sync of the whole VL model as the learner sends it (`rl_learner.sync.sync_layout` /
  `make_sender` over the "file" transport from a `Qwen2VLForConditionalGeneration`: every named
  parameter under its HF name, `model.visual.*` included): the engine's report has the sender's
  checksums for every bucket, the vision weights' buckets among them, and greedy image outputs
  become the reference's under the new vision weights (the language model unchanged, so the
  change can only come from the tower). The original weights are restored afterwards.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_data import compare_checksums
from rl_data.sync import WeightSyncSpec
from rl_data.vision import vision_token_ids
from rl_rollout.protocol import Engine, EngineError, Generation, SamplingParams

__all__ = ["VisionEngineContract", "coloured_image", "vision_reference_logprobs"]

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


def coloured_image(rgb: tuple[int, int, int], size: tuple[int, int] = (56, 56)):
    """A PIL image of one colour with a lighter square, so patches differ within it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, rgb)
    ImageDraw.Draw(image).rectangle((4, 4, 20, 20), fill=tuple(min(255, c + 90) for c in rgb))
    return image


def vision_reference_logprobs(model, prompt, images, response, temperature: float = 1.0):
    """Teacher-forced log softmax(z / T) of `model` (a transformers Qwen2-VL) over the response,
    given the prompt's `ImageInputs` (or None), its placeholder tokens' logits at −∞: (`[R]`
    picked, `[R, V]` rows), float64."""
    ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long)
    kwargs = {"mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if images is not None:
        kwargs["pixel_values"] = images.pixel_values.to(model.dtype)
        kwargs["image_grid_thw"] = images.grid_thw
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0, len(prompt) - 1 : -1]
    # the placeholder tokens are outside the policy's support (rl_data.vision.vision_token_ids)
    logits = logits.index_fill(-1, torch.tensor(vision_token_ids(model.config)), float("-inf"))
    rows = torch.log_softmax(logits.double() / (temperature or 1.0), dim=-1)
    return rows.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1), rows


class VisionEngineContract:
    """Contract tests for an engine's image prompts; subclasses provide the `engine` fixture."""

    logprob_atol: float = 1e-4
    supports_weight_sync: bool = True
    weight_sync_rank: int = 1

    # --- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tiny_vl_checkpoint):
        return tiny_vl_checkpoint

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, checkpoint) -> Engine:
        raise NotImplementedError(
            "a VisionEngineContract subclass must provide a class-scoped `engine` fixture"
        )

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, checkpoint):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float64).eval()

    @pytest.fixture(scope="class")
    @classmethod
    def processor(cls, checkpoint):
        from rl_data.vision import VisionProcessor

        return VisionProcessor.from_pretrained(checkpoint)

    @pytest.fixture(scope="class")
    @classmethod
    def image_prompts(cls, processor):
        """(prompts [4] of expanded ids, images [4]): one image, two images of other sizes, text
        only, and the first prompt's ids with another image."""
        red, blue = coloured_image((200, 30, 30)), coloured_image((30, 30, 200))
        wide, tall = coloured_image((30, 160, 30), (84, 56)), coloured_image((120, 120, 0), (56, 112))
        rendered = [
            processor.render("What colour is <image>?", [red]),
            processor.render("Compare <image> with <image>: which one is wider?", [wide, tall]),
            processor.render("No picture in this one, just words", []),
            processor.render("What colour is <image>?", [blue]),
        ]
        return [ids.tolist() for ids, _, _ in rendered], [inputs for _, inputs, _ in rendered]

    @pytest.fixture(scope="class")
    @classmethod
    def image_greedy_run(cls, engine, image_prompts) -> list[Generation]:
        prompts, images = image_prompts
        return [per_prompt[0] for per_prompt in engine.generate(prompts, GREEDY, images)]

    # --- helpers --------------------------------------------------------------------------------

    def assert_matches_reference(self, model, prompt, images, generation, temperature=0.0, where=""):
        expected, rows = vision_reference_logprobs(model, prompt, images, generation.token_ids, temperature)
        got = torch.tensor(generation.logprobs, dtype=torch.float64)
        error = (got - expected).abs().max().item()
        assert error <= self.logprob_atol, (
            f"{where}: log-probs differ from the float64 reference by up to {error:.3g} (allowed {self.logprob_atol:g})"
        )
        if temperature == 0:
            gap = (rows.max(dim=-1).values - expected).max().item()
            assert gap <= 2 * self.logprob_atol, (
                f"{where}: a greedy token is {gap:.3g} below the reference's best"
            )

    # --- the tests ------------------------------------------------------------------------------

    def test_engine_declares_images(self, engine):
        assert engine.supports("images") is True

    def test_placeholder_tokens_are_never_sampled(self, engine, image_prompts, processor):
        """The image / vision start / vision end tokens are outside the policy's support: over ~2k
        tokens sampled flat (temperature 2) from the random tiny model none appears (unmasked, about
        3 in 489 of its tokens would be one)."""
        prompts, images = image_prompts
        params = SamplingParams(temperature=2.0, n=8, max_new_tokens=64, seed=3, ignore_eos=True)
        sampled = [
            t
            for per_prompt in engine.generate(prompts, params, images)
            for g in per_prompt
            for t in g.token_ids
        ]
        never = {processor.image_token_id, processor.vision_start_token_id, processor.vision_end_token_id}
        assert len(sampled) == 4 * 8 * 64
        assert not never & set(sampled)

    def test_image_prompts_give_n_generations_in_prompt_order(self, engine, image_prompts, image_greedy_run):
        prompts, images = image_prompts
        backward = engine.generate(prompts[::-1], GREEDY, images[::-1])
        assert [g[0].token_ids for g in backward][::-1] == [g.token_ids for g in image_greedy_run]
        sampled = engine.generate(
            prompts[:2], SamplingParams(temperature=1.0, n=3, max_new_tokens=5, seed=1), images[:2]
        )
        assert [len(per_prompt) for per_prompt in sampled] == [3, 3]
        assert all(len(sample.token_ids) == 5 for per_prompt in sampled for sample in per_prompt)

    def test_greedy_image_prompts_match_the_teacher_forced_reference(
        self, image_prompts, image_greedy_run, reference
    ):
        prompts, images = image_prompts
        for index, generation in enumerate(image_greedy_run):
            assert len(generation.token_ids) == GREEDY.max_new_tokens
            self.assert_matches_reference(
                reference, prompts[index], images[index], generation, where=f"prompt {index}"
            )

    def test_sampled_image_logprobs_are_of_the_temperature_scaled_distribution(
        self, engine, image_prompts, reference
    ):
        prompts, images = image_prompts
        params = SamplingParams(temperature=0.7, max_new_tokens=8, seed=11)
        generation = engine.generate(prompts[1:2], params, images[1:2])[0][0]
        self.assert_matches_reference(reference, prompts[1], images[1], generation, 0.7, where="T = 0.7")

    def test_a_mixed_batch_gives_what_each_prompt_gives_alone(self, engine, image_prompts, image_greedy_run):
        prompts, images = image_prompts
        for index in range(len(prompts)):
            alone = engine.generate([prompts[index]], GREEDY, [images[index]])[0][0]
            batched = image_greedy_run[index]
            assert alone.token_ids == batched.token_ids, f"prompt {index}"
            diff = max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs))
            assert diff <= self.logprob_atol, f"prompt {index}: batched log-probs differ by {diff:.3g}"

    def test_the_image_changes_the_output(self, image_prompts, image_greedy_run, reference):
        prompts, images = image_prompts
        assert prompts[0] == prompts[3]
        red, blue = image_greedy_run[0], image_greedy_run[3]
        # the red answer's tokens scored under the blue image: the reference and the engine both see the change
        under_blue, _ = vision_reference_logprobs(reference, prompts[3], images[3], red.token_ids)
        assert (
            under_blue - torch.tensor(red.logprobs, dtype=torch.float64)
        ).abs().max() > 100 * self.logprob_atol
        assert red.token_ids != blue.token_ids or red.logprobs != blue.logprobs

    def test_seeded_sampling_with_images_is_reproducible(self, engine, image_prompts):
        prompts, images = image_prompts
        params = SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=7)
        first = engine.generate(prompts, params, images)
        again = engine.generate(prompts, params, images)
        assert [[s.token_ids for s in p] for p in first] == [[s.token_ids for s in p] for p in again]
        # same ids, other image, same seed: other noise (the images are part of the prompt's seed)
        assert [s.token_ids for s in first[0]] != [s.token_ids for s in first[3]]

    def test_concurrent_agenerate_with_images_matches_generate(self, engine, image_prompts, image_greedy_run):
        prompts, images = image_prompts

        async def run_all():
            return await asyncio.gather(*(engine.agenerate(p, GREEDY, i) for p, i in zip(prompts, images)))

        results = asyncio.run(run_all())
        assert [r[0].token_ids for r in results] == [g.token_ids for g in image_greedy_run]

    def test_images_that_do_not_fit_their_prompt_raise_naming_it(self, engine, image_prompts):
        prompts, images = image_prompts
        with pytest.raises(EngineError, match="2 image entries for 1 prompts"):
            engine.generate(prompts[:1], GREEDY, images[:2])
        with pytest.raises(EngineError, match=r"prompt 1 holds 14 image tokens .* no images were given"):
            engine.generate(prompts[:2], GREEDY, [images[0], None])
        with pytest.raises(EngineError, match=r"prompt 0 holds 4 image tokens .* need 14"):
            engine.generate(prompts[:1], GREEDY, [images[1]])

    # --- weight sync ----------------------------------------------------------------------------

    def test_vision_weight_sync_checksums_match_and_change_generation(
        self, engine, image_prompts, image_greedy_run, reference, checkpoint, tmp_path
    ):
        if not self.supports_weight_sync:
            pytest.skip(f"{type(engine).__name__} declares no weight sync")
        from transformers import AutoModelForImageTextToText

        from rl_learner.sync import make_sender, sync_layout

        prompts, images = image_prompts
        learner = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
        layout = sync_layout(learner, dtype=torch.float32, bucket_bytes=1 << 16)
        names = layout.names()
        assert sorted(names) == sorted(name for name, _ in learner.named_parameters())
        vision_names = [name for name in names if name.startswith("model.visual.")]
        assert vision_names
        assert all(n.startswith(("model.visual.", "model.language_model.", "lm_head.")) for n in names)
        spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path))
        engine.init_weight_sync(spec, self.weight_sync_rank)
        sender = make_sender(spec, learner)
        original = {name: p.detach().clone() for name, p in learner.named_parameters()}
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # new vision weights only: any change in the outputs comes from the tower
            for name, param in learner.named_parameters():
                if name.startswith("model.visual."):
                    param.add_(0.5 * torch.randn(param.shape, generator=generator))
        version = engine.policy_version + 1
        try:
            sent = sender.send(version)
            report = engine.receive_weights(version)
            assert compare_checksums(sent, report) == []
            vision_buckets = {
                index
                for index, bucket in enumerate(layout.buckets)
                if any(param.name.startswith("model.visual.") for param in bucket.params)
            }
            assert vision_buckets
            assert len(report.checksums) == len(layout.buckets)  # every bucket checked, the vision ones too
            updated = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float64).eval()
            updated.load_state_dict(
                {n: p.detach().double() for n, p in learner.named_parameters()}, strict=False
            )
            result = [g[0] for g in engine.generate(prompts, GREEDY, images)]
            for index, generation in enumerate(result):
                assert generation.policy_version == version
                self.assert_matches_reference(
                    updated,
                    prompts[index],
                    images[index],
                    generation,
                    where=f"new vision weights, prompt {index}",
                )
            changed = [r.logprobs != g.logprobs for r, g in zip(result, image_greedy_run)]
            assert changed == [True, True, False, True], "only the prompts with images see the new tower"
        finally:
            with torch.no_grad():
                for name, param in learner.named_parameters():
                    param.copy_(original[name])
            sender.send(version + 1)
            engine.receive_weights(version + 1)
            sender.close()
        restored = [g[0] for g in engine.generate(prompts, GREEDY, images)]
        assert [g.token_ids for g in restored] == [g.token_ids for g in image_greedy_run]
