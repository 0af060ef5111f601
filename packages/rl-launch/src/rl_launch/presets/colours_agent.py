"""A two-turn environment for the colours preset whose second observation is an image.

An agent file (`--rollout.agent_func_path`, OpenRLHF's `--train.agent_func_path`): a class
`AgentInstance` with OpenRLHF's `reset` / `step`, written the way OpenRLHF's VLM agents are
(it needs no `openrlhf` import: `rl_rollout.load_agent_class` takes a plain `AgentInstance`): the dataset prompt brings the first image; after
the model names its colour, `step()` scores it and answers with a second image
("environment_images", marked in the feedback by the model's own placeholder
`<|vision_start|><|image_pad|><|vision_end|>`) and asks again; the second answer is scored and
the episode ends. Each right name earns 0.5, so an episode's reward is 0, 0.5 or 1.

The second image's colour is drawn from the first image's observation text and label (a CRC of
them), so the n samples of a GRPO group see the same second image and their rewards compare.

    rl-launch ppo --preset colours --rollout.agent_func_path \\
        "$(python -c 'import rl_launch.presets.colours_agent as m; print(m.__file__)')"
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from rl_launch.presets.colours import COLOURS, colour_image, score_response

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SECOND_TURN = f"\n<|im_start|>user\n{IMAGE}And this one?<|im_end|>\n<|im_start|>assistant\n"


class AgentInstance:
    """Turn 1: the prompt's image; turn 2: an image the environment draws."""

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        self.turn = 0
        seed = zlib.crc32(f"{states['observation']}|{states.get('label')}".encode())
        self.rng = random.Random(seed)
        self.second = self.rng.choice(sorted(COLOURS))
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        self.turn += 1
        if self.turn == 1:
            reward = 0.5 * score_response(states["action_text"], states["label"])
            return {
                "rewards": reward,
                "scores": reward,
                "environment_feedback": SECOND_TURN,
                "environment_images": [colour_image(self.second, self.rng)],
                "done": False,
            }
        reward = 0.5 * score_response(states["action_text"], self.second)
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True}
