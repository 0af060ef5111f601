"""The calculator task's pieces (fast): the tool, the problems, the lazy teacher's demonstrations
(parsed back by the hermes parser) and the warm start's segment mask. The model it builds is
trained end to end in test_tool_calling_e2e.py."""

from __future__ import annotations

import pytest

from rl_launch.presets import calculator
from rl_launch.presets.calculator_tools import calculator as calculator_tool
from rl_launch.warm_start import tokenize_examples
from rl_rollout import TOOL_PARSERS, ToolCall, load_tools


def test_the_calculator_tool_evaluates_integer_arithmetic_only():
    assert calculator_tool("647 + 704") == "1351"
    assert calculator_tool(" (2 - 5) * -3 ") == "9"
    with pytest.raises(
        ValueError, match=r"only integers, \+, - and \* are supported, not \"__import__\('os'\)\""
    ):
        calculator_tool("__import__('os')")
    with pytest.raises(ValueError, match=r"'2 \+' is not an arithmetic expression"):
        calculator_tool("2 +")
    [tool] = load_tools(calculator.TOOLS_PATH)
    assert tool.parameters["properties"] == {
        "expression": {"type": "string", "description": 'for example "123 + 456".'}
    }


def test_problems_are_four_digit_sums_and_the_splits_never_share_one():
    train = calculator.make_problems(300, seed=0, split="train")
    evaluation = calculator.make_problems(50, seed=0, split="eval")
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in evaluation}
    for row in train + evaluation:
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert 500 <= a <= 999
        assert 500 <= b <= 999
        assert row["label"] == str(a + b)
        assert len(row["label"]) == 4
    assert len({row["prompt"] for row in train}) == 300


def test_the_teacher_calls_the_tool_or_guesses_and_the_parser_reads_its_call(make_tokenizer):
    tokenizer = make_tokenizer("chatml-tools")
    [tool_demo, guess] = calculator.demonstrations(
        tokenizer, [{"prompt": "What is 647 + 704?", "label": "1351"}]
    )
    prompt, segments = tool_demo
    assert prompt == (
        "<|im_start|>system\nTools: calculator(expression)<|im_end|>\n"
        "<|im_start|>user\nWhat is 647 + 704?<|im_end|>\n<|im_start|>assistant\n"
    )
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "647 + 704"}}</tool_call><|im_end|>'
    assert segments == [
        (call, True),
        ("\n<|im_start|>tool\n1351<|im_end|>\n<|im_start|>assistant\n", False),
        ("1351<|im_end|>", True),
    ]
    assert TOOL_PARSERS["hermes"].parse(call).calls == [
        ToolCall(id="call_0", name="calculator", arguments={"expression": "647 + 704"})
    ]
    assert guess[0] == prompt
    assert guess[1].endswith("<|im_end|>")
    assert guess[1][:-10] != "1351"
    assert 1000 <= int(guess[1][:-10]) <= 1998
    [(_prompt_ids, response_ids, mask)] = tokenize_examples(tokenizer, [tool_demo])
    tool_ids = tokenizer(segments[1][0], add_special_tokens=False)["input_ids"]
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    assert response_ids[len(call_ids) : len(call_ids) + len(tool_ids)] == tool_ids
    assert mask == [True] * len(call_ids) + [False] * len(tool_ids) + [True] * (
        len(response_ids) - len(call_ids) - len(tool_ids)
    )
    with pytest.raises(
        ValueError, match=r"examples\[0\]: the response must be a string or a list of \(text, trained\)"
    ):
        tokenize_examples(tokenizer, [("a", [("b", 1)])])
