"""Image prompts in rl_rollout on the HF engine (vision-language models, issue 29).

The vision engine contract on `HFEngine` with the tiny Qwen2-VL, one engine for the module; the
executors with images (single turn: the prompt's images reach the engine and the record;
multi-turn: an environment that answers with a coloured image); engines without images refuse
them; and every name the learner sends for a Qwen2-VL is one vLLM's Qwen2-VL loader maps.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest
import torch

from rl_data import PromptSample
from rl_data.vision import VisionProcessor
from rl_rollout import MultiTurnExecutor, SingleTurnExecutor
from rl_rollout.engines.hf import HFEngine
from rl_rollout.protocol import EngineError, SamplingParams
from rl_rollout.rewards import BatchedReward
from tests.rollout.vision_contract import (
    GREEDY,
    VisionEngineContract,
    coloured_image,
    vision_reference_logprobs,
)


@pytest.fixture(scope="module")
def vl_engine(tiny_vl_checkpoint):
    engine = HFEngine(tiny_vl_checkpoint, dtype="float32", max_model_len=256, max_batch_size=16, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def processor(tiny_vl_checkpoint):
    return VisionProcessor.from_pretrained(tiny_vl_checkpoint)


class TestHFEngineVision(VisionEngineContract):
    logprob_atol = 2e-5

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, vl_engine):
        return vl_engine


def test_an_engine_without_a_vl_model_refuses_images(tokenizer, processor):
    from rl_data.tiny import build_tiny_model

    engine = HFEngine(build_tiny_model(tokenizer), tokenizer, max_model_len=64)
    assert engine.supports("images") is False
    _, images, _ = processor.render("<image>", [coloured_image((9, 9, 9))])
    with pytest.raises(EngineError, match="need a vision-language model"):
        engine.generate([[1, 2, 3]], GREEDY, [images])
    assert len(engine.generate([[1, 2, 3]], GREEDY, [None])[0][0].token_ids) == GREEDY.max_new_tokens


def _length_reward():
    return BatchedReward(lambda queries, prompts, labels: [float(len(q)) for q in queries])


def test_single_turn_records_carry_the_prompt_images(vl_engine, processor):
    ids, images, text = processor.render("What colour is <image>?", [coloured_image((200, 30, 30))])
    samples = [
        PromptSample(prompt_ids=ids, prompt=text, images=images, index=0),
        PromptSample(prompt_ids=processor.render("Plain words", [])[0], prompt="Plain words", index=1),
    ]
    executor = SingleTurnExecutor(vl_engine, _length_reward(), processor.tokenizer, GREEDY)
    records = executor.run(samples)
    assert records[0].images is images
    assert records[1].images is None
    direct = vl_engine.generate([ids.tolist()], GREEDY, [images])[0][0]
    assert records[0].response_ids.tolist() == direct.token_ids
    assert records[0].rollout_logprobs.tolist() == pytest.approx(direct.logprobs, abs=1e-6)


class ColourEnvironment:
    """Answers the first action with a picture (a blue square) and the second with done."""

    mark = "<image>"  # where the picture goes in the feedback text

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, states):
        return {"observation": states["observation"]}

    async def step(self, states):
        self.turn += 1
        if self.turn == 1:
            return {
                "rewards": 0.0,
                "done": False,
                "environment_feedback": f"\nYou see {self.mark}. Name it.\n",
                "environment_images": [coloured_image((30, 30, 200))],
            }
        return {"rewards": 1.0, "done": True, "environment_feedback": ""}


@pytest.mark.parametrize("mark", ["<image>", "model"])
def test_multi_turn_image_feedback_is_environment_tokens_and_the_next_turn_sees_every_image(
    vl_engine, processor, tiny_vl_checkpoint, mark
):
    """The picture's place is marked "<image>" or, as OpenRLHF's VLM agents write it, by the model's
    own placeholder text (<|vision_start|><|image_pad|><|vision_end|>): the same ids either way."""
    ids, prompt_images, text = processor.render("What colour is <image>?", [coloured_image((200, 30, 30))])
    sample = PromptSample(prompt_ids=ids, prompt=text, images=prompt_images, index=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    environment = type(
        "Env", (ColourEnvironment,), {"mark": processor.image_text if mark == "model" else "<image>"}
    )
    executor = MultiTurnExecutor(
        vl_engine, processor.tokenizer, params, env=environment, max_turns=3, vision=processor
    )
    [record] = executor.run([sample])
    assert record.extra["turns"] == 2
    assert record.reward == 1.0
    (_first_start, first_end), (second_start, second_end) = record.extra["action_ranges"]
    feedback = record.response_ids[first_end:second_start].tolist()
    turn_ids, turn_images = processor.image_turn([coloured_image((30, 30, 200))])
    tokens = processor.tokenizer
    expected = (
        tokens("\nYou see ", add_special_tokens=False)["input_ids"]
        + turn_ids.tolist()
        + tokens(". Name it.\n", add_special_tokens=False)["input_ids"]
    )
    assert feedback == expected
    mask = record.action_mask.tolist()
    assert mask[first_end:second_start] == [False] * len(feedback)
    assert record.rollout_logprobs[first_end:second_start].tolist() == [0.0] * len(feedback)
    # the record's images: the prompt's, then the environment's, in the order of their runs
    assert record.images.num_images == 2
    assert torch.equal(
        record.images.pixel_values, torch.cat([prompt_images.pixel_values, turn_images.pixel_values])
    )
    assert torch.equal(record.images.grid_thw, torch.cat([prompt_images.grid_thw, turn_images.grid_thw]))
    # the second action was generated from prompt + everything before it, with both images
    history = ids.tolist() + record.response_ids[:second_start].tolist()
    second = vl_engine.generate([history], params, [record.images])[0][0]
    assert record.response_ids[second_start:second_end].tolist() == second.token_ids
    from transformers import AutoModelForImageTextToText

    reference = AutoModelForImageTextToText.from_pretrained(tiny_vl_checkpoint, dtype=torch.float64).eval()
    expected_logprobs, _ = vision_reference_logprobs(reference, history, record.images, second.token_ids)
    got = record.rollout_logprobs[second_start:second_end].double()
    assert (got - expected_logprobs).abs().max() < 2e-5


def test_image_feedback_needs_a_processor_and_one_placeholder_per_image(
    vl_engine, processor, tiny_vl_checkpoint
):
    ids, images, text = processor.render("What colour is <image>?", [coloured_image((200, 30, 30))])
    sample = PromptSample(prompt_ids=ids, prompt=text, images=images, index=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    without = MultiTurnExecutor(vl_engine, processor.tokenizer, params, env=ColourEnvironment, max_turns=2)
    with pytest.raises(Exception, match="no VisionProcessor"):
        without.run([sample])

    class TwoImagesOnePlaceholder(ColourEnvironment):
        async def step(self, states):
            result = await super().step(states)
            result["environment_images"] = [coloured_image((1, 2, 3))] * 2
            return result

    executor = MultiTurnExecutor(  # a folder works as well as a processor (a config gives a path)
        vl_engine,
        processor.tokenizer,
        params,
        env=TwoImagesOnePlaceholder,
        max_turns=2,
        vision=str(tiny_vl_checkpoint),
    )
    with pytest.raises(Exception, match="2 environment_images but its feedback holds 1"):
        executor.run([sample])


def test_feedback_cut_at_max_length_never_cuts_an_image_run(vl_engine, processor):
    ids, images, text = processor.render("What colour is <image>?", [coloured_image((200, 30, 30))])
    sample = PromptSample(prompt_ids=ids, prompt=text, images=images, index=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    prefix = len(processor.tokenizer("\nYou see ", add_special_tokens=False)["input_ids"])
    # room for the action and the text before the image, and 3 of the image's 6 tokens
    limit = len(ids) + 4 + prefix + 3
    executor = MultiTurnExecutor(
        vl_engine, processor.tokenizer, params, env=ColourEnvironment, max_length=limit, vision=processor
    )
    [record] = executor.run([sample])
    assert record.finish_reason == "length"
    assert len(record.response_ids) == 4 + prefix
    assert record.images.num_images == 1  # the prompt's only: the environment's image did not fit


def _vllm_qwen2_vl_prefix_map() -> dict[str, str]:
    """`orig_to_new_prefix` of vLLM's `Qwen2VLForConditionalGeneration.hf_to_vllm_mapper`, read
    from the installed source (importing it needs torchvision, which this machine lacks)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed")
    source = pathlib.Path(spec.submodule_search_locations[0], "model_executor", "models", "qwen2_vl.py")
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "Qwen2VLForConditionalGeneration":
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and getattr(item.targets[0], "id", None) == "hf_to_vllm_mapper"
                ):
                    for keyword in item.value.keywords:
                        if keyword.arg == "orig_to_new_prefix":
                            return ast.literal_eval(keyword.value)
    raise AssertionError(f"{source}: no Qwen2VLForConditionalGeneration.hf_to_vllm_mapper.orig_to_new_prefix")


def test_every_name_the_learner_sends_is_mapped_by_vllms_qwen2_vl_loader(tiny_vl_checkpoint):
    from transformers import AutoModelForImageTextToText

    from rl_learner.sync import sync_layout

    prefixes = _vllm_qwen2_vl_prefix_map()
    names = sync_layout(AutoModelForImageTextToText.from_pretrained(tiny_vl_checkpoint)).names()

    def mapped(name: str) -> str:  # vLLM's WeightsMapper: the first prefix that matches, once
        for old, new in prefixes.items():
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    targets = {mapped(name).split(".", 2)[0] + "." + mapped(name).split(".", 2)[1] for name in names}
    assert targets == {
        "visual.patch_embed",
        "visual.blocks",
        "visual.merger",
        "language_model.model",
        "language_model.lm_head",
    }
    assert all(mapped(n).startswith("visual.") for n in names if n.startswith("model.visual."))


# An agent file shaped like OpenRLHF's VLM multi-turn example (examples/python/vlm_multiturn_agent.py):
# it imports openrlhf's base classes (the loader's stand-in here), returns tensors as rewards, and
# marks a screenshot in its feedback with the model's own placeholder text.
OPENRLHF_STYLE_VLM_AGENT = """
import torch
from PIL import Image

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        self.step_idx = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.step_idx += 1
        if self.step_idx >= 2:
            return {"rewards": torch.tensor(1.0), "scores": torch.tensor(1.0),
                    "environment_feedback": "", "done": True, "extra_logs": {"steps": self.step_idx}}
        screenshot = Image.new("RGB", (56, 56), (10, 200, 10))
        return {
            "rewards": torch.tensor(0.0),
            "environment_feedback": "\\n<|im_start|>user\\n" + PLACEHOLDER + "\\nWhat next?<|im_end|>\\n<|im_start|>assistant\\n",
            "environment_images": [screenshot],
            "done": False,
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_an_openrlhf_style_vlm_agent_file_runs_unchanged(vl_engine, processor, tmp_path):
    agent = tmp_path / "vlm_multiturn_agent.py"
    agent.write_text(OPENRLHF_STYLE_VLM_AGENT)
    ids, images, text = processor.render("<image>Where do we click?", [coloured_image((200, 30, 30))])
    sample = PromptSample(prompt_ids=ids, prompt=text, images=images, index=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    executor = MultiTurnExecutor(
        vl_engine, processor.tokenizer, params, env=str(agent), max_turns=4, vision=processor
    )
    [record] = executor.run([sample])
    assert record.extra["turns"] == 2
    assert record.reward == 1.0
    assert record.images.num_images == 2  # the prompt's picture and the screenshot
    placed = int((record.response_ids == processor.image_token_id).sum())
    assert placed == processor.num_image_tokens(record.images.grid_thw)[1]
    assert not record.action_mask[record.response_ids == processor.image_token_id].any()
