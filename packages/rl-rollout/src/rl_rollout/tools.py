"""Tools for tool-calling episodes: declaring them, parsing the model's calls, running them.

A `Tool` is a name, a description, a JSON schema of its arguments and (optionally) the function
that runs it. Tools come from plain Python functions (`tool_from_function`: the schema is read
from the signature's type hints and the docstring), from MCP-style dicts (`{"name",
"description", "inputSchema"}`) or from OpenAI-style dicts (`{"type": "function", "function":
{"name", "description", "parameters"}}`); `load_tools` accepts any mix of them, or a Python file:

    def add(a: int, b: int = 0) -> int:
        '''Add two integers.

        Args:
            a: the first term.
            b: the second term.
        '''
        return a + b

    tools = load_tools([add])                 # or load_tools("my_tools.py"), its TOOLS list
    openai_tool_schemas(tools)                # the `tools=` of apply_chat_template / the OpenAI API
    # [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
    #   "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description":
    #   "the first term."}, "b": {...}}, "required": ["a"]}}}]

The model writes calls in the format its chat template taught it; a `ToolCallParser` (a
component: `TOOL_PARSERS` maps names to parsers, a plugin registers more) turns the text of one
assistant turn into `ParsedToolCalls`: the text outside the calls, the well-formed `ToolCall`s
and a description of each malformed one. `hermes` reads Qwen / Hermes calls:

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

`call_tool(tool, arguments, timeout_s)` runs one call and always returns a `ToolResult`, never
raises: an unknown tool, arguments that do not fit the schema, an exception inside the tool and
a timeout each give a result whose text tells the model what went wrong (`error` names the
kind, one of `TOOL_ERRORS`). Every tool runs on a daemon thread of its own (async ones on that
thread's event loop); a call past its timeout is abandoned at once, never joined: its thread
finishes in the background, its result discarded, and it holds no slot (`rl_rollout.bounded`).
"""

from __future__ import annotations

import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, Union, runtime_checkable

import msgspec

from .bounded import CallTimeout, UserThreads
from .rewards import load_python_file

__all__ = [
    "MAX_CALL_CHARS",
    "MAX_CALL_NESTING",
    "TOOL_ERRORS",
    "TOOL_PARSERS",
    "TOOL_THREADS",
    "HermesToolParser",
    "ParsedToolCalls",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "call_tool",
    "check_arguments",
    "decode_call_json",
    "load_tools",
    "openai_tool_schemas",
    "parse_safely",
    "register_tool_parser",
    "tool_from_function",
]

TOOL_ERRORS: tuple[str, ...] = ("unknown_tool", "bad_arguments", "exception", "timeout")
"""The kinds of failed tool call `call_tool` reports (`ToolResult.error`)."""


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A tool as the model sees it (name, description, JSON schema of its arguments) and what runs it.

    `function` is called with the arguments as keyword arguments; sync or async; its return value
    is the result (a string as is, anything else as JSON, `str()` when JSON cannot express it).
    None declares a tool that this process cannot run (a schema only: calls to it fail with
    "unknown_tool").
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []}
    )
    function: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", self.name):
            raise ValueError(
                f"Tool.name: {self.name!r} is not allowed; expected 1-64 letters, digits, '_', '.' or '-'"
            )
        if not isinstance(self.description, str):
            raise TypeError(
                f"Tool {self.name!r}: description must be a string, got {type(self.description).__name__}"
            )
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type", "object") != "object":
            raise ValueError(
                f"Tool {self.name!r}: parameters must be a JSON schema of type 'object', got {self.parameters!r}"
            )
        if self.function is not None and not callable(self.function):
            raise TypeError(f"Tool {self.name!r}: function must be callable or None")

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style declaration: `{"type": "function", "function": {name, description, parameters}}`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


# ----------------------------------------------------------------------------------------------
# Schemas from Python functions

_JSON_TYPES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _annotation_schema(annotation: Any, where: str) -> tuple[dict[str, Any], bool]:
    """(JSON schema, optional) of one parameter annotation; optional: None is allowed."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        rest = [arg for arg in args if arg is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            schema, _ = _annotation_schema(rest[0], where)
            return schema, True
    elif origin is Literal and args and all(type(a) in _JSON_TYPES for a in args):
        kinds = {_JSON_TYPES[type(a)] for a in args}
        schema: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1:
            schema["type"] = kinds.pop()
        return schema, False
    elif origin in (list, Sequence) or annotation is list or (origin is tuple and args[1:] == (Ellipsis,)):
        if not args:
            return {"type": "array"}, False
        items, _ = _annotation_schema(args[0], where)
        return {"type": "array", "items": items}, False
    elif (origin is dict or annotation is dict) and (not args or args[0] is str):
        return {"type": "object"}, False
    raise TypeError(
        f"{where}: annotation {annotation!r} is not supported; use int, float, str, bool, "
        "list[...], dict[str, ...], Literal[...] or Optional[...] of those"
    )


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(summary line, argument -> description) from a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    lines = doc.splitlines()
    summary = lines[0].strip() if lines else ""
    descriptions: dict[str, str] = {}
    in_args, current, indent = False, None, None
    for line in lines[1:]:
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters):", stripped):
            in_args, current, indent = True, None, None
            continue
        if not in_args:
            continue
        if not stripped:
            continue
        line_indent = len(line) - len(line.lstrip())
        if line_indent == 0:  # the next section (Returns:, Raises:, ...)
            in_args = False
            continue
        match = re.match(r"(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)", stripped)
        if match and (indent is None or line_indent <= indent):
            indent = line_indent
            current = match.group(1).lstrip("*")
            descriptions[current] = match.group(3).strip()
        elif current is not None:
            descriptions[current] = (descriptions[current] + " " + stripped).strip()
    return summary, descriptions


def tool_from_function(function: Callable[..., Any], *, name: str | None = None) -> Tool:
    """A `Tool` for a Python function: name, summary line and a JSON schema of its parameters.

    Each parameter needs a type hint: int -> integer, float -> number, str -> string, bool ->
    boolean, list[X] -> array of X, dict[str, X] -> object, Literal[a, b] -> enum,
    Optional[X] / X | None -> X (not required). A parameter with a default is not required.
    Descriptions come from the docstring: its first line describes the tool, a Google-style
    "Args:" section describes the parameters.

    Raises:
        TypeError: not a function, a parameter without a type hint or with an unsupported one,
            or *args / **kwargs (each names the function and the parameter).
    """
    if not callable(function):
        raise TypeError(f"tool_from_function: expected a function, got {type(function).__name__}")
    label = getattr(function, "__qualname__", None) or repr(function)
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
    except (TypeError, ValueError, NameError) as error:
        raise TypeError(f"tool_from_function({label}): cannot read its signature: {error}") from error
    summary, descriptions = _docstring_parts(inspect.getdoc(function) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in signature.parameters.values():
        where = f"tool_from_function({label}): argument {parameter.name!r}"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise TypeError(f"{where}: *args and **kwargs cannot be described by a JSON schema")
        if parameter.name not in hints:
            raise TypeError(f"{where} has no type hint; annotate it (int, float, str, bool, list[...], ...)")
        schema, optional = _annotation_schema(hints[parameter.name], where)
        if parameter.name in descriptions:
            schema["description"] = descriptions[parameter.name]
        if parameter.default is not parameter.empty and _json_value(parameter.default):
            schema["default"] = parameter.default
        properties[parameter.name] = schema
        if parameter.default is parameter.empty and not optional:
            required.append(parameter.name)
    return Tool(
        name=name or getattr(function, "__name__", type(function).__name__),
        description=summary,
        parameters={"type": "object", "properties": properties, "required": required},
        function=function,
    )


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return value is not None


# ----------------------------------------------------------------------------------------------
# Tool lists


def _tool_from_dict(spec: Mapping[str, Any], where: str) -> Tool:
    if spec.get("type") == "function" and isinstance(spec.get("function"), Mapping):
        body, schema_key = spec["function"], "parameters"
    elif "inputSchema" in spec:
        body, schema_key = spec, "inputSchema"
    elif "parameters" in spec and "name" in spec:
        body, schema_key = spec, "parameters"
    else:
        raise ValueError(
            f"{where}: a tool dict must be MCP-style {{'name', 'description', 'inputSchema'}} or "
            f"OpenAI-style {{'type': 'function', 'function': {{...}}}}; got keys {sorted(map(str, spec))}"
        )
    name = body.get("name")
    if not isinstance(name, str):
        raise ValueError(f"{where}: the tool has no 'name' string")
    function = spec.get("callable", body.get("callable"))
    try:
        return Tool(
            name=name,
            description=body.get("description") or "",
            parameters=dict(body.get(schema_key) or {"type": "object", "properties": {}}),
            function=function,
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def _load_file(spec: str) -> list[Any]:
    path, _, attribute = spec.partition(":") if not Path(spec).is_file() else (spec, "", "")
    module = load_python_file(path, "tools")
    attribute = attribute or "TOOLS"
    if not hasattr(module, attribute):
        raise AttributeError(
            f"tools file {path!r} has no {attribute!r}"
            + ("; define TOOLS = [...] or name one: 'file.py:NAME'" if attribute == "TOOLS" else "")
        )
    value = getattr(module, attribute)
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_tools(spec: Any) -> list[Tool]:
    """Tools from a list of functions / `Tool`s / MCP-style or OpenAI-style dicts, or from a file.

    A string is a Python file: "path/to/tools.py" (its `TOOLS` list) or "path/to/tools.py:NAME"
    (one function, tool or list named NAME). An MCP or OpenAI dict may carry a "callable" key with
    the function that runs it; without one the tool is declared but cannot run.

    Raises:
        TypeError / ValueError: an entry of the wrong kind (names its position), a malformed dict,
            or two tools with one name. FileNotFoundError / ImportError / AttributeError: the file.
    """
    if isinstance(spec, (str, Path)):
        where_prefix = f"tools file {str(spec)!r}"
        entries = _load_file(str(spec))
    elif isinstance(spec, (Tool, Mapping)) or callable(spec):
        where_prefix, entries = "tools", [spec]
    elif isinstance(spec, Sequence):
        where_prefix, entries = "tools", list(spec)
    else:
        raise TypeError(
            f"tools: expected a list of functions, Tools or tool dicts, or a 'file.py[:NAME]' string; "
            f"got {type(spec).__name__}"
        )
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for position, entry in enumerate(entries):
        where = f"{where_prefix}[{position}]"
        if isinstance(entry, Tool):
            tool = entry
        elif isinstance(entry, Mapping):
            tool = _tool_from_dict(entry, where)
        elif callable(entry):
            tool = tool_from_function(entry)
        else:
            raise TypeError(
                f"{where}: expected a function, a Tool or a tool dict, got {type(entry).__name__}"
            )
        if tool.name in seen:
            raise ValueError(
                f"{where}: a second tool named {tool.name!r} (the first is at position {seen[tool.name]}); "
                "tool names must be unique"
            )
        seen[tool.name] = position
        tools.append(tool)
    return tools


def openai_tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The OpenAI-style declarations of `tools`: the `tools=` argument of a chat template and of
    the OpenAI chat completions API."""
    return [tool.schema() for tool in tools]


# ----------------------------------------------------------------------------------------------
# Parsing calls


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One well-formed call: `id` (unique within its turn, "call_<turn position>"), the tool's
    name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]


class ParsedToolCalls(msgspec.Struct, frozen=True, kw_only=True):
    """What a parser read from one assistant turn.

    content: the text outside the calls (stripped). calls: the well-formed calls in order.
    errors: one sentence per malformed call (its position, what is wrong, the text).
    """

    content: str
    calls: list[ToolCall] = msgspec.field(default_factory=list)
    errors: list[str] = msgspec.field(default_factory=list)

    @property
    def attempted(self) -> bool:
        """True when the turn tried at least one call, well-formed or not."""
        return bool(self.calls or self.errors)


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads the tool calls out of the decoded text of one assistant turn (never raises on the
    model's text: malformed calls go to `ParsedToolCalls.errors`)."""

    name: str

    def parse(self, text: str) -> ParsedToolCalls: ...


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_CALL_CHARS = 65_536
"""The most characters one call's JSON may have; a longer one is malformed, never parsed."""
MAX_CALL_NESTING = 64
"""The deepest nesting of brackets one call's JSON may have; a deeper one is malformed, never parsed."""


def _nesting(text: str) -> int:
    """The deepest nesting of `[` / `{` in `text` outside JSON strings (a linear scan, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def decode_call_json(text: str) -> tuple[Any, str | None]:
    """(the decoded value, None), or (None, why it is malformed), for model-written JSON.

    Size caps come first (`MAX_CALL_CHARS`, `MAX_CALL_NESTING`), then `json.loads`; any exception
    it raises (bad JSON, an integer too long to convert, a recursion limit) is a malformed call."""
    if len(text) > MAX_CALL_CHARS:
        return None, f"too long ({len(text)} characters; at most {MAX_CALL_CHARS})"
    depth = _nesting(text)
    if depth > MAX_CALL_NESTING:
        return None, f"nested too deep ({depth} levels of brackets; at most {MAX_CALL_NESTING})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        return None, f"not valid JSON ({error.msg} at character {error.pos})"
    except Exception as error:  # ValueError (a 5,000-digit integer), RecursionError, ...
        return None, f"not usable JSON ({type(error).__name__}: {_short(str(error))})"


def parse_safely(parser: ToolCallParser, text: str) -> ParsedToolCalls:
    """`parser.parse(text)`, where a parser that raises on the model's text (a plugin's, say) gives
    one malformed call saying so instead of an exception: the model sees a tool error."""
    try:
        parsed = parser.parse(text)
    except Exception as error:
        message = f"the tool calls could not be read ({parser.name} parser: {type(error).__name__}: {_short(str(error))})"
        return ParsedToolCalls(content=text.strip(), errors=[message])
    if not isinstance(parsed, ParsedToolCalls):
        message = f"the {parser.name} tool parser returned a {type(parsed).__name__}, not ParsedToolCalls"
        return ParsedToolCalls(content=text.strip(), errors=[message])
    return parsed


def check_call_payload(payload: Any, position: int) -> tuple[ToolCall | None, str | None]:
    """A decoded call object `{"name": str, "arguments": object}` as a `ToolCall`, or an error.

    `arguments` may also be a JSON string holding an object (as the OpenAI API sends it).
    """
    if not isinstance(payload, dict):
        return None, f"tool call {position}: expected a JSON object, got {type(payload).__name__}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return None, f'tool call {position}: missing "name" (a non-empty string)'
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):
        arguments, problem = decode_call_json(arguments) if arguments.strip() else ({}, None)
        if problem is not None:
            return None, f'tool call {position} ({name}): "arguments" is a string that is {problem}'

    if not isinstance(arguments, dict):
        return None, (
            f'tool call {position} ({name}): "arguments" must be a JSON object, got {type(arguments).__name__}'
        )
    return ToolCall(id=f"call_{position}", name=name, arguments=arguments), None


class HermesToolParser:
    """Qwen / Hermes calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
    per turn, JSON between the tags (whitespace around it ignored).

    An opening tag without its closing tag (the turn was cut, or the model forgot it) is a
    malformed call when its JSON does not parse either; a complete JSON object after an unclosed
    tag at the end of the text is accepted, as vLLM's hermes parser does.
    """

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedToolCalls:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        position, cursor = 0, 0
        while True:
            start = text.find(self.open_tag, cursor)
            if start < 0:
                content.append(text[cursor:])
                break
            content.append(text[cursor:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            cursor = len(text) if end < 0 else end + len(self.close_tag)
            payload, problem = decode_call_json(body)
            if problem is not None:
                missing = "no closing </tool_call>; " if end < 0 else ""
                errors.append(f"tool call {position}: {missing}{problem}: {_short(body.strip())!r}")
            else:
                call, error_text = check_call_payload(payload, position)
                if call is not None:
                    calls.append(call)
                else:
                    errors.append(error_text)
            position += 1
        stray = "".join(content)
        if self.close_tag in stray:
            errors.append(f"a </tool_call> without its <tool_call> at character {text.find(self.close_tag)}")
            stray = stray.replace(self.close_tag, "")
        return ParsedToolCalls(content=stray.strip(), calls=calls, errors=errors)


TOOL_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesToolParser()}
"""Tool-call parsers by name (a plugin adds one with `register_tool_parser`)."""


def register_tool_parser(parser: ToolCallParser, *, name: str | None = None) -> ToolCallParser:
    """Add `parser` to `TOOL_PARSERS` under `name` (default `parser.name`); a taken name is refused."""
    if not isinstance(parser, ToolCallParser):
        raise TypeError(f"register_tool_parser: {parser!r} has no name and parse(text) method")
    key = name or parser.name
    if key in TOOL_PARSERS and TOOL_PARSERS[key] is not parser:
        raise ValueError(f"register_tool_parser: a tool parser named {key!r} is registered already")
    TOOL_PARSERS[key] = parser
    return parser


# ----------------------------------------------------------------------------------------------
# Running calls


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one call: `content` is the text the model gets back; `error` None when the
    tool ran, else one of `TOOL_ERRORS`."""

    name: str
    content: str
    error: str | None = None
    call_id: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


_SCHEMA_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _check_value(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    kinds = schema.get("type")
    if kinds is not None:
        allowed = [kinds] if isinstance(kinds, str) else list(kinds)
        fits = any(
            isinstance(value, _SCHEMA_TYPES.get(kind, object))
            and not (kind in ("integer", "number") and isinstance(value, bool))
            and not (kind == "number" and isinstance(value, float) and not math.isfinite(value))
            for kind in allowed
        )
        if not fits:
            return f"{where} must be of type {' or '.join(allowed)}, got {json.dumps(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            problem = _check_value(item, schema["items"], f"{where}[{index}]")
            if problem:
                return problem
    return None


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """None when `arguments` fit `tool.parameters` (required keys, no unknown keys when the schema
    has properties and `additionalProperties` is not true, types, enums, array items); else
    a sentence saying what is wrong. A light check, not a full JSON Schema validator."""
    properties = tool.parameters.get("properties") or {}
    missing = [key for key in tool.parameters.get("required") or [] if key not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    if properties and tool.parameters.get("additionalProperties") is not True:
        unknown = [key for key in arguments if key not in properties]
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; {tool.name} takes {', '.join(properties)}"
    for key, value in arguments.items():
        schema = properties.get(key)
        if isinstance(schema, Mapping):
            problem = _check_value(value, schema, f"argument {key!r}")
            if problem:
                return problem
    return None


def result_text(value: Any) -> str:
    """A tool's return value as text: a string as is, else JSON (`str()` when JSON cannot say it)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class _ToolRaised(Exception):
    """Carries an exception raised inside a tool (so a tool's own TimeoutError is no timeout)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


TOOL_THREADS = UserThreads(16, name="rl-tool")
"""Where `call_tool` runs tools unless given its own `UserThreads` (16 calls at a time; a call
that timed out is abandoned and frees its slot)."""


async def _run(
    threads: UserThreads, function: Callable[..., Any], arguments: Mapping[str, Any], timeout_s: float
) -> Any:
    """`function(**arguments)` on a thread of `threads` (an async function on that thread's own
    event loop), so neither a sleeping sync tool nor a blocking async one holds the caller's loop."""
    try:
        return await threads.call(function, timeout_s=timeout_s, **arguments)
    except CallTimeout:
        raise
    except Exception as error:
        raise _ToolRaised(error) from error


async def call_tool(
    tool: Tool | None,
    arguments: Mapping[str, Any],
    timeout_s: float,
    *,
    name: str = "",
    call_id: str = "",
    threads: UserThreads | None = None,
) -> ToolResult:
    """Run one call; every failure becomes a `ToolResult` whose text the model can read.

    `tool` None (or a tool without a function) is "unknown_tool" (`name` says what was asked
    for). Arguments that do not fit the schema are "bad_arguments" (the tool is not run), and so
    is a TypeError raised by binding them to the function's signature. An exception inside the
    tool is "exception" (its type and message), running past `timeout_s` is "timeout": the call
    is abandoned at its deadline (never joined, `rl_rollout.bounded`). Every tool runs on a
    thread of `threads` (default `TOOL_THREADS`), async ones on that thread's own event loop.
    """
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s: {timeout_s!r} is not allowed; expected a number > 0")
    asked = tool.name if tool is not None else name
    if tool is None or tool.function is None:
        why = "is not available" if tool is None else "cannot run here (declared without a function)"
        return ToolResult(
            name=asked, content=f"Error: tool {asked!r} {why}.", error="unknown_tool", call_id=call_id
        )
    problem = check_arguments(tool, arguments)
    if problem is None:
        try:
            inspect.signature(tool.function).bind(**arguments)
        except TypeError as error:
            problem = str(error)
        except ValueError:  # builtins without a signature: let the call say it
            pass
    if problem is not None:
        return ToolResult(
            name=asked,
            content=f"Error: bad arguments for {asked}: {problem}.",
            error="bad_arguments",
            call_id=call_id,
        )
    try:
        value = await _run(threads or TOOL_THREADS, tool.function, arguments, timeout_s)
    except CallTimeout:
        return ToolResult(
            name=asked,
            content=f"Error: {asked} timed out after {timeout_s:g} s.",
            error="timeout",
            call_id=call_id,
        )
    except _ToolRaised as raised:
        error = raised.error
        return ToolResult(
            name=asked,
            content=f"Error: {asked} raised {type(error).__name__}: {error}",
            error="exception",
            call_id=call_id,
        )
    return ToolResult(name=asked, content=result_text(value), call_id=call_id)
