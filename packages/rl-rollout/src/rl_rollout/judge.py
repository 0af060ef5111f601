"""A judge model as a reward source: a frozen LLM scores each completion from a prompt template.

For each sample of a batch, `JudgeReward` renders a template with the sample's `{prompt}`,
`{response}` and `{label}` (a Python format string; literal braces doubled), optionally through
the judge tokenizer's chat template as one user message, asks the judge engine (any `Engine`:
HF, vLLM, an OpenAI-compatible server) for one greedy completion of at most `max_new_tokens`
tokens, and reads a score from the answer with a parser chosen by name (`JUDGE_PARSERS`):

    score_tag    the number inside the last <score>...</score>
    last_number  the last number anywhere in the answer
    yes_no       1.0 for an answer whose first word is yes, 0.0 for no

reward = scale · score. The whole batch is one call with the deadline `timeout_s`, and the error
policy is `BatchedReward`'s: past the deadline (a hung judge) the call is abandoned, an engine
that raises fails the batch, an answer no parser can read fails its sample; each is an error
(`on_error="raise"`) or the `fallback` reward, counted in `metrics()` like any reward source.
`extra_logs` carry `judge/parse_failed` ([B]: 1.0 where the answer gave no score; its mean over a
step is the fraction of unparsable answers) and `judge/seconds` (the call's wall time).

    judge = JudgeReward(engine, tokenizer, "Q: {prompt}\\nA: {response}\\nCorrect? yes or no:", parser="yes_no")
    judge(queries, prompts, labels).rewards
"""

from __future__ import annotations

import math
import re
import string
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .rewards import (
    BatchedReward,
    RewardError,
    RewardOutput,
    _parse_number,
    check_reward_inputs,
    extract_numeric_answer,
    response_text,
)

__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "JUDGE_FIELDS",
    "JUDGE_PARSERS",
    "JudgeReward",
    "check_judge_template",
    "load_judge_template",
    "render_judge_prompt",
]

JUDGE_FIELDS = ("prompt", "response", "label")
"""The placeholders a judge template may use."""

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response to a task.\n\n"
    "Task:\n{prompt}\n\n"
    "Reference answer:\n{label}\n\n"
    "Response:\n{response}\n\n"
    "Rate the response from 0 (wrong) to 10 (fully correct). "
    "Answer with the score inside <score></score>, e.g. <score>7</score>."
)
"""The template when none is given: for the `score_tag` parser (scale 0.1 gives a reward in [0, 1])."""

_SCORE_TAG = re.compile(r"<score>\s*(.*?)\s*</score>", re.DOTALL | re.IGNORECASE)
_FIRST_WORD = re.compile(r"[A-Za-z]+")


def parse_score_tag(answer: str) -> float | None:
    """The number inside the last `<score>...</score>` of `answer` (`7`, `0.5`, `3/4`); None when
    there is no tag or its content is not a number."""
    tags = _SCORE_TAG.findall(answer)
    return _parse_number(tags[-1]) if tags else None


def parse_last_number(answer: str) -> float | None:
    """The last number in `answer` (`extract_numeric_answer`'s "last": `1,234` is 1234); None when
    it has none."""
    return extract_numeric_answer(answer, order=("last",))


def parse_yes_no(answer: str) -> float | None:
    """1.0 when the answer's first word is yes, 0.0 when it is no (any case); None otherwise."""
    word = _FIRST_WORD.search(answer)
    verdict = word.group(0).lower() if word else ""
    return {"yes": 1.0, "no": 0.0}.get(verdict)


JUDGE_PARSERS: dict[str, Callable[[str], float | None]] = {
    "score_tag": parse_score_tag,
    "last_number": parse_last_number,
    "yes_no": parse_yes_no,
}
"""Parser name -> `parse(answer) -> score or None` (None: the answer holds no score)."""


def check_judge_template(template: str, where: str = "template") -> str:
    """`template` when it is a format string whose placeholders are all in `JUDGE_FIELDS` and
    that uses at least `{response}`; else ValueError naming `where` and the placeholder."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{where}: expected a non-empty format string, got {template!r}")
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as error:  # an unmatched brace
        raise ValueError(
            f"{where}: not a valid format string ({error}); write literal braces as {{{{ }}}}"
        ) from None
    for field in fields:
        if field not in JUDGE_FIELDS:
            raise ValueError(
                f"{where}: placeholder {{{field}}} is not one of "
                + ", ".join(f"{{{name}}}" for name in JUDGE_FIELDS)
                + " (write literal braces as {{ }})"
            )
    if "response" not in fields:
        raise ValueError(f"{where}: the template never shows the judge the {{response}} it scores")
    return template


def load_judge_template(value: str | None, where: str = "template") -> str:
    """The template of `value`: `DEFAULT_JUDGE_TEMPLATE` for None, the text of the file `value`
    when it names one (a value without `{` is a path: a missing file is an error), else `value`
    itself; checked (`check_judge_template`)."""
    if value is None:
        return DEFAULT_JUDGE_TEMPLATE
    if "{" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(
                f"{where}: {value!r} has no {{response}} placeholder and is not a file; give a format "
                "string with {prompt} / {response} / {label} or the path of a file holding one"
            )
        return check_judge_template(path.read_text(encoding="utf-8"), f"{where} (file {value})")
    return check_judge_template(value, where)


def render_judge_prompt(template: str, prompt: str, response: str, label: Any) -> str:
    """The template with the sample's prompt, response and label (None shows as an empty string)."""
    return template.format(prompt=prompt, response=response, label="" if label is None else str(label))


class JudgeReward:
    """A frozen judge model's score of each sample, as a `RewardFunction` (see the module docstring).

    engine: an `rl_rollout.Engine` serving the judge (never weight-synced here). tokenizer: the
    judge's (an HF tokenizer: `encode`, `decode`, `apply_chat_template`). template: a checked
    format string (`load_judge_template`). chat_template: render the filled template as one user
    message through the tokenizer's chat template (with the generation prompt). parser: a name in
    `JUDGE_PARSERS`. scale: reward = scale · score. timeout_s: deadline of one batch's call (None:
    inline, no deadline). on_error / fallback: `BatchedReward`'s policy.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        template: str | None = None,
        *,
        parser: str = "score_tag",
        max_new_tokens: int = 64,
        chat_template: bool = False,
        scale: float = 1.0,
        timeout_s: float | None = 300.0,
        on_error: str = "raise",
        fallback: float = 0.0,
        name: str = "judge",
    ) -> None:
        if parser not in JUDGE_PARSERS:
            raise ValueError(f"parser: {parser!r} is not one of {sorted(JUDGE_PARSERS)}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {max_new_tokens!r} is not allowed; expected an integer >= 1")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{name}: chat_template is on, but the judge's tokenizer has no chat template; turn it off "
                "(the filled template is then the judge's whole prompt)"
            )
        self.engine, self.tokenizer = engine, tokenizer
        self.template = load_judge_template(template)
        self.parser, self.parse = parser, JUDGE_PARSERS[parser]
        self.max_new_tokens, self.chat_template, self.scale = max_new_tokens, chat_template, float(scale)
        self.name = name
        self._batched = BatchedReward(
            self._score, name=name, on_error=on_error, fallback=fallback, timeout_s=timeout_s
        )

    def prompt_ids(self, prompt: str, response: str, label: Any) -> list[int]:
        """The token ids the judge is asked to continue for one sample."""
        text = render_judge_prompt(self.template, prompt, response, label)
        if self.chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def answers(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> list[str]:
        """The judge's greedy answer text for each sample (one engine call for the batch)."""
        from .protocol import SamplingParams

        ids = [
            self.prompt_ids(prompt, response_text(query, prompt), label)
            for query, prompt, label in zip(queries, prompts, labels, strict=True)
        ]
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens, n=1, logprobs=False)
        generations = self.engine.generate(ids, params)
        return [self.tokenizer.decode(group[0].token_ids, skip_special_tokens=True) for group in generations]

    def _score(self, queries: list[str], prompts: list[str], labels: list[Any]) -> RewardOutput:
        """The batch's rewards; an answer without a (finite) score raises or gets the fallback."""
        start = time.monotonic()
        answers = self.answers(queries, prompts, labels)
        if len(answers) != len(queries):
            raise RewardError(
                f"{self.name}: the judge engine answered {len(answers)} of {len(queries)} prompts"
            )
        policy = self._batched.policy
        rewards, failed = [], []
        for index, answer in enumerate(answers):
            score = self.parse(answer)
            if score is None or not math.isfinite(score):
                policy.fail(  # raises under on_error="raise"
                    f"{self.name}: sample {index}: parser {self.parser!r} found no score in the judge's "
                    f"answer {answer[:200]!r}"
                )
                failed.append(index)
                rewards.append(policy.fallback)
            else:
                rewards.append(self.scale * score)
        logs = {
            "judge/parse_failed": [float(index in failed) for index in range(len(answers))],
            "judge/seconds": time.monotonic() - start,
        }
        return RewardOutput(rewards=rewards, scores=list(rewards), extra_logs=logs, fallback_indices=failed)

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]) -> RewardOutput:
        check_reward_inputs(queries, prompts, labels, self.name)
        return self._batched(queries, prompts, labels)

    def metrics(self) -> dict[str, float]:
        return self._batched.metrics()
