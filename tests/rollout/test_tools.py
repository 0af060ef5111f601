"""Tools: schemas from signatures and docstrings, every spec form, the hermes parser on golden
strings (malformed ones included) and call_tool's four error kinds."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal, Optional

import pytest

from rl_rollout import (
    TOOL_PARSERS,
    ParsedToolCalls,
    Tool,
    ToolCall,
    call_tool,
    load_tools,
    openai_tool_schemas,
    register_tool_parser,
    tool_from_function,
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Longer text that is not the summary.

    Args:
        a: the first term.
        b: the second term, which
            goes on over two lines.

    Returns:
        The sum.
    """
    return a + b


def search(query: str, tags: list[str], mode: Literal["fast", "exact"] = "fast", limit: Optional[int] = None):  # noqa: UP045
    """Search documents."""
    return [query, tags, mode, limit]


def test_schema_from_signature_and_google_docstring():
    tool = tool_from_function(add)
    assert tool.schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first term."},
                    "b": {
                        "type": "integer",
                        "description": "the second term, which goes on over two lines.",
                        "default": 0,
                    },
                },
                "required": ["a"],
            },
        },
    }


def test_schema_of_lists_literals_and_optionals():
    parameters = tool_from_function(search).parameters
    assert parameters["properties"] == {
        "query": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "mode": {"enum": ["fast", "exact"], "type": "string", "default": "fast"},
        "limit": {"type": "integer"},
    }
    assert parameters["required"] == ["query", "tags"]

    def pick(flag: bool, weights: list[float], choice: int | None) -> None:
        """Pick."""

    properties = tool_from_function(pick).parameters["properties"]
    assert properties == {
        "flag": {"type": "boolean"},
        "weights": {"type": "array", "items": {"type": "number"}},
        "choice": {"type": "integer"},
    }
    assert tool_from_function(pick).parameters["required"] == ["flag", "weights"]


def test_unsupported_annotations_name_the_function_and_argument():
    def untyped(a, b: int):
        """No hint on a."""

    def odd(a: int, b: complex):
        """A complex b."""

    def variadic(*values: int):
        """Varargs."""

    with pytest.raises(TypeError, match=r"untyped\): argument 'a' has no type hint"):
        tool_from_function(untyped)
    with pytest.raises(
        TypeError, match=r"odd\): argument 'b': annotation <class 'complex'> is not supported"
    ):
        tool_from_function(odd)
    with pytest.raises(TypeError, match=r"variadic\): argument 'values': \*args"):
        tool_from_function(variadic)


MCP_TOOL = {
    "name": "weather",
    "description": "The weather in a city.",
    "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def test_load_tools_from_functions_tools_and_dicts():
    explicit = Tool(name="noop", description="Does nothing.", function=lambda: "done")
    tools = load_tools([add, explicit, MCP_TOOL, OPENAI_TOOL])
    assert [t.name for t in tools] == ["add", "noop", "weather", "lookup"]
    assert tools[0].function is add
    assert tools[1] is explicit
    assert tools[2].parameters == MCP_TOOL["inputSchema"]
    assert tools[2].function is None
    schemas = openai_tool_schemas(tools)
    assert schemas[3] == OPENAI_TOOL
    assert schemas[2]["function"] == {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": MCP_TOOL["inputSchema"],
    }


def test_load_tools_from_a_file_its_tools_list_or_a_named_entry(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "def double(x: int) -> int:\n"
        '    """Twice x."""\n'
        "    return 2 * x\n\n"
        "def half(x: float) -> float:\n"
        '    """Half of x."""\n'
        "    return x / 2\n\n"
        "TOOLS = [double, half]\n"
    )
    assert [t.name for t in load_tools(str(path))] == ["double", "half"]
    assert [t.name for t in load_tools(f"{path}:half")] == ["half"]
    with pytest.raises(AttributeError, match="has no 'third'"):
        load_tools(f"{path}:third")
    (tmp_path / "none.py").write_text("x = 1\n")
    with pytest.raises(AttributeError, match="has no 'TOOLS'; define TOOLS"):
        load_tools(str(tmp_path / "none.py"))


def test_load_tools_refuses_duplicates_and_malformed_entries():
    with pytest.raises(ValueError, match=r"tools\[1\]: a second tool named 'add'"):
        load_tools([add, Tool(name="add")])
    with pytest.raises(ValueError, match=r"tools\[0\]: a tool dict must be MCP-style"):
        load_tools([{"description": "no name"}])
    with pytest.raises(TypeError, match=r"tools\[1\]: expected a function, a Tool or a tool dict, got int"):
        load_tools([add, 3])
    with pytest.raises(ValueError, match=r"Tool.name: 'two words'"):
        Tool(name="two words")


# ----------------------------------------------------------------------------------------------
# The hermes parser


def parse(text: str) -> ParsedToolCalls:
    return TOOL_PARSERS["hermes"].parse(text)


def test_hermes_parses_several_calls_and_keeps_the_content():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    )
    parsed = parse(text)
    assert parsed == ParsedToolCalls(
        content="Let me compute.",
        calls=[
            ToolCall(id="call_0", name="add", arguments={"a": 1, "b": 2}),
            ToolCall(id="call_1", name="search", arguments={"query": "x"}),
        ],
        errors=[],
    )
    assert parsed.attempted


def test_hermes_text_without_calls():
    parsed = parse("The answer is 42.")
    assert parsed == ParsedToolCalls(content="The answer is 42.")
    assert not parsed.attempted


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
            "tool call 0: not valid JSON (Expecting property name enclosed in double quotes at character 37): "
            '\'{"name": "add", "arguments": {"a": 1,}}\'',
        ),
        (
            '<tool_call>{"arguments": {"a": 1}}</tool_call>',
            'tool call 0: missing "name" (a non-empty string)',
        ),
        (
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            'tool call 0 (add): "arguments" must be a JSON object, got list',
        ),
        ("<tool_call>[1, 2]</tool_call>", "tool call 0: expected a JSON object, got list"),
        (
            '<tool_call>{"name": "add", "arguments": {"a"',
            "tool call 0: no closing </tool_call>; not valid JSON (Expecting ':' delimiter at character 33): "
            '\'{"name": "add", "arguments": {"a"\'',
        ),
        ("answer</tool_call>", "a </tool_call> without its <tool_call> at character 6"),
    ],
)
def test_hermes_describes_malformed_calls(text, error):
    parsed = parse(text)
    assert parsed.calls == []
    assert parsed.errors == [error]
    assert parsed.attempted


def test_hermes_keeps_good_calls_next_to_a_malformed_one():
    text = (
        '<tool_call>{"name": "add"</tool_call><tool_call>{"name": "add", "arguments": {"a": 5}}</tool_call>'
    )
    parsed = parse(text)
    assert parsed.calls == [ToolCall(id="call_1", name="add", arguments={"a": 5})]
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 0: not valid JSON")


def test_hermes_accepts_a_complete_call_whose_closing_tag_was_cut():
    parsed = parse('<tool_call>\n{"name": "add", "arguments": {"a": 5}}\n')
    assert parsed.calls == [ToolCall(id="call_0", name="add", arguments={"a": 5})]
    assert parsed.errors == []


def test_a_plugin_registers_a_parser():
    class Bracket:
        name = "bracket_test"

        def parse(self, text):
            return ParsedToolCalls(content=text)

    parser = Bracket()
    try:
        assert register_tool_parser(parser) is parser
        assert TOOL_PARSERS["bracket_test"] is parser
        with pytest.raises(ValueError, match="'hermes' is registered already"):
            register_tool_parser(parser, name="hermes")
    finally:
        TOOL_PARSERS.pop("bracket_test", None)


# ----------------------------------------------------------------------------------------------
# call_tool


def run(coroutine):
    return asyncio.run(coroutine)


def test_call_tool_runs_sync_in_a_thread_and_async_in_the_loop():
    threads = []

    def where(x: int) -> dict:
        """Which thread."""
        threads.append(threading.get_ident())
        return {"x": x}

    async def later(x: int) -> str:
        """Async."""
        await asyncio.sleep(0)
        return f"got {x}"

    result = run(call_tool(tool_from_function(where), {"x": 3}, 5.0, call_id="call_0"))
    assert result.ok
    assert result.content == '{"x": 3}'
    assert result.call_id == "call_0"
    assert threads != [threading.get_ident()]
    assert run(call_tool(tool_from_function(later), {"x": 4}, 5.0)).content == "got 4"


def test_call_tool_unknown_tool():
    result = run(call_tool(None, {}, 1.0, name="nope"))
    assert (result.error, result.content) == ("unknown_tool", "Error: tool 'nope' is not available.")
    declared = load_tools([MCP_TOOL])[0]
    result = run(call_tool(declared, {"city": "Oslo"}, 1.0))
    assert result.error == "unknown_tool"
    assert "declared without a function" in result.content


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "missing required argument(s) a"),
        ({"a": 1, "c": 2}, "unknown argument(s) c; add takes a, b"),
        ({"a": "1"}, "argument 'a' must be of type integer, got \"1\""),
        ({"a": True}, "argument 'a' must be of type integer, got true"),
    ],
)
def test_call_tool_bad_arguments(arguments, message):
    result = run(call_tool(tool_from_function(add), arguments, 1.0))
    assert result.error == "bad_arguments"
    assert result.content == f"Error: bad arguments for add: {message}."


def test_call_tool_exception_becomes_text():
    def broken(x: int) -> int:
        """Fails."""
        raise ZeroDivisionError("division by zero")

    result = run(call_tool(tool_from_function(broken), {"x": 1}, 1.0))
    assert (result.error, result.content) == (
        "exception",
        "Error: broken raised ZeroDivisionError: division by zero",
    )

    def own_timeout(x: int) -> int:
        """Raises TimeoutError itself: that is an exception, not our timeout."""
        raise TimeoutError("upstream")

    assert run(call_tool(tool_from_function(own_timeout), {"x": 1}, 1.0)).error == "exception"


def test_call_tool_timeout_sync_and_async():
    release = threading.Event()

    def stuck(x: int) -> int:
        """Waits until released."""
        release.wait(1.0)
        return x

    async def slow(x: int) -> int:
        """Sleeps."""
        await asyncio.sleep(1.0)
        return x

    async def call_then_release():
        try:
            return await call_tool(tool_from_function(stuck), {"x": 1}, 0.01)
        finally:
            release.set()  # before asyncio.run waits for the worker thread

    result = run(call_then_release())
    assert (result.error, result.content) == ("timeout", "Error: stuck timed out after 0.01 s.")
    assert run(call_tool(tool_from_function(slow), {"x": 1}, 0.01)).error == "timeout"
