"""Supervised fine-tuning data: rows tokenized once, with a loss mask on exactly the trained tokens.

`SFTDataset` reads local files (or rows in memory), checks every row, renders and tokenizes it
at construction, so a bad row or an unusable template fails before training starts and never
inside a collator. Each item is an `SFTSample`: token ids `[L]` and a boolean loss mask `[L]`
that is True on the tokens the loss sees, plus the row's position and file for error reports.

Row layouts:
  - prompt / response: `input_key` holds a string (one user turn) or a list of messages, and
    `output_key` the response string. The conversation is the prompt messages plus one assistant
    turn; only that turn is trained (earlier assistant turns in a prompt are context).
  - whole conversations: with `messages_key`, the row holds a list of messages and every
    assistant turn is trained.
  - plain text: with `apply_chat_template=False` or an `input_template`, the text is the
    rendered prompt, then the response, then the EOS token; the mask covers response and EOS.

Masks come from `rl_data.templates` (exact for templates that are not append-only). The
`rl_data.datasets.tokenized.ResponseEncoder` is shared with the preference datasets, so SFT,
DPO and KTO see a row the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from ..errors import DataError
from ..records import TOKEN_DTYPE, as_1d_tensor
from ..templates import ConversationTokens, tokenize_prompt_completion
from .common import as_dataset, location, read_text, require_columns
from .tokenized import OVERLONG_POLICIES, TokenizedRows, TokenStore

__all__ = ["OVERLONG_POLICIES", "SFTDataset", "SFTSample"]

logger = logging.getLogger(__name__)


class SFTSample(msgspec.Struct, kw_only=True):
    """One SFT sequence.

    Fields (L = sequence length):
        input_ids: [L] int64 token ids.
        loss_mask: [L] bool, True on the tokens whose prediction is trained (assistant content
                   and end-of-turn markers). Shift by one for next-token targets.
        index:     the row's position in the data the dataset was built from.
        source:    the file the row came from (`<in-memory>` for rows given as dicts).
        row:       the row's 0-based position in that file.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    index: int = -1
    source: str = ""
    row: int = -1

    def __post_init__(self) -> None:
        self.input_ids = as_1d_tensor(self.input_ids, TOKEN_DTYPE, field="input_ids", owner="SFTSample")
        self.loss_mask = as_1d_tensor(self.loss_mask, torch.bool, field="loss_mask", owner="SFTSample")
        if self.loss_mask.numel() != self.input_ids.numel():
            raise ValueError(
                f"SFTSample.loss_mask: length {self.loss_mask.numel()} does not match "
                f"input_ids length {self.input_ids.numel()}"
            )


class SFTDataset(TokenizedRows):
    """Tokenized SFT rows with loss masks, built once at construction.

    Args:
        data: a file path, a list of paths, a `datasets.Dataset` or a list of dicts.
        tokenizer: a fast `transformers` tokenizer (with a chat template unless plain text).
        input_key: the prompt column (a string, or a list of messages).
        output_key: the response column (a string).
        messages_key: when set, the column with whole conversations (input/output keys unused).
        pretrain_mode: continued pretraining: each row is plain text, `row[input_key]` followed by
            `row[output_key]` when the data has that column, then EOS, and every token is trained
            (no chat template, no input template).
        apply_chat_template: render with the tokenizer's chat template; False for plain text.
        input_template: plain-text prompt template with one "{}" (takes precedence over the
            chat template).
        system_prompt: system turn put first in every conversation that has none.
        max_length: the most tokens a sample may have.
        overlong: what to do with a longer row: "drop" (counted in `stats.skipped['too_long']`),
            "truncate" (keep the first max_length tokens, counted in `stats.truncated`; dropped
            if no trained token is left) or "error" (DataError naming the file and row).
        on_bad_row: "error" raises DataError naming file, row and key for a bad value; "skip"
            counts the row in `stats.skipped['bad_row']`.
        cache_dir: where `datasets` may write its cache.
    """

    def __init__(
        self,
        data: Any,
        tokenizer: Any,
        *,
        input_key: str = "prompt",
        output_key: str = "response",
        messages_key: str | None = None,
        pretrain_mode: bool = False,
        apply_chat_template: bool = True,
        input_template: str | None = None,
        system_prompt: str | None = None,
        max_length: int = 2048,
        overlong: str = "drop",
        on_bad_row: str = "error",
        cache_dir: Any = None,
    ) -> None:
        if pretrain_mode and messages_key is not None:
            raise ValueError("pretrain_mode: trains plain text rows; it does not take messages_key")
        super().__init__(
            tokenizer,
            apply_chat_template=apply_chat_template and not pretrain_mode,
            input_template=None if pretrain_mode else input_template,
            system_prompt=system_prompt,
            max_length=max_length,
            overlong=overlong,
            on_bad_row=on_bad_row,
        )
        encoder = self.encoder
        if messages_key is not None and not encoder.use_chat_template:
            raise ValueError(
                "messages_key: whole conversations need the chat template (apply_chat_template=True, no input_template)"
            )
        dataset = as_dataset(data, cache_dir=cache_dir)
        columns = [messages_key] if messages_key is not None else [input_key, output_key]
        if pretrain_mode and output_key not in dataset.column_names:
            columns = [input_key]
        require_columns(dataset, columns)

        def read(row: dict[str, Any]) -> ConversationTokens:
            if pretrain_mode:
                text = "".join(read_text(row, key, allow_empty=key != input_key) for key in columns)
                return tokenize_prompt_completion(tokenizer, "", text)
            if messages_key is not None:
                tokens = encoder.encode_conversation(row, messages_key)
            else:
                tokens = encoder.encode(row, prompt_key=input_key, response_key=output_key)
            if not any(tokens.loss_mask):
                raise DataError("no token to train on (empty assistant turns)", **location(row))
            return tokens

        self._store = TokenStore()
        for index, row, tokens in self._read_rows(dataset, columns, read):
            fitted = self._fit([tokens], row)
            if fitted is not None:
                self._store.append(fitted[0])
                self._keep(index, row)
        self._store.freeze()
        logger.info("SFTDataset: %s", self.stats.summary())

    def __getitem__(self, position: int) -> SFTSample:
        position = self._position(position)
        input_ids, loss_mask = self._store.get(position)
        return SFTSample(input_ids=input_ids, loss_mask=loss_mask, **self._where(position))

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample, in order (for length-aware batching)."""
        return self._store.lengths()
