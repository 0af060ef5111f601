"""What the tokenized datasets (SFT, preference, unpaired) share.

`ResponseEncoder` reads a row's prompt and response (or whole conversation) the same way for
SFT, DPO and KTO, so the stages of one model see the same tokens, and tokenizes it with the
trained-token mask. `TokenizedRows` does the bookkeeping: it reads rows (a bad row raises or is
counted, by `on_bad_row`), applies the `overlong` policy (`fit_length`), counts what it keeps,
truncates and skips, and remembers where each kept sample came from (position in the data,
file, row) for the items it returns. `TokenStore` keeps variable-length token ids and loss masks
as flat tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import torch

from ..errors import DataError, check_integer, type_name
from ..records import TOKEN_DTYPE
from ..templates import (
    ASSISTANT_ROLE,
    ConversationTokens,
    check_chat_template,
    check_input_template,
    mask_from_spans,
    render_prompt,
    tokenize_conversation,
    tokenize_prompt_completion,
    with_system_prompt,
)
from .common import (
    ROW_COLUMN,
    ROW_POLICIES,
    SOURCE_COLUMN,
    DatasetStats,
    check_choice,
    check_index,
    location,
    read_messages,
    read_text,
)

OVERLONG_POLICIES: tuple[str, ...] = ("drop", "truncate", "error")

# Reasons under which `DatasetStats.skipped` counts rows.
BAD_ROW = "bad_row"
TOO_LONG = "too_long"

Value = TypeVar("Value")


def fit_length(
    tokens: ConversationTokens,
    *,
    max_length: int,
    overlong: str,
    row: Mapping[str, Any],
    what: str = "sequence",
) -> ConversationTokens | None:
    """Apply the overlong policy: the tokens unchanged, truncated, None (drop), or DataError.

    "truncate" keeps the first `max_length` tokens (`truncated` set) and drops the sequence
    (None) when no trained token is left; "drop" returns None; "error" raises DataError naming
    the file and the row.
    """
    length = len(tokens.input_ids)
    if length <= max_length:
        return tokens
    if overlong == "error":
        raise DataError(
            f"{what} has {length} tokens, more than max_length {max_length} "
            "(raise max_length, or pass overlong='drop' or 'truncate')",
            **location(row),
        )
    if overlong == "drop":
        return None
    truncated = tokens.truncate(max_length)
    return truncated if any(truncated.loss_mask) else None


def too_long_message(row: Mapping[str, Any], length: int, max_length: int) -> str:
    """The example message kept in `DatasetStats` for a row dropped for its length."""
    return f"{row[SOURCE_COLUMN]}, row {row[ROW_COLUMN]}: {length} tokens, more than max_length {max_length}"


def iterate_rows(dataset: Any, columns: Sequence[str | None]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(position, row) for every row, reading only the named columns and the location columns."""
    names = [name for name in dict.fromkeys(columns) if name is not None]
    view = dataset.select_columns([*names, SOURCE_COLUMN, ROW_COLUMN])
    yield from enumerate(view)


class TokenStore:
    """Variable-length token sequences kept as flat tensors plus offsets (a few tensors, not one per row)."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._masks: list[bool] = []
        self._offsets = [0]

    def append(self, tokens: ConversationTokens) -> None:
        self._ids.extend(tokens.input_ids)
        self._masks.extend(tokens.loss_mask)
        self._offsets.append(len(self._ids))

    def freeze(self) -> None:
        self.ids = torch.tensor(self._ids, dtype=TOKEN_DTYPE)
        self.masks = torch.tensor(self._masks, dtype=torch.bool)
        self.offsets = self._offsets
        del self._ids, self._masks

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Clones: a view would keep (and, in DataLoader workers, share) the whole flat storage.
        first, last = self.offsets[position], self.offsets[position + 1]
        return self.ids[first:last].clone(), self.masks[first:last].clone()

    def lengths(self) -> list[int]:
        return [last - first for first, last in zip(self.offsets, self.offsets[1:])]


class ResponseEncoder:
    """Reads the prompt and response of a row and tokenizes them with the trained-token mask.

    With the chat template (`apply_chat_template=True` and no `input_template`), a response is a
    string (one assistant turn after the prompt messages) or a list of messages (appended to the
    prompt; all its assistant turns are trained). Without a prompt key, the response must be a
    whole conversation and only its last assistant turn is trained (OpenRLHF's preference
    layout: everything before it is the shared prompt). In plain-text mode the prompt string goes
    through `input_template` (or is taken as is), and the response string and EOS follow.

    Every problem with a row's values raises DataError naming the file, row and key.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        apply_chat_template: bool = True,
        input_template: str | None = None,
        system_prompt: str | None = None,
    ) -> None:
        if input_template is not None:
            check_input_template(input_template)
        self.use_chat_template = bool(apply_chat_template) and input_template is None
        if self.use_chat_template:
            check_chat_template(tokenizer)
        else:
            if system_prompt is not None:
                raise ValueError(
                    "system_prompt: needs the chat template (apply_chat_template=True and no input_template)"
                )
            if not tokenizer.eos_token:
                raise ValueError("tokenizer has no eos_token; plain-text mode ends every response with it")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError(f"system_prompt: expected a string, got {type_name(system_prompt)}")
        self.tokenizer = tokenizer
        self.input_template = input_template
        self.system_prompt = system_prompt

    def encode(
        self, row: Mapping[str, Any], *, prompt_key: str | None, response_key: str
    ) -> ConversationTokens:
        """Tokens and mask for `row[prompt_key]` followed by `row[response_key]`."""
        if not self.use_chat_template:
            if prompt_key is None:
                raise ValueError("prompt_key: plain-text mode needs a prompt key")
            prompt = render_prompt(
                self.tokenizer,
                read_text(row, prompt_key),
                apply_chat_template=False,
                input_template=self.input_template,
            )
            response = read_text(row, response_key)
            return tokenize_prompt_completion(self.tokenizer, prompt, response)
        if prompt_key is None:
            if not isinstance(row.get(response_key), list):
                raise DataError(
                    f"without a prompt key the value must be a whole conversation (a list of messages), "
                    f"got {type_name(row.get(response_key))}",
                    key=response_key,
                    **location(row),
                )
            messages = read_messages(row, response_key)
            assistant = [i for i, message in enumerate(messages) if message["role"] == ASSISTANT_ROLE]
            return self._tokenize(row, response_key, messages, trained=assistant[-1:])
        prompt = read_messages(row, prompt_key)
        if isinstance(row.get(response_key), list):
            response = read_messages(row, response_key)
        else:
            response = [{"role": ASSISTANT_ROLE, "content": read_text(row, response_key)}]
        trained = [len(prompt) + i for i, message in enumerate(response) if message["role"] == ASSISTANT_ROLE]
        if not trained:
            raise DataError(
                f"the response messages have no {ASSISTANT_ROLE!r} turn", key=response_key, **location(row)
            )
        return self._tokenize(row, response_key, prompt + response, trained=trained)

    def encode_conversation(self, row: Mapping[str, Any], messages_key: str) -> ConversationTokens:
        """Tokens and mask for the conversation in `row[messages_key]`, every assistant turn trained."""
        if not self.use_chat_template:
            raise ValueError("messages_key: whole conversations need the chat template")
        messages = read_messages(row, messages_key)
        assistant = [i for i, message in enumerate(messages) if message["role"] == ASSISTANT_ROLE]
        return self._tokenize(row, messages_key, messages, trained=assistant)

    def _tokenize(
        self, row: Mapping[str, Any], key: str, messages: list[dict[str, Any]], *, trained: Sequence[int]
    ) -> ConversationTokens:
        conversation = with_system_prompt(messages, self.system_prompt)
        shift = len(conversation) - len(messages)
        try:
            tokens = tokenize_conversation(self.tokenizer, conversation)
        except DataError as error:
            raise DataError(error.reason, key=key, **location(row)) from error
        assistant = [i for i, message in enumerate(conversation) if message["role"] == ASSISTANT_ROLE]
        wanted = {index + shift for index in trained}
        spans = [span for index, span in zip(assistant, tokens.assistant_spans) if index in wanted]
        loss_mask = mask_from_spans(len(tokens.input_ids), spans)
        return msgspec.structs.replace(tokens, loss_mask=loss_mask, assistant_spans=spans)


class TokenizedRows:
    """Base of the datasets whose items are tokenized rows: counted skips, locations, indexing.

    Subclasses read rows with `_read_rows`, fit each sequence with `_fit`, record each kept
    sample with `_keep`, and build items in `__getitem__` from `_position(i)` and `_where(i)`.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        apply_chat_template: bool,
        input_template: str | None,
        system_prompt: str | None,
        max_length: Any,
        overlong: str,
        on_bad_row: str,
    ) -> None:
        self.max_length = check_integer("max_length", max_length, 1)
        check_choice("overlong", overlong, OVERLONG_POLICIES)
        check_choice("on_bad_row", on_bad_row, ROW_POLICIES)
        self.overlong, self.on_bad_row = overlong, on_bad_row
        self.tokenizer = tokenizer
        self.encoder = ResponseEncoder(
            tokenizer,
            apply_chat_template=apply_chat_template,
            input_template=input_template,
            system_prompt=system_prompt,
        )
        self.stats = DatasetStats()
        self._index: list[int] = []
        self._source: list[str] = []
        self._row: list[int] = []

    def _read_rows(
        self, dataset: Any, columns: Sequence[str | None], read: Callable[[dict[str, Any]], Value]
    ) -> Iterator[tuple[int, dict[str, Any], Value]]:
        """(position, row, read(row)) for every row that reads; a bad row raises or is counted."""
        for index, row in iterate_rows(dataset, columns):
            try:
                value = read(row)
            except DataError as error:
                if self.on_bad_row == "error":
                    raise
                self.stats.skip(BAD_ROW, error)
                continue
            yield index, row, value

    def _fit(
        self,
        sides: Sequence[ConversationTokens],
        row: Mapping[str, Any],
        names: Sequence[str] = ("sequence",),
    ) -> list[ConversationTokens] | None:
        """Every side fitted to `max_length`, or None (the row is dropped and counted as too long)."""
        fitted = [
            fit_length(tokens, max_length=self.max_length, overlong=self.overlong, row=row, what=name)
            for tokens, name in zip(sides, names)
        ]
        if any(tokens is None for tokens in fitted):
            longest = max(len(tokens.input_ids) for tokens in sides)
            self.stats.skip(TOO_LONG, too_long_message(row, longest, self.max_length))
            return None
        self.stats.truncated += any(tokens.truncated for tokens in fitted)
        return fitted

    def _keep(self, index: int, row: Mapping[str, Any]) -> None:
        self.stats.kept += 1
        self._index.append(index)
        self._source.append(row[SOURCE_COLUMN])
        self._row.append(row[ROW_COLUMN])

    def _position(self, position: int) -> int:
        return check_index(position, len(self), type(self).__name__)

    def _where(self, position: int) -> dict[str, Any]:
        """The `index`, `source` and `row` fields of the item at `position`."""
        return {"index": self._index[position], "source": self._source[position], "row": self._row[position]}

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, position: int) -> Any:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        for position in range(len(self)):
            yield self[position]
