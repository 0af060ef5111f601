"""Preference data: chosen/rejected pairs (DPO, IPO, SimPO, reward models) and unpaired labels (KTO).

Rows are read, checked and tokenized once at construction, exactly as `SFTDataset` reads a
prompt and a response (`ResponseEncoder`), so an SFT model and its preference stage see the
same tokens. Loss masks are True on the response tokens only (assistant content and end-of-turn
marker); the prompt is context.

Row layouts (`PreferenceDataset`; `UnpairedPreferenceDataset` likewise with one completion):
  - `{"prompt": str | messages, "chosen": str, "rejected": str}`: each response is appended to
    the prompt as one assistant turn.
  - `{"prompt": ..., "chosen": messages, "rejected": messages}`: the response messages are
    appended to the prompt; their assistant turns are trained.
  - `{"chosen": messages, "rejected": messages}` with `prompt_key=None` (OpenRLHF style): each
    side is a whole conversation; its last assistant turn is the response and everything
    before it the prompt.
  - plain text (`apply_chat_template=False` or an `input_template`): prompt and responses are
    strings; each side is the rendered prompt, the response and EOS.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from ..errors import DataError, type_name
from ..records import TOKEN_DTYPE, as_1d_tensor
from ..templates import ConversationTokens
from .common import as_dataset, location, require_columns
from .tokenized import TokenizedRows, TokenStore

__all__ = ["PreferenceDataset", "PreferencePair", "UnpairedPreferenceDataset", "UnpairedSample"]

logger = logging.getLogger(__name__)


class PreferencePair(msgspec.Struct, kw_only=True):
    """A chosen and a rejected sequence for the same prompt.

    Fields (C, R = the two sequence lengths):
        chosen_ids:    [C] int64 prompt + chosen response.
        chosen_mask:   [C] bool, True on the chosen response tokens.
        rejected_ids:  [R] int64 prompt + rejected response.
        rejected_mask: [R] bool, True on the rejected response tokens.
        margin:        how much better chosen is than rejected (0.0 without a margin key).
        index, source, row: the row's position in the data, its file and its row in that file.
    """

    chosen_ids: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor
    margin: float = 0.0
    index: int = -1
    source: str = ""
    row: int = -1

    def __post_init__(self) -> None:
        for side in ("chosen", "rejected"):
            ids = as_1d_tensor(
                getattr(self, f"{side}_ids"), TOKEN_DTYPE, field=f"{side}_ids", owner="PreferencePair"
            )
            mask = as_1d_tensor(
                getattr(self, f"{side}_mask"), torch.bool, field=f"{side}_mask", owner="PreferencePair"
            )
            if mask.numel() != ids.numel():
                raise ValueError(
                    f"PreferencePair.{side}_mask: length {mask.numel()} does not match {side}_ids length {ids.numel()}"
                )
            setattr(self, f"{side}_ids", ids)
            setattr(self, f"{side}_mask", mask)
        self.margin = float(self.margin)


class UnpairedSample(msgspec.Struct, kw_only=True):
    """One completion labelled desirable or undesirable (KTO).

    Fields (L = sequence length):
        input_ids: [L] int64 prompt + completion.
        loss_mask: [L] bool, True on the completion tokens.
        desirable: True for a desirable completion, False for an undesirable one.
        index, source, row: the row's position in the data, its file and its row in that file.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    desirable: bool
    index: int = -1
    source: str = ""
    row: int = -1

    def __post_init__(self) -> None:
        self.input_ids = as_1d_tensor(self.input_ids, TOKEN_DTYPE, field="input_ids", owner="UnpairedSample")
        self.loss_mask = as_1d_tensor(self.loss_mask, torch.bool, field="loss_mask", owner="UnpairedSample")
        if self.loss_mask.numel() != self.input_ids.numel():
            raise ValueError(
                f"UnpairedSample.loss_mask: length {self.loss_mask.numel()} does not match "
                f"input_ids length {self.input_ids.numel()}"
            )
        self.desirable = bool(self.desirable)


def read_margin(row: Mapping[str, Any], key: str) -> float:
    """`row[key]` as a finite float; DataError naming file, row and key otherwise (bools refused)."""
    value = row.get(key)
    if value is None:
        raise DataError("missing or null", key=key, **location(row))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"expected a number, got {type_name(value)} {value!r}", key=key, **location(row))
    if not math.isfinite(value):
        raise DataError(f"expected a finite number, got {value!r}", key=key, **location(row))
    return float(value)


def read_desirable(row: Mapping[str, Any], key: str) -> bool:
    """`row[key]` as a bool: True/False or the integers 1/0; DataError naming file, row and key otherwise."""
    value = row.get(key)
    if value is None:
        raise DataError("missing or null", key=key, **location(row))
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise DataError(f"expected a bool (or 0/1), got {type_name(value)} {value!r}", key=key, **location(row))


class PreferenceDataset(TokenizedRows):
    """Tokenized preference pairs with response loss masks, built once at construction.

    Args:
        data: a file path, a list of paths, a `datasets.Dataset` or a list of dicts.
        tokenizer: a fast `transformers` tokenizer (with a chat template unless plain text).
        prompt_key: the prompt column (string or messages); None when `chosen`/`rejected` hold
            whole conversations.
        chosen_key, rejected_key: the response columns (strings or lists of messages).
        margin_key: optional column with a number per pair (e.g. a reward difference).
        apply_chat_template, input_template, system_prompt: as in `SFTDataset`.
        max_length: the most tokens either side may have.
        overlong: when either side is longer: "drop" (counted in `stats.skipped['too_long']`),
            "truncate" (each side cut to max_length, counted once in `stats.truncated`; dropped
            if a side keeps no response token) or "error" (DataError naming file and row).
        on_bad_row: "error" (DataError naming file, row and key) or "skip" (counted in
            `stats.skipped['bad_row']`).
        cache_dir: where `datasets` may write its cache.
    """

    def __init__(
        self,
        data: Any,
        tokenizer: Any,
        *,
        prompt_key: str | None = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        margin_key: str | None = None,
        apply_chat_template: bool = True,
        input_template: str | None = None,
        system_prompt: str | None = None,
        max_length: int = 2048,
        overlong: str = "drop",
        on_bad_row: str = "error",
        cache_dir: Any = None,
    ) -> None:
        super().__init__(
            tokenizer,
            apply_chat_template=apply_chat_template,
            input_template=input_template,
            system_prompt=system_prompt,
            max_length=max_length,
            overlong=overlong,
            on_bad_row=on_bad_row,
        )
        encoder = self.encoder
        if prompt_key is None and not encoder.use_chat_template:
            raise ValueError("prompt_key: plain-text mode (no chat template) needs a prompt key")
        dataset = as_dataset(data, cache_dir=cache_dir)
        columns = [prompt_key, chosen_key, rejected_key, margin_key]
        require_columns(dataset, columns)

        def read(row: dict[str, Any]) -> tuple[ConversationTokens, ConversationTokens, float]:
            chosen = encoder.encode(row, prompt_key=prompt_key, response_key=chosen_key)
            rejected = encoder.encode(row, prompt_key=prompt_key, response_key=rejected_key)
            margin = read_margin(row, margin_key) if margin_key is not None else 0.0
            return chosen, rejected, margin

        self._chosen, self._rejected = TokenStore(), TokenStore()
        self._margin: list[float] = []
        for index, row, (chosen, rejected, margin) in self._read_rows(dataset, columns, read):
            fitted = self._fit([chosen, rejected], row, names=("chosen", "rejected"))
            if fitted is not None:
                self._chosen.append(fitted[0])
                self._rejected.append(fitted[1])
                self._margin.append(margin)
                self._keep(index, row)
        self._chosen.freeze()
        self._rejected.freeze()
        logger.info("PreferenceDataset: %s", self.stats.summary())

    def __getitem__(self, position: int) -> PreferencePair:
        position = self._position(position)
        chosen_ids, chosen_mask = self._chosen.get(position)
        rejected_ids, rejected_mask = self._rejected.get(position)
        return PreferencePair(
            chosen_ids=chosen_ids,
            chosen_mask=chosen_mask,
            rejected_ids=rejected_ids,
            rejected_mask=rejected_mask,
            margin=self._margin[position],
            **self._where(position),
        )

    @property
    def lengths(self) -> list[int]:
        """Chosen plus rejected token count of every pair, in order."""
        return [c + r for c, r in zip(self._chosen.lengths(), self._rejected.lengths())]


class UnpairedPreferenceDataset(TokenizedRows):
    """Tokenized completions with a desirable/undesirable label (KTO), built once at construction.

    Args:
        data: a file path, a list of paths, a `datasets.Dataset` or a list of dicts.
        tokenizer: a fast `transformers` tokenizer (with a chat template unless plain text).
        prompt_key: the prompt column; None when completions are whole conversations.
        completion_key: the completion column (a string or a list of messages).
        desirable_key: the label column: a bool, or the integers 0/1; anything else is a bad row.
        Other arguments as in `PreferenceDataset`.
    """

    def __init__(
        self,
        data: Any,
        tokenizer: Any,
        *,
        prompt_key: str | None = "prompt",
        completion_key: str = "completion",
        desirable_key: str = "label",
        apply_chat_template: bool = True,
        input_template: str | None = None,
        system_prompt: str | None = None,
        max_length: int = 2048,
        overlong: str = "drop",
        on_bad_row: str = "error",
        cache_dir: Any = None,
    ) -> None:
        super().__init__(
            tokenizer,
            apply_chat_template=apply_chat_template,
            input_template=input_template,
            system_prompt=system_prompt,
            max_length=max_length,
            overlong=overlong,
            on_bad_row=on_bad_row,
        )
        encoder = self.encoder
        if prompt_key is None and not encoder.use_chat_template:
            raise ValueError("prompt_key: plain-text mode (no chat template) needs a prompt key")
        dataset = as_dataset(data, cache_dir=cache_dir)
        columns = [prompt_key, completion_key, desirable_key]
        require_columns(dataset, columns)

        def read(row: dict[str, Any]) -> tuple[ConversationTokens, bool]:
            desirable = read_desirable(row, desirable_key)
            return encoder.encode(row, prompt_key=prompt_key, response_key=completion_key), desirable

        self._store = TokenStore()
        self._desirable: list[bool] = []
        for index, row, (tokens, desirable) in self._read_rows(dataset, columns, read):
            fitted = self._fit([tokens], row)
            if fitted is not None:
                self._store.append(fitted[0])
                self._desirable.append(desirable)
                self._keep(index, row)
        self._store.freeze()
        logger.info("UnpairedPreferenceDataset: %s", self.stats.summary())

    def __getitem__(self, position: int) -> UnpairedSample:
        position = self._position(position)
        input_ids, loss_mask = self._store.get(position)
        return UnpairedSample(
            input_ids=input_ids,
            loss_mask=loss_mask,
            desirable=self._desirable[position],
            **self._where(position),
        )

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample, in order."""
        return self._store.lengths()

    @property
    def desirable(self) -> list[bool]:
        """The label of every sample, in order (KTO weights desirable and undesirable losses)."""
        return list(self._desirable)
