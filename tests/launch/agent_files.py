"""Agent files of the launcher tests, written the OpenRLHF way (`openrlhf.utils.agent` classes)."""

from __future__ import annotations

FEEDBACK = "\nThe environment says: now give a number.\n"

TWO_TURN_AGENT = f'''
import re

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

FEEDBACK = {FEEDBACK!r}


class AgentInstance(AgentInstanceBase):
    """Two turns: the first action gets FEEDBACK back; the second is scored (1 if it holds a digit)."""

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states, **kwargs):
        self.turn += 1
        if self.turn == 1:
            reward, feedback, done = 0.0, FEEDBACK, False
        else:
            reward = 1.0 if re.search(r"[0-9]", states["action_text"]) else 0.0
            feedback, done = "", True
        return {{
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {{"second_turn": torch.tensor(float(self.turn == 2))}},
        }}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''

# The same two-turn agent written against the OpenAI API, for rollout.executor agent_server.
RUN_AGENT = f'''
import re

FEEDBACK = {FEEDBACK!r}


async def run_agent(client, prompt, label):
    """Two requests: the second adds FEEDBACK as a user message; 1 if the second reply holds a digit."""
    messages = [{{"role": "user", "content": prompt}}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [
        {{"role": "assistant", "content": first.choices[0].message.content}},
        {{"role": "user", "content": FEEDBACK}},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages)
    reward = 1.0 if re.search(r"[0-9]", second.choices[0].message.content or "") else 0.0
    return {{"reward": reward, "extra_logs": {{"second_turn": 1.0}}}}
'''
