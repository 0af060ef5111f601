"""The judge reward: parsers, template checks and rendering, and `JudgeReward` on a fake judge engine
(its answers, a hung judge past the deadline, an unparsable answer under both error policies)."""

from __future__ import annotations

import logging
import threading

import pytest

from rl_rollout import JUDGE_PARSERS, JudgeReward, RewardError, SamplingParams, load_judge_template
from rl_rollout.judge import DEFAULT_JUDGE_TEMPLATE, check_judge_template, render_judge_prompt
from rl_rollout.protocol import Generation

PROMPTS = ["Q: 2+2? A:", "Q: 7*6? A:"]
RESPONSES = [" 4", " 41"]
LABELS = ["4", "42"]
QUERIES = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
TEMPLATE = "{prompt}|{response}|{label}"


@pytest.mark.parametrize(
    ("parser", "answer", "score"),
    [
        ("score_tag", "thinking... <score>7</score>", 7.0),
        ("score_tag", "<score>2</score> no, <score> 0.5 </score>", 0.5),
        ("score_tag", "<SCORE>3/4</SCORE>", 0.75),
        ("score_tag", "the score is 9", None),
        ("score_tag", "<score>high</score>", None),
        ("last_number", "between 3 and 8.5, so 6", 6.0),
        ("last_number", "score: -2", -2.0),
        ("last_number", "no digits here", None),
        ("yes_no", "Yes, it is right", 1.0),
        ("yes_no", "  no.", 0.0),
        ("yes_no", "maybe yes", None),
        ("yes_no", "", None),
    ],
)
def test_judge_parsers_read_the_score_or_none(parser, answer, score):
    assert JUDGE_PARSERS[parser](answer) == score


def test_judge_template_names_a_wrong_placeholder_a_missing_response_and_a_bad_brace():
    assert check_judge_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match=r"reward.judge_template: placeholder \{answer\} is not one of"):
        check_judge_template("{prompt} {answer}", "reward.judge_template")
    with pytest.raises(ValueError, match=r"never shows the judge the \{response\}"):
        check_judge_template("{prompt} {label}")
    with pytest.raises(ValueError, match="not a valid format string"):
        check_judge_template("{response} {")
    check_judge_template(DEFAULT_JUDGE_TEMPLATE)


def test_judge_template_from_a_file_a_string_or_the_default(tmp_path):
    path = tmp_path / "judge.txt"
    path.write_text("Grade {response} against {label}: ")
    assert load_judge_template(str(path)) == "Grade {response} against {label}: "
    assert load_judge_template(TEMPLATE) == TEMPLATE
    assert load_judge_template(None) == DEFAULT_JUDGE_TEMPLATE
    with pytest.raises(
        ValueError, match=r"t: 'missing.txt' has no \{response\} placeholder and is not a file"
    ):
        load_judge_template("missing.txt", "t")
    path.write_text("Grade {reply}")
    with pytest.raises(ValueError, match=r"file .*judge.txt.*placeholder \{reply\}"):
        load_judge_template(str(path))


def test_render_judge_prompt_fills_the_three_fields_and_keeps_literal_braces():
    assert render_judge_prompt("{{x}} {prompt}/{response}/{label}", "p", "r", None) == "{x} p/r/"
    assert render_judge_prompt(TEMPLATE, "p", "r", 42) == "p|r|42"


class CharTokenizer:
    """One token per character (ids are code points); `chat_template` wraps the user message."""

    chat_template = "<user>{content}</user><assistant>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        assert tokenize
        assert add_generation_prompt
        assert len(messages) == 1
        return self.encode(self.chat_template.format(content=messages[0]["content"]))


class FakeJudge:
    """A judge engine answering `answer(prompt_text)`; records what it was asked."""

    def __init__(self, answer, block: threading.Event | None = None):
        self.answer, self.block, self.calls = answer, block, []

    def generate(self, prompts, params):
        self.calls.append(([CharTokenizer().decode(p) for p in prompts], params))
        if self.block is not None:
            self.block.wait(10)
        return [
            [
                Generation(
                    token_ids=CharTokenizer().encode(self.answer(CharTokenizer().decode(p))),
                    logprobs=None,
                    finish_reason="stop",
                )
            ]
            for p in prompts
        ]


def _grade(text):  # the fake judge's verdict: right when the response equals the label
    _, response, label = text.removeprefix("<user>").removesuffix("</user><assistant>").split("|")
    return f"<score>{10 if response.strip() == label else 2}</score>"


def test_judge_reward_scores_each_sample_from_the_judges_greedy_answer():
    engine = FakeJudge(_grade)
    judge = JudgeReward(engine, CharTokenizer(), TEMPLATE, max_new_tokens=7, scale=0.1, timeout_s=None)
    output = judge(QUERIES, PROMPTS, LABELS)
    assert output.rewards == pytest.approx([1.0, 0.2])
    assert output.fallback_indices == []
    ((asked, params),) = engine.calls
    assert asked == ["Q: 2+2? A:| 4|4", "Q: 7*6? A:| 41|42"]  # the response is the query minus the prompt
    assert params == SamplingParams(temperature=0.0, max_new_tokens=7, n=1, logprobs=False)
    assert output.extra_logs["judge/parse_failed"] == [0.0, 0.0]
    assert output.extra_logs["judge/seconds"] >= 0.0


def test_judge_reward_through_the_chat_template():
    engine = FakeJudge(_grade)
    judge = JudgeReward(engine, CharTokenizer(), TEMPLATE, chat_template=True, timeout_s=None)
    assert judge(QUERIES, PROMPTS, LABELS).rewards == [10.0, 2.0]
    assert engine.calls[0][0][0] == "<user>Q: 2+2? A:| 4|4</user><assistant>"


def test_judge_reward_refuses_a_chat_template_the_tokenizer_lacks_and_an_unknown_parser():
    tokenizer = CharTokenizer()
    tokenizer.chat_template = None
    with pytest.raises(
        ValueError, match="chat_template is on, but the judge's tokenizer has no chat template"
    ):
        JudgeReward(FakeJudge(_grade), tokenizer, TEMPLATE, chat_template=True)
    with pytest.raises(
        ValueError, match=r"parser: 'score' is not one of \['last_number', 'score_tag', 'yes_no'\]"
    ):
        JudgeReward(FakeJudge(_grade), CharTokenizer(), TEMPLATE, parser="score")


def test_judge_reward_unparsable_answer_raises_or_falls_back_for_that_sample(caplog):
    def answer(text):
        return "<score>8</score>" if "2+2" in text else "I cannot say"

    raising = JudgeReward(FakeJudge(answer), CharTokenizer(), TEMPLATE, timeout_s=None)
    with pytest.raises(
        RewardError, match="sample 1: parser 'score_tag' found no score in the judge's answer 'I cannot say'"
    ):
        raising(QUERIES, PROMPTS, LABELS)
    lenient = JudgeReward(
        FakeJudge(answer), CharTokenizer(), TEMPLATE, timeout_s=None, on_error="fallback", fallback=-1.0
    )
    with caplog.at_level(logging.WARNING):
        output = lenient(QUERIES, PROMPTS, LABELS)
    (warning,) = [record.getMessage() for record in caplog.records]  # one line, with the answer
    assert "sample 1: parser 'score_tag' found no score in the judge's answer 'I cannot say'" in warning
    assert output.rewards == [8.0, -1.0]
    assert output.fallback_indices == [1]
    assert output.timeout_indices == []
    assert output.extra_logs["judge/parse_failed"] == [0.0, 1.0]
    assert lenient.metrics()["reward/fallbacks"] == 1.0


def test_judge_reward_hung_judge_is_abandoned_at_the_deadline_under_both_policies():
    release = threading.Event()
    try:
        raising = JudgeReward(FakeJudge(_grade, block=release), CharTokenizer(), TEMPLATE, timeout_s=0.05)
        with pytest.raises(RewardError, match=r"judge: .*0\.05"):
            raising(QUERIES, PROMPTS, LABELS)
        lenient = JudgeReward(
            FakeJudge(_grade, block=release),
            CharTokenizer(),
            TEMPLATE,
            timeout_s=0.05,
            on_error="fallback",
            fallback=0.5,
        )
        output = lenient(QUERIES, PROMPTS, LABELS)
        assert output.rewards == [0.5, 0.5]
        assert output.timeout_indices == [0, 1]
        assert lenient.metrics()["reward/timeouts"] == 2.0
    finally:
        release.set()


def test_judge_reward_an_infinite_score_is_no_score():
    judge = JudgeReward(
        FakeJudge(lambda text: "1e999"), CharTokenizer(), TEMPLATE, parser="last_number", timeout_s=None,
        on_error="fallback", fallback=0.0,
    )  # fmt: skip
    output = judge(QUERIES, PROMPTS, LABELS)
    assert output.rewards == [0.0, 0.0]
    assert output.fallback_indices == [0, 1]
