"""Prompts for rollouts: rendered text, token ids and labels, checked once when loaded.

`PromptDataset` reads rows (files, a mixed `datasets.Dataset`, or dicts), renders each prompt
the way the engine will see it (`rl_data.templates.render_prompt`: the chat template with the
generation prompt, an `input_template`, or the text as is), tokenises all of them in batches
and keeps the ids in one flat tensor:

    ids = [ids₀ ‖ ids₁ ‖ … ‖ ids_{N-1}]   ([T] int32, T = Σ Lᵢ)
    offsets = [0, L₀, L₀+L₁, …, T]          ([N+1] int64);  idsᵢ = ids[offsets[i]:offsets[i+1]]

so a million prompts cost a few bytes per token rather than a Python list per row. Every row
problem is found here, before training starts: a bad row raises a `DataError` naming the file,
the row and the key, or is skipped and counted in `stats` (`on_bad_row="skip"`); a prompt
longer than `max_length` tokens is dropped, cut from the left, or refused (`overlong`).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import numpy as np
import torch

from ..errors import DataError, check_integer, type_name
from ..records import PromptSample
from ..templates import check_chat_template, check_input_template, render_prompt
from .common import (
    IN_MEMORY,
    ROW_COLUMN,
    ROW_POLICIES,
    SOURCE_COLUMN,
    DatasetStats,
    as_dataset,
    check_choice,
    check_index,
    read_messages,
    read_text,
    require_columns,
)

__all__ = ["OVERLONG_POLICIES", "PromptDataset"]

logger = logging.getLogger(__name__)

OVERLONG_POLICIES: tuple[str, ...] = ("drop", "truncate_left", "error")

# Rows rendered and tokenised per tokenizer call.
CHUNK_ROWS = 1024


class PromptDataset:
    """Rendered, tokenised prompts with labels, indexed 0 … N-1.

    Args:
        data: anything `as_dataset` accepts: a path, a list of paths, a `datasets.Dataset` (for
            example the output of `mix_datasets`) or a list of row dicts.
        tokenizer: a `transformers` tokenizer (a fast one tokenises the batches fastest).
        input_key: the column with the prompt: a non-empty string, or a list of chat messages
            (dicts with string `role` and `content`; only with the chat template).
        label_key: the column with the label (any JSON-like value: string, number, dict...) given
            to reward functions; None for no label. A row whose label is null is a bad row.
        apply_chat_template: render with the tokenizer's chat template and its generation prompt.
        input_template: a string with one "{}" where the prompt goes; takes precedence over the
            chat template.
        system_prompt: a system turn put before each conversation (chat template only).
        max_length: the largest number of prompt tokens; None for no limit.
        overlong: what to do with a longer prompt: "drop" it (counted in
            `stats.skipped["too_long"]`), "truncate_left" (keep its last `max_length` tokens;
            `prompt` stays the full text, `extra["truncated"]` is True, counted in
            `stats.truncated`) or "error" (DataError with the file, the row and both lengths).
        on_bad_row: "error" raises a DataError naming file, row and key for a missing, empty or
            non-string prompt, malformed messages or a missing label; "skip" leaves the row out
            and counts it in `stats.skipped` under "bad_prompt" or "bad_label".
        cache_dir: Arrow cache folder for the files that are loaded.
        image_key: the column with a prompt's images (VL models): one image or a list (paths,
            relative ones against the data file's folder; bytes; PIL images; Hub `Image` dicts;
            URLs only online), placed in order at the prompt's image parts or "<image>" marks
            (`rl_data.vision`). A row without images (null or []) is a text prompt. Needs
            `processor` and the chat template. None: text only.
        processor: the model's `rl_data.vision.VisionProcessor` (with `image_key`).
        max_images_per_prompt: the most images a row may have; a row with more is a bad row.
        image_root: the folder every image path must stay in (`rl_data.vision.resolve_image`):
            an absolute path or `../` leading out of it is a bad row naming the row and key.
            None: each data file's own folder (the working folder for rows not read from a
            file); "/" allows any path. URLs are fetched once, when the dataset loads.

    With images, the stored ids hold each image's run of placeholder tokens, sized from the
    image's height and width by the processor's resize rule (pixels are not read when loading);
    `__getitem__` loads and processes the row's images into `PromptSample.images`. A prompt with
    images longer than `max_length` is dropped (or refused), never cut.

    Token ids: with the chat template the rendered text already holds every special token the
    model expects (a BOS included), so it is tokenised with `add_special_tokens=False`; an
    `input_template` or plain text is tokenised with the tokenizer's default special tokens.

    Raises (at construction, before any row is rendered):
        ValueError: a bad option, an input_template without exactly one "{}", a tokenizer
            without a chat template when one is asked for, a system_prompt without one.
        DataError: a missing column (named with the file), a bad row (`on_bad_row="error"`), an
            overlong prompt (`overlong="error"`), or no prompt left at all.
    """

    def __init__(
        self,
        data: Any,
        tokenizer: Any,
        *,
        input_key: str = "prompt",
        label_key: str | None = None,
        apply_chat_template: bool = True,
        input_template: str | None = None,
        system_prompt: str | None = None,
        max_length: int | None = None,
        overlong: str = "drop",
        on_bad_row: str = "error",
        cache_dir: str | os.PathLike[str] | None = None,
        image_key: str | None = None,
        processor: Any = None,
        max_images_per_prompt: int = 1,
        image_root: str | os.PathLike[str] | None = None,
    ) -> None:
        check_choice("overlong", overlong, OVERLONG_POLICIES)
        check_integer("max_images_per_prompt", max_images_per_prompt, 1)
        if image_key is not None and processor is None:
            raise ValueError(
                "image_key: images need the model's processor (processor=rl_data.vision.VisionProcessor"
                ".from_pretrained(model_folder)); this tokenizer alone cannot place them"
            )
        if image_key is not None and not (apply_chat_template and input_template is None):
            raise ValueError(
                "image_key: prompts with images are rendered with the chat template (apply_chat_template=True, no input_template)"
            )
        check_choice("on_bad_row", on_bad_row, ROW_POLICIES)
        for name, key in (("input_key", input_key), ("label_key", label_key), ("image_key", image_key)):
            if key is not None and (not isinstance(key, str) or not key):
                raise ValueError(f"{name}: expected a non-empty column name, got {key!r}")
        if input_key is None:
            raise ValueError("input_key: expected a non-empty column name, got None")
        check_integer("max_length", max_length, 1, allow_none=True)
        if input_template is not None:
            check_input_template(input_template)
        uses_chat_template = apply_chat_template and input_template is None
        if uses_chat_template:
            check_chat_template(tokenizer)
        if system_prompt is not None:
            if not isinstance(system_prompt, str):
                raise TypeError(f"system_prompt: expected a string, got {type_name(system_prompt)}")
            if not uses_chat_template:
                raise ValueError(
                    "system_prompt: needs the chat template (apply_chat_template=True and no input_template); "
                    "write system text into the input_template instead"
                )

        self.tokenizer = tokenizer
        self.input_key, self.label_key = input_key, label_key
        self.apply_chat_template = apply_chat_template
        self.input_template, self.system_prompt = input_template, system_prompt
        self.max_length, self.overlong, self.on_bad_row = max_length, overlong, on_bad_row
        self.uses_chat_template = uses_chat_template
        self.image_key, self.processor, self.max_images_per_prompt = (
            image_key,
            processor,
            max_images_per_prompt,
        )
        self.image_root = image_root
        self.stats = DatasetStats()

        dataset = as_dataset(data, cache_dir=cache_dir)
        require_columns(dataset, [input_key, label_key, image_key])
        columns = [
            key for key in (input_key, label_key, image_key, SOURCE_COLUMN, ROW_COLUMN) if key is not None
        ]
        dataset = dataset.select_columns(list(dict.fromkeys(columns)))

        self.prompts: list[str] = []
        self.labels: list[Any] = []
        self._source_names: list[str] = []
        source_ids: dict[str, int] = {}
        row_sources: list[int] = []
        rows: list[int] = []
        truncated: dict[int, int] = {}  # index -> length before truncation
        self._images: dict[int, tuple[list[Any], list[int]]] = {}  # index -> (image values, tokens each)
        id_chunks: list[np.ndarray] = []  # int32: token ids are below 2**31 in any vocabulary
        lengths: list[int] = []

        for chunk in dataset.iter(batch_size=CHUNK_ROWS):
            count = len(chunk[SOURCE_COLUMN])
            pending = []  # (rendered text, label, source, row, images, tokens of each) of the rows that rendered
            for position in range(count):
                row = {name: values[position] for name, values in chunk.items()}
                outcome = self._render_row(row)
                if outcome is not None:
                    pending.append(outcome)
            if not pending:
                continue
            encoded = tokenizer(
                [outcome[0] for outcome in pending], add_special_tokens=not uses_chat_template
            )["input_ids"]
            chunk_ids = []
            for (text, label, source, row, images, counts), ids in zip(pending, encoded):
                if images:
                    try:
                        ids = processor.expand(ids, counts).tolist()
                    except ValueError as error:  # an "<image>"-like token the template wrote itself
                        self._bad_row(
                            "bad_prompt", DataError(str(error), source=source, row=row, key=image_key)
                        )
                        continue
                kept = self._fit_length(ids, source, row, has_images=bool(images))
                if kept is None:
                    continue
                if images:
                    self._images[len(self.prompts)] = (images, counts)
                if len(kept) < len(ids):
                    truncated[len(self.prompts)] = len(ids)
                self.prompts.append(text)
                self.labels.append(label)
                row_sources.append(source_ids.setdefault(source, len(source_ids)))
                rows.append(row)
                lengths.append(len(kept))
                chunk_ids.append(kept)
            size = sum(len(ids) for ids in chunk_ids)
            id_chunks.append(
                np.fromiter(itertools.chain.from_iterable(chunk_ids), dtype=np.int32, count=size)
            )

        self._source_names = list(source_ids)
        self.stats.kept = len(self.prompts)
        if not self.prompts:
            first = dataset[0][SOURCE_COLUMN] if len(dataset) else IN_MEMORY
            examples = "; ".join(self.stats.examples)
            raise DataError(
                f"no prompt left after filtering ({self.stats.summary()}); for example: {examples}",
                source=first,
            )
        self._ids = (
            torch.from_numpy(np.concatenate(id_chunks)) if id_chunks else torch.empty(0, dtype=torch.int32)
        )
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        self._offsets = torch.from_numpy(offsets)
        self._row_sources = torch.tensor(row_sources, dtype=torch.int32)
        self._rows = torch.tensor(rows, dtype=torch.int64)
        self._truncated = truncated
        logger.info("PromptDataset: %s", self.stats.summary())

    # ------------------------------------------------------------------ building

    def _bad_row(self, reason: str, error: DataError) -> None:
        if self.on_bad_row == "error":
            raise error
        self.stats.skip(reason, error)

    def _render_row(self, row: dict[str, Any]) -> tuple[str, Any, str, int, list[Any], list[int]] | None:
        """(rendered prompt, label, source, row, images, image tokens each) or None for a skipped bad row."""
        source, row_number = row.get(SOURCE_COLUMN) or IN_MEMORY, row.get(ROW_COLUMN)
        where = {"source": source, "row": row_number, "key": self.input_key}
        images: list[Any] = []
        counts: list[int] = []
        try:
            if self.image_key is not None:
                text, images, counts = self._render_vision_row(row, source, row_number)
                return self._with_label(row, text, source, row_number, images, counts)
            value = row.get(self.input_key)
            if isinstance(value, list):
                if not self.uses_chat_template:
                    raise DataError(
                        "a list of messages needs the chat template (apply_chat_template=True, no input_template)",
                        **where,
                    )
                prompt: str | list[dict[str, str]] = read_messages(row, self.input_key)
            else:
                prompt = read_text(row, self.input_key)
            try:
                text = render_prompt(
                    self.tokenizer,
                    prompt,
                    apply_chat_template=self.apply_chat_template,
                    input_template=self.input_template,
                    system_prompt=self.system_prompt,
                )
            except DataError as error:  # the template failed on this row: say which row
                raise DataError(error.reason, **where) from error
        except DataError as error:
            self._bad_row("bad_prompt", error)
            return None
        return self._with_label(row, text, source, row_number, images, counts)

    def _with_label(
        self,
        row: dict[str, Any],
        text: str,
        source: str,
        row_number: Any,
        images: list[Any],
        counts: list[int],
    ) -> tuple[str, Any, str, int, list[Any], list[int]] | None:
        label = None
        if self.label_key is not None:
            label = row.get(self.label_key)
            if label is None:
                self._bad_row(
                    "bad_label",
                    DataError("missing or null label", source=source, row=row_number, key=self.label_key),
                )
                return None
        return text, label, source, -1 if row_number is None else int(row_number), images, counts

    def _render_vision_row(
        self, row: dict[str, Any], source: str, row_number: Any
    ) -> tuple[str, list[Any], list[int]]:
        """(text with one placeholder per image, the row's images, tokens of each); DataError for a bad row."""
        from ..vision import image_size, resolve_image

        value = row.get(self.input_key)
        prompt = (
            read_messages(row, self.input_key, parts=True)
            if isinstance(value, list)
            else read_text(row, self.input_key)
        )
        images = row.get(self.image_key)
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        where = f"{source} row {row_number}"
        if len(images) > self.max_images_per_prompt:
            raise DataError(
                f"{len(images)} images, more than max_images_per_prompt {self.max_images_per_prompt}",
                source=source,
                row=row_number,
                key=self.image_key,
            )
        base_dir = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None
        root = self.image_root if self.image_root is not None else base_dir or os.getcwd()
        try:
            text, images = self.processor.render_text(
                prompt, images, system_prompt=self.system_prompt, where=where
            )
            images = [  # paths confined to root and absolute, URLs fetched once (their bytes kept)
                resolve_image(image, where=f"{where}, image {i}", base_dir=base_dir, root=root)
                for i, image in enumerate(images)
            ]
            counts = [
                self.processor.image_tokens_for_size(*image_size(image, where=f"{where}, image {i}"))
                for i, image in enumerate(images)
            ]
        except (ValueError, TypeError, OSError) as error:
            raise DataError(str(error), source=source, row=row_number, key=self.image_key) from None
        return text, images, counts

    def _fit_length(
        self, ids: list[int], source: str, row: int, has_images: bool = False
    ) -> list[int] | None:
        """Apply `max_length` and the `overlong` policy: the ids to keep, or None to drop the row."""
        if self.max_length is None or len(ids) <= self.max_length:
            return ids
        message = f"prompt has {len(ids)} tokens, more than max_length {self.max_length}"
        if self.overlong == "error":
            raise DataError(
                message + "; raise max_length or pass overlong='drop' or 'truncate_left'",
                source=source,
                row=row,
                key=self.input_key,
            )
        if self.overlong == "drop" or has_images:  # a prompt with images is never cut
            self.stats.skip("too_long", DataError(message, source=source, row=row, key=self.input_key))
            return None
        self.stats.truncated += 1
        return ids[-self.max_length :]

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> PromptSample:
        """The `index`-th prompt (negative indexes count from the end)."""
        position = check_index(index, len(self.prompts), "PromptDataset")
        start, end = int(self._offsets[position]), int(self._offsets[position + 1])
        original_length = self._truncated.get(position)
        extra: dict[str, Any] = {}
        if original_length is not None:
            extra = {"truncated": True, "original_length": original_length}
        images = None
        if position in self._images:
            images = self._load_images(position)
        return PromptSample(
            prompt_ids=self._ids[start:end],
            prompt=self.prompts[position],
            label=self.labels[position],
            index=position,
            source=self._source_names[int(self._row_sources[position])],
            row=int(self._rows[position]),
            extra=extra,
            images=images,
        )

    def _load_images(self, position: int) -> Any:
        """The processed images of prompt `position`; DataError when they no longer fit its placeholders."""
        from ..vision import load_image

        values, counts = self._images[position]
        source, row = self._source_names[int(self._row_sources[position])], int(self._rows[position])
        where = f"{source} row {row}"
        inputs = self.processor.process(
            [load_image(value, where=f"{where}, image {i}") for i, value in enumerate(values)]
        )
        if self.processor.num_image_tokens(inputs.grid_thw) != counts:
            raise DataError(
                f"the images give {self.processor.num_image_tokens(inputs.grid_thw)} placeholder tokens, "
                f"{counts} when the dataset was loaded (did the files change?)",
                source=source,
                row=row,
                key=self.image_key,
            )
        return inputs

    @property
    def lengths(self) -> torch.Tensor:
        """`[N]` int64: the number of prompt tokens of each prompt (after truncation)."""
        return self._offsets[1:] - self._offsets[:-1]

    @property
    def num_tokens(self) -> int:
        """Total prompt tokens kept."""
        return int(self._offsets[-1])

    @property
    def num_images(self) -> int:
        """Images over all prompts."""
        return sum(len(values) for values, _ in self._images.values())

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} prompts, {self.num_tokens} tokens; {self.stats.summary()})"
