"""Tests of rl_data.templates: prompt rendering and exact assistant loss masks.

The masks are checked three ways: the decoded text of each masked span against the assistant
content as the template renders it (plus the end-of-turn marker), against the naive prefix method
on append-only templates, and against the rendering's own tokenization (ids are never altered).
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_data.errors import DataError
from rl_data.templates import (
    ConversationTokens,
    assistant_token_texts,
    render_prompt,
    tokenize_conversation,
    tokenize_prompt_completion,
)

END_MARKERS = {"chatml": "<|im_end|>", "chatml-think": "<|im_end|>", "header": "<|endoftext|>"}

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>2 plus 3</think>\nThe answer is 5."},
    {"role": "user", "content": "And 4 * 4?"},
    {"role": "assistant", "content": "  <think>four fours</think>16  "},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "<think>be kind</think>You are welcome."},
]

# Each assistant turn as the template renders it in the whole conversation.
RENDERED_TURNS = {
    "chatml": [
        "<think>2 plus 3</think>\nThe answer is 5.",
        "  <think>four fours</think>16  ",
        "<think>be kind</think>You are welcome.",
    ],
    # Turns before the last user message lose their reasoning.
    "chatml-think": ["The answer is 5.", "16  ", "<think>be kind</think>You are welcome."],
    # Content is trimmed.
    "header": [
        "<think>2 plus 3</think>\nThe answer is 5.",
        "<think>four fours</think>16",
        "<think>be kind</think>You are welcome.",
    ],
}

# Qwen3's manner: the final assistant turn always opens with "<think>\n", whatever the content.
SCAFFOLD_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def with_template(tokenizer, chat_template):
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = chat_template
    return copied


def naive_prefix_spans(tokenizer, messages, text):
    """The usual method: render messages[:k] with a generation prompt and messages[:k+1]; the
    difference (without trailing whitespace) is taken as turn k's characters in `text`."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        assert through.startswith(before)
        spans.append((len(before), len(through.rstrip())))
    return spans


def mask_from_char_spans(tokenizer, text, char_spans):
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [any(a <= start < b for a, b in char_spans) for start, _ in encoding["offset_mapping"]]


def mask_from_token_spans(length, spans):
    mask = [False] * length
    for first, last in spans:
        mask[first:last] = [True] * (last - first)
    return mask


# --- tokenize_conversation -------------------------------------------------------------------


@pytest.mark.parametrize("template", ["chatml", "chatml-think", "header"])
def test_masked_spans_decode_to_each_assistant_turn_as_rendered_plus_end_marker(make_tokenizer, template):
    tokenizer = make_tokenizer(template)
    tokens = tokenize_conversation(tokenizer, CONVERSATION)
    expected = [turn + END_MARKERS[template] for turn in RENDERED_TURNS[template]]
    assert assistant_token_texts(tokenizer, tokens) == expected
    assert tokens.loss_mask == mask_from_token_spans(len(tokens.input_ids), tokens.assistant_spans)
    assert not tokens.truncated


@pytest.mark.parametrize("template", ["chatml", "chatml-think", "header"])
def test_input_ids_are_the_plain_tokenization_of_the_rendered_conversation(make_tokenizer, template):
    tokenizer = make_tokenizer(template)
    tokens = tokenize_conversation(tokenizer, CONVERSATION)
    assert tokens.text == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokens.input_ids == tokenizer(tokens.text, add_special_tokens=False)["input_ids"]
    assert len(tokens.loss_mask) == len(tokens.input_ids)


def test_chatml_golden_mask_excludes_headers_and_the_newline_after_the_end_marker(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 2"}]
    tokens = tokenize_conversation(tokenizer, messages)
    pieces = [tokenizer.decode([token]) for token in tokens.input_ids]
    trained = [piece for piece, masked in zip(pieces, tokens.loss_mask) if masked]
    assert trained == ["1", " ", "2", "<|im_end|>"]
    assert pieces[-1] == "\n"
    assert not tokens.loss_mask[-1]


@pytest.mark.parametrize("template", ["chatml", "header"])
def test_append_only_templates_give_the_same_mask_as_the_naive_prefix_method(make_tokenizer, template):
    tokenizer = make_tokenizer(template)
    tokens = tokenize_conversation(tokenizer, CONVERSATION)
    naive = mask_from_char_spans(
        tokenizer, tokens.text, naive_prefix_spans(tokenizer, CONVERSATION, tokens.text)
    )
    assert tokens.loss_mask == naive


def test_naive_prefix_method_is_wrong_for_a_template_that_drops_earlier_reasoning(make_tokenizer):
    tokenizer = make_tokenizer("chatml-think")
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    through_first_answer = tokenizer.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert not full.startswith(through_first_answer)  # not append-only
    assert "<think>2 plus 3</think>" in through_first_answer
    assert "<think>2 plus 3</think>" not in full

    before = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    naive_span = full[len(before) : len(through_first_answer.rstrip())]
    assert naive_span != "The answer is 5.<|im_end|>"  # the naive span is shifted onto other text

    tokens = tokenize_conversation(tokenizer, CONVERSATION)
    assert assistant_token_texts(tokenizer, tokens)[0] == "The answer is 5.<|im_end|>"


def test_text_written_between_header_and_content_is_trained_with_the_turn(tokenizer):
    scaffolded = with_template(tokenizer, SCAFFOLD_TEMPLATE)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "two</think>2"},
    ]
    tokens = tokenize_conversation(scaffolded, messages)
    assert assistant_token_texts(scaffolded, tokens) == ["hello<|im_end|>", "<think>\ntwo</think>2<|im_end|>"]


@pytest.mark.parametrize(
    ("content", "chatml_span", "header_span"),
    [
        ("<think>a</think> b", "<think>a</think> b<|im_end|>", "<think>a</think> b<|endoftext|>"),
        ("héllo wörld ✓ 你好 😀", "héllo wörld ✓ 你好 😀<|im_end|>", "héllo wörld ✓ 你好 😀<|endoftext|>"),
        (" ", " <|im_end|>", "<|endoftext|>"),
        ("", "<|im_end|>", "<|endoftext|>"),
        ("stop <|im_end|> here", "stop <|im_end|> here<|im_end|>", "stop <|im_end|> here<|endoftext|>"),
        ("<|im_start|>user\nfake", "<|im_start|>user\nfake<|im_end|>", "<|im_start|>user\nfake<|endoftext|>"),
        ("\n\nleading newlines\n", "\n\nleading newlines\n<|im_end|>", "leading newlines<|endoftext|>"),
    ],
)
def test_special_and_unusual_assistant_content_is_masked_exactly(
    make_tokenizer, content, chatml_span, header_span
):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say it."},
        {"role": "assistant", "content": content},
    ]
    for template, expected in (
        ("chatml", chatml_span),
        ("chatml-think", chatml_span),
        ("header", header_span),
    ):
        tokenizer = make_tokenizer(template)
        tokens = tokenize_conversation(tokenizer, messages)
        assert assistant_token_texts(tokenizer, tokens) == [expected], template


def test_assistant_content_equal_to_the_user_content_is_located_in_its_own_turn(tokenizer):
    messages = [
        {"role": "user", "content": "same"},
        {"role": "assistant", "content": "same"},
        {"role": "user", "content": "same"},
        {"role": "assistant", "content": "same"},
    ]
    tokens = tokenize_conversation(tokenizer, messages)
    naive = mask_from_char_spans(tokenizer, tokens.text, naive_prefix_spans(tokenizer, messages, tokens.text))
    assert tokens.loss_mask == naive
    assert assistant_token_texts(tokenizer, tokens) == ["same<|im_end|>"] * 2


def test_consecutive_and_leading_assistant_messages_get_one_span_each(tokenizer):
    messages = [
        {"role": "assistant", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "ok"},
    ]
    tokens = tokenize_conversation(tokenizer, messages)
    assert assistant_token_texts(tokenizer, tokens) == ["first<|im_end|>", "second<|im_end|>"]


@pytest.mark.parametrize("max_length", [1, 5, 12, 30])
def test_truncation_keeps_a_prefix_and_clips_mask_and_spans(tokenizer, max_length):
    full = tokenize_conversation(tokenizer, CONVERSATION)
    cut = tokenize_conversation(tokenizer, CONVERSATION, max_length=max_length)
    assert cut.truncated
    assert cut.input_ids == full.input_ids[:max_length]
    assert cut.loss_mask == full.loss_mask[:max_length]
    assert len(cut.assistant_spans) == 3
    assert cut.assistant_spans == [(min(a, max_length), min(b, max_length)) for a, b in full.assistant_spans]


def test_max_length_at_least_the_length_does_not_truncate(tokenizer):
    full = tokenize_conversation(tokenizer, CONVERSATION)
    same = tokenize_conversation(tokenizer, CONVERSATION, max_length=len(full.input_ids))
    assert same == full
    assert not same.truncated


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty"),
        ("hello", "expected a list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\]: expected a dict"),
        ([{"role": "user"}], r"messages\[0\]\['content'\]: expected a string, got NoneType"),
        ([{"role": 3, "content": "a"}], r"messages\[0\]\['role'\]: expected a string, got int"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\['content'\]: expected a string, got list"),
        ([{"role": "user", "content": "a"}], "no 'assistant' message"),
    ],
)
def test_malformed_conversations_raise_data_error_naming_the_message(tokenizer, messages, match):
    with pytest.raises(DataError, match=match):
        tokenize_conversation(tokenizer, messages)


def test_bad_max_length_and_missing_chat_template_are_rejected(tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match="max_length: expected an integer >= 1 or None"):
        tokenize_conversation(tokenizer, messages, max_length=0)
    with pytest.raises(ValueError, match="has no chat template"):
        tokenize_conversation(with_template(tokenizer, None), messages)


def test_a_template_that_raises_becomes_a_data_error(tokenizer):
    strict = with_template(
        tokenizer,
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ raise_exception('no system') }}{%- endif %}"
        "{{- m['content'] }}{%- endfor %}",
    )
    with pytest.raises(DataError, match="could not render this conversation: no system"):
        tokenize_conversation(
            strict, [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
        )


def test_a_template_that_drops_assistant_content_is_reported(tokenizer):
    dropping = with_template(
        tokenizer,
        "{%- for m in messages %}{%- if m['role'] != 'assistant' %}{{- m['content'] }}{%- endif %}{%- endfor %}",
    )
    with pytest.raises(ValueError, match=r"messages\[1\]: the chat template does not render"):
        tokenize_conversation(
            dropping, [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        )


PIECES = [*"ab xyz019+=.\n\t", "é", "你", "😀", "<think>", "</think>", "<|im_end|>", "<|im_start|>"]


def test_a_template_that_renders_assistant_content_twice_is_reported(tokenizer):
    echoing = with_template(
        tokenizer, "{%- for m in messages %}{{- m['content'] + '|' + m['content'] }}{%- endfor %}"
    )
    with pytest.raises(ValueError, match=r"messages\[1\]: the chat template renders 2 copies of"):
        tokenize_conversation(
            echoing, [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        )


def test_a_template_that_drops_system_messages_still_masks_the_assistant_turns(tokenizer):
    no_system = with_template(
        tokenizer,
        "{%- for m in messages %}{%- if m['role'] != 'system' %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    )
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "system", "content": "ignored"},
        {"role": "assistant", "content": "b"},
    ]
    tokens = tokenize_conversation(no_system, messages)
    assert "ignored" not in tokens.text
    assert assistant_token_texts(no_system, tokens) == ["a<|im_end|>", "b<|im_end|>"]


TEXT = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=3))
def test_chatml_spans_are_the_contents_plus_end_marker_for_arbitrary_text(tokenizer, turns):
    messages = []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    tokens = tokenize_conversation(tokenizer, messages)
    contents = [message["content"] for message in messages if message["role"] == "assistant"]
    assert assistant_token_texts(tokenizer, tokens) == [content + "<|im_end|>" for content in contents]
    naive = mask_from_char_spans(tokenizer, tokens.text, naive_prefix_spans(tokenizer, messages, tokens.text))
    assert tokens.loss_mask == naive


# --- tokenize_prompt_completion --------------------------------------------------------------


def test_prompt_completion_masks_the_completion_and_eos_and_tokenizes_the_parts_separately(tokenizer):
    tokens = tokenize_prompt_completion(tokenizer, "Q: 1 + 1 =", " 2")
    prompt_ids = tokenizer("Q: 1 + 1 =", add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(" 2<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokens.input_ids == prompt_ids + completion_ids
    assert tokens.loss_mask == [False] * len(prompt_ids) + [True] * len(completion_ids)
    assert tokens.input_ids[-1] == tokenizer.eos_token_id
    assert tokens.text == "Q: 1 + 1 = 2<|im_end|>"
    assert assistant_token_texts(tokenizer, tokens) == [" 2<|im_end|>"]
    cut = tokenize_prompt_completion(tokenizer, "Q: 1 + 1 =", " 2", max_length=len(prompt_ids) + 1)
    assert cut.truncated
    assert cut.loss_mask == [False] * len(prompt_ids) + [True]


def test_conversation_tokens_count_loss_tokens():
    tokens = ConversationTokens(
        input_ids=[1, 2, 3], loss_mask=[False, True, True], assistant_spans=[(1, 3)], text=""
    )
    assert tokens.num_loss_tokens == 2


# --- render_prompt ---------------------------------------------------------------------------


def test_plain_string_prompt_becomes_one_user_turn_with_a_generation_prompt(tokenizer):
    assert render_prompt(tokenizer, "hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_system_prompt_comes_first_unless_the_conversation_has_its_own(tokenizer):
    assert render_prompt(tokenizer, "hi", system_prompt="Be kind.") == (
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
    assert render_prompt(tokenizer, own, system_prompt="Be kind.") == (
        "<|im_start|>system\nMine.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_messages_prompt_is_rendered_by_the_tokenizer_template(make_tokenizer):
    tokenizer = make_tokenizer("header")
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_prompt(tokenizer, messages) == expected
    assert expected.endswith("<|im_start|>assistant<|im_end|>\n\n")


def test_input_template_replaces_only_the_empty_braces(tokenizer):
    template = 'Question: {}\nAnswer as {"json": {x}}:'
    assert (
        render_prompt(tokenizer, "2 + 2?", input_template=template)
        == 'Question: 2 + 2?\nAnswer as {"json": {x}}:'
    )
    assert render_prompt(tokenizer, "{}", input_template="<{}>") == "<{}>"


def test_input_template_wins_over_the_chat_template_and_plain_text_is_unchanged(tokenizer):
    assert render_prompt(tokenizer, "p", input_template="U: {} A:", apply_chat_template=True) == "U: p A:"
    assert render_prompt(tokenizer, "  raw {} ", apply_chat_template=False) == "  raw {} "


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"input_template": "no braces"},
            ValueError,
            r"'no braces' must contain '\{\}' exactly once.*found 0",
        ),
        (
            {"input_template": "{} and {}"},
            ValueError,
            r"'\{\} and \{\}' must contain '\{\}' exactly once.*found 2",
        ),
        (
            {"input_template": "Q: {}", "system_prompt": "s"},
            ValueError,
            "system_prompt: needs the chat template",
        ),
        (
            {"apply_chat_template": False, "system_prompt": "s"},
            ValueError,
            "system_prompt: needs the chat template",
        ),
    ],
)
def test_render_prompt_rejects_bad_options(tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        render_prompt(tokenizer, "hi", **kwargs)


def test_render_prompt_rejects_message_lists_without_a_chat_template_rendering(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="input_template fills in a string, got list"):
        render_prompt(tokenizer, messages, input_template="Q: {}")
    with pytest.raises(ValueError, match="apply_chat_template=False takes a string, got list"):
        render_prompt(tokenizer, messages, apply_chat_template=False)
    with pytest.raises(DataError, match=r"messages\[0\]\['content'\]"):
        render_prompt(tokenizer, [{"role": "user", "content": 1}])


def test_tokenizer_without_chat_template_says_what_to_do(tokenizer):
    bare = with_template(tokenizer, None)
    with pytest.raises(ValueError, match=r"has no chat template.*input_template.*apply_chat_template=False"):
        render_prompt(bare, "hi")
    assert render_prompt(bare, "hi", input_template="Q: {}") == "Q: hi"
    assert render_prompt(bare, "hi", apply_chat_template=False) == "hi"
