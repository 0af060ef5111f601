"""Chat templates: prompts rendered for generation, conversations tokenized with exact loss masks.

Two jobs, one source of truth (the tokenizer's own Jinja chat template):

- `render_prompt` turns a dataset prompt (a string or a list of messages) into the text an engine
  is given: the chat template with a generation prompt, a plain `input_template` with one "{}",
  or the string unchanged.
- `tokenize_conversation` turns a whole conversation into token ids plus a loss mask that is
  True on exactly the tokens each assistant turn produced: its content and its end-of-turn
  marker (`<|im_end|>`, `<|eot_id|>`), never the role header and never another role's tokens.

Why not the usual prefix trick. The common way to find assistant tokens renders the prefix
`messages[:k]` with a generation prompt and `messages[:k+1]`, and takes the difference. That is
only right for append-only templates, where rendering a prefix of the conversation gives a prefix
of the full rendering. Reasoning templates (Qwen3, DeepSeek-R1) are not append-only: an assistant
turn written before the last user message loses its `<think>…</think>` block in the full
rendering but keeps it when it is the last message. The prefix difference then points at text
the model never sees in training. `tokenize_conversation` instead locates every turn inside the
one rendering that is actually tokenized (see its docstring), so the spans are exact for any
template that renders each message's content in place, rewritten or not.

Token/character boundaries. Spans are found in characters and mapped to tokens through the
tokenizer's offsets: a token belongs to a span when its first character does. A token that
starts before a span and runs into it (a BPE merge across the boundary) is not trained; one that
starts inside and runs past the end is. Tokenization needs a fast (Rust) tokenizer for offsets.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import msgspec

from .errors import DataError, check_integer, type_name

__all__ = [
    "ConversationTokens",
    "assistant_token_texts",
    "check_input_template",
    "check_messages",
    "render_prompt",
    "tokenize_conversation",
    "tokenize_prompt_completion",
]

ASSISTANT_ROLE = "assistant"
# Private-use code points: no tokenizer corpus or chat template has a reason to contain them.
SENTINEL_RANGE = range(0xE000, 0xF900)


class ConversationTokens(msgspec.Struct, frozen=True, kw_only=True):
    """A tokenized conversation and where its assistant turns are.

    Fields (L = len(input_ids)):
        input_ids:       [L] token ids of `text` (no special tokens added beyond the template's).
        loss_mask:       [L] True on assistant tokens (content and end-of-turn marker).
        assistant_spans: one half-open token range `(start, end)` per assistant message, in
                         message order; `loss_mask[start:end]` is all True. After truncation a
                         span is clipped to L (possibly to an empty `(L, L)`).
        text:            the rendered conversation that was tokenized (before truncation).
        truncated:       True when tokens beyond `max_length` were cut off.
    """

    input_ids: list[int]
    loss_mask: list[bool]
    assistant_spans: list[tuple[int, int]]
    text: str
    truncated: bool = False

    @property
    def num_loss_tokens(self) -> int:
        """Number of tokens the loss sees."""
        return sum(self.loss_mask)

    def truncate(self, max_length: int | None) -> ConversationTokens:
        """The first `max_length` tokens (spans clipped, `truncated` set); self when they all fit."""
        if max_length is None or len(self.input_ids) <= max_length:
            return self
        return msgspec.structs.replace(
            self,
            input_ids=self.input_ids[:max_length],
            loss_mask=self.loss_mask[:max_length],
            assistant_spans=[
                (min(first, max_length), min(last, max_length)) for first, last in self.assistant_spans
            ],
            truncated=True,
        )


def mask_from_spans(length: int, spans: Sequence[tuple[int, int]]) -> list[bool]:
    """A loss mask of `length` that is True exactly inside the half-open token `spans`."""
    mask = [False] * length
    for first, last in spans:
        mask[first:last] = [True] * (last - first)
    return mask


def check_input_template(input_template: str) -> None:
    """An input template holds "{}" exactly once (where the prompt goes); ValueError otherwise."""
    if not isinstance(input_template, str):
        raise TypeError(f"input_template: expected a string with one '{{}}', got {type_name(input_template)}")
    count = input_template.count("{}")
    if count != 1:
        raise ValueError(
            f"input_template: {input_template!r} must contain '{{}}' exactly once (where the prompt goes), "
            f"found {count}"
        )


def check_chat_template(tokenizer: Any) -> None:
    """ValueError unless the tokenizer has a chat template, saying what to do instead."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no chat template; "
            "set tokenizer.chat_template, or pass input_template='...{}...' or apply_chat_template=False "
            "to use prompts as plain text"
        )


def check_messages(messages: Any, *, require_assistant: bool = False) -> list[dict[str, Any]]:
    """Validate chat messages: a non-empty list of dicts with string `role` and `content`.

    Returns the messages as a list of plain dicts (extra keys such as `tool_calls` are kept for
    the template). Raises DataError naming the message index and the key that is wrong.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise DataError(f"messages: expected a list of message dicts, got {type_name(messages)}")
    if not messages:
        raise DataError("messages: empty; a conversation needs at least one message")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(
                f"messages[{index}]: expected a dict with 'role' and 'content', got {type_name(message)}"
            )
        for key in ("role", "content"):
            value = message.get(key)
            if not isinstance(value, str):
                raise DataError(f"messages[{index}][{key!r}]: expected a string, got {type_name(value)}")
        if not message["role"]:
            raise DataError(f"messages[{index}]['role']: empty string")
        checked.append(dict(message))
    if require_assistant and not any(message["role"] == ASSISTANT_ROLE for message in checked):
        roles = [message["role"] for message in checked]
        raise DataError(f"messages: no {ASSISTANT_ROLE!r} message to train on (roles {roles})")
    return checked


def render_prompt(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    *,
    apply_chat_template: bool = True,
    input_template: str | None = None,
    system_prompt: str | None = None,
) -> str:
    """The text a model is prompted with, ending where the assistant's answer starts.

    Exactly one of three renderings, in this order of precedence:
      1. `input_template` given: the prompt string put in place of its single "{}" (a plain
         replacement, not `str.format`: other braces stay as written). A messages list is an
         error here, and so is `system_prompt` (write the system text into the template).
      2. `apply_chat_template`: a string becomes one user turn; `system_prompt`, when given, is
         put first as a system turn unless the conversation already starts with its own system
         message (the row's wins). Rendered by the tokenizer's chat template with
         `add_generation_prompt=True`.
      3. Otherwise the string unchanged (a messages list or a `system_prompt` is an error).

    Raises:
        ValueError: a bad input_template, a tokenizer without a chat template in case 2, or a
            prompt / system_prompt that the chosen rendering cannot express.
        DataError: malformed messages (names the message index and key).
    """
    if input_template is not None:
        check_input_template(input_template)
        if not isinstance(prompt, str):
            raise ValueError(
                f"prompt: input_template fills in a string, got {type_name(prompt)}; "
                "use the chat template (apply_chat_template=True, no input_template) for message lists"
            )
        if system_prompt is not None:
            raise ValueError(
                "system_prompt: needs the chat template; with input_template write it into the template"
            )
        return input_template.replace("{}", prompt)
    if apply_chat_template:
        check_chat_template(tokenizer)
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else check_messages(prompt)
        )
        messages = with_system_prompt(messages, system_prompt)
        return render(tokenizer, messages, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise ValueError(
            f"prompt: apply_chat_template=False takes a string, got {type_name(prompt)}; "
            "message lists need the chat template"
        )
    if system_prompt is not None:
        raise ValueError("system_prompt: needs the chat template (apply_chat_template=True)")
    return prompt


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """`messages` with a system turn first, unless `system_prompt` is None or one is there already."""
    if system_prompt is None or (messages and messages[0].get("role") == "system"):
        return messages
    if not isinstance(system_prompt, str):
        raise TypeError(f"system_prompt: expected a string, got {type_name(system_prompt)}")
    return [{"role": "system", "content": system_prompt}, *messages]


def render(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
    """The chat template applied to `messages` as text; a template's own error becomes a DataError."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as error:  # Jinja's TemplateError, or raise_exception() inside the template
        raise DataError(f"the chat template could not render this conversation: {error}") from error
    if not isinstance(text, str):
        raise TypeError(
            f"tokenizer.apply_chat_template(tokenize=False) returned {type_name(text)}, expected str"
        )
    return text


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    max_length: int | None = None,
) -> ConversationTokens:
    """Tokenize a conversation with a loss mask over every assistant turn, exact for any template.

    Method (T is the full rendering with `add_generation_prompt=False`, the text that is tokenized
    with offsets and without added special tokens, so no second BOS):

    1. Content. For each message k that is located, render the conversation once more with only
       message k's content replaced by a private-use sentinel character σ absent from T. Rendering
       is deterministic, so T and that rendering R agree before and after the place where the
       content went: with p = the length of their longest common prefix and s the length of their
       longest common suffix (s ≤ min(|T|, |R|) − p), T[p : |T| − s] is exactly the text message
       k's content produced in T, even when the template rewrites it (strips a think block,
       trims whitespace). σ ∉ T guarantees that neither match runs through it. An assistant
       message whose content the template renders zero times or twice is refused (ValueError).
    2. Scaffolding before the content. Let G be the generation prompt after messages[:k]
       (rendering with the prompt minus rendering without, e.g. "<|im_start|>assistant\\n"). If G
       occurs in T between the end of message k−1's content (or of the previous span, when the
       template does not render message k−1) and p, the span starts right after
       its last occurrence, so text a template always writes between the header and the content
       (Qwen3's "<think>\\n" on the final turn) is trained like content, as the model generates
       it after G. Otherwise the span starts at p.
    3. End-of-turn marker. Rendering messages[:k+1] (with σ as content) shows what the template
       writes after an assistant message; without trailing whitespace ("<|im_end|>", not
       "<|im_end|>\\n"), the part of it that T also has right after the content is included.
    4. Characters to tokens: a token is in a span when its first character is (see the module
       docstring for tokens that straddle a boundary).

    Args:
        tokenizer: a fast `transformers` tokenizer with a chat template.
        messages: a non-empty list of dicts with string `role` and `content` (other keys are
            passed to the template), with at least one "assistant" message.
        max_length: keep only the first `max_length` tokens (mask and spans cut to match) and
            set `truncated`; None keeps everything.

    Returns:
        `ConversationTokens` with one span per assistant message.

    Raises:
        DataError: malformed messages, no assistant message, or a template that fails on them.
        ValueError: no chat template, a slow tokenizer, a template that does not render an
            assistant message's content exactly once, or a bad max_length.

    Cost: about 5 renderings per assistant turn plus one tokenization, so O(turns × length)
    characters of templating; 1 ms for a 600-token single-turn conversation on one CPU core.
    """
    check_integer("max_length", max_length, 1, allow_none=True)
    messages = check_messages(messages, require_assistant=True)
    check_chat_template(tokenizer)
    text = render(tokenizer, messages, add_generation_prompt=False)
    sentinel = next((chr(code) for code in SENTINEL_RANGE if chr(code) not in text), None)
    if sentinel is None:
        raise DataError("the rendered conversation uses every private-use character; cannot locate turns")

    regions: dict[int, tuple[int, int, int] | None] = {}

    def content_region(index: int) -> tuple[int, int, int] | None:
        if index not in regions:
            regions[index] = _content_region(tokenizer, messages, index, text, sentinel)
        return regions[index]

    char_spans: list[tuple[int, int]] = []
    for index, message in enumerate(messages):
        if message["role"] != ASSISTANT_ROLE:
            continue
        region = content_region(index)
        if region is None or region[2] != 1:
            how = "does not render" if region is None else f"renders {region[2]} copies of"
            raise ValueError(
                f"messages[{index}]: the chat template {how} this assistant message's content, "
                "so its tokens cannot be located"
            )
        start, end, _ = region
        previous = content_region(index - 1) if index > 0 else None
        # Where turn k's own text can begin: after message k-1's content (or the last span).
        lower = previous[1] if previous is not None else (char_spans[-1][1] if char_spans else 0)
        header = _generation_prompt(tokenizer, messages[:index])
        if header and lower <= start:
            found = text.rfind(header, lower, start)
            if found >= 0:
                start = found + len(header)
        end += _end_marker_length(tokenizer, messages, index, text, end, sentinel)
        char_spans.append((start, end))

    input_ids, offsets = _encode_with_offsets(tokenizer, text)
    token_spans = _char_spans_to_token_spans(offsets, char_spans)
    return ConversationTokens(
        input_ids=input_ids,
        loss_mask=mask_from_spans(len(input_ids), token_spans),
        assistant_spans=token_spans,
        text=text,
    ).truncate(max_length)


def tokenize_prompt_completion(
    tokenizer: Any,
    prompt_text: str,
    completion: str,
    *,
    append_eos: bool = True,
    max_length: int | None = None,
) -> ConversationTokens:
    """Plain-text prompt and completion (no chat template): ids = tok(prompt) + tok(completion + eos).

    The two parts are tokenized separately, which is what an engine does at generation time (it
    is given the prompt's ids and samples the rest), so no BPE merge crosses the boundary and the
    loss mask is exactly the completion's tokens and the EOS token. No BOS or other special token
    is added: put one into the prompt text (e.g. the input_template) if the model expects it.

    Returns:
        `ConversationTokens` with one span (the completion); `text` is prompt + completion + eos.
    """
    check_integer("max_length", max_length, 1, allow_none=True)
    for name, value in (("prompt_text", prompt_text), ("completion", completion)):
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a string, got {type_name(value)}")
    if append_eos:
        if not tokenizer.eos_token:
            raise ValueError("tokenizer has no eos_token; set one or pass append_eos=False")
        completion = completion + tokenizer.eos_token
    prompt_ids = (
        list(tokenizer(prompt_text, add_special_tokens=False, verbose=False)["input_ids"])
        if prompt_text
        else []
    )
    completion_ids = list(tokenizer(completion, add_special_tokens=False, verbose=False)["input_ids"])
    input_ids = prompt_ids + completion_ids
    loss_mask = [False] * len(prompt_ids) + [True] * len(completion_ids)
    return ConversationTokens(
        input_ids=input_ids,
        loss_mask=loss_mask,
        assistant_spans=[(len(prompt_ids), len(input_ids))],
        text=prompt_text + completion,
    ).truncate(max_length)


def assistant_token_texts(tokenizer: Any, tokens: ConversationTokens) -> list[str]:
    """The decoded text of each assistant span (special tokens kept), for tests and debugging."""
    return [
        tokenizer.decode(
            tokens.input_ids[first:last], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        for first, last in tokens.assistant_spans
    ]


def _content_region(
    tokenizer: Any, messages: list[dict[str, Any]], index: int, text: str, sentinel: str
) -> tuple[int, int, int] | None:
    """(start, end, copies): the range of `text` produced by message `index`'s content (step 1 of
    the method) and how many times the template renders that content; None if it never does."""
    altered = [*messages[:index], {**messages[index], "content": sentinel}, *messages[index + 1 :]]
    rendered = render(tokenizer, altered, add_generation_prompt=False)
    copies = rendered.count(sentinel)
    if not copies:
        return None
    prefix = _common_prefix_length(text, rendered)
    suffix = _common_suffix_length(text, rendered, min(len(text), len(rendered)) - prefix)
    return prefix, len(text) - suffix, copies


def _generation_prompt(tokenizer: Any, history: list[dict[str, Any]]) -> str:
    """What the template adds after `history` for `add_generation_prompt=True` ("" if unknown)."""
    if not history:
        return ""
    without = render(tokenizer, history, add_generation_prompt=False)
    with_prompt = render(tokenizer, history, add_generation_prompt=True)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else ""


def _end_marker_length(
    tokenizer: Any, messages: list[dict[str, Any]], index: int, text: str, content_end: int, sentinel: str
) -> int:
    """Length of the end-of-turn marker found in `text` at `content_end` (step 3 of the method)."""
    last = render(
        tokenizer, [*messages[:index], {**messages[index], "content": sentinel}], add_generation_prompt=False
    )
    position = last.find(sentinel)
    if position < 0:
        return 0
    marker = last[position + 1 :].rstrip()
    return _common_prefix_length(text[content_end : content_end + len(marker)], marker)


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer: {type(tokenizer).__name__} is not a fast tokenizer; loss masks need character "
            "offsets (return_offsets_mapping), load it with use_fast=True"
        )
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return list(encoding["input_ids"]), [tuple(pair) for pair in encoding["offset_mapping"]]


def _char_spans_to_token_spans(
    offsets: list[tuple[int, int]], char_spans: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Token range of each character span: the tokens whose first character lies in it."""
    starts = [start for start, _ in offsets]
    monotonic = all(a <= b for a, b in pairwise(starts))
    token_spans = []
    for char_start, char_end in char_spans:
        if monotonic:
            token_spans.append(
                (bisect_left(starts, char_start), bisect_left(starts, max(char_start, char_end)))
            )
            continue
        inside = [i for i, start in enumerate(starts) if char_start <= start < char_end]
        if inside and inside[-1] - inside[0] + 1 != len(inside):
            raise ValueError(
                "tokenizer offsets are out of order inside an assistant turn; cannot build a loss mask"
            )
        first = inside[0] if inside else sum(1 for start in starts if start < char_start)
        token_spans.append((first, first + len(inside)))
    return token_spans


def _common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-level slice comparisons)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix_length(a: str, b: str, limit: int) -> int:
    """Length of the longest common suffix, at most `limit`."""
    low, high = 0, max(0, limit)
    while low < high:
        middle = (low + high + 1) // 2
        if a[len(a) - middle :] == b[len(b) - middle :]:
            low = middle
        else:
            high = middle - 1
    return low
