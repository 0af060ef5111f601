"""Images next to token ids: loading, processing and the placeholder layout of VL prompts.

Vision-language models of the Qwen2-VL family (`VISION_MODEL_TYPES`) read an image as a run of
placeholder tokens in the prompt: `<|vision_start|>` then n copies of the image token then
`<|vision_end|>`, where n is the image's patch count after the vision tower's spatial merge,

    grid_thw = (t, h, w)  patches of `patch_size`² pixels (t = 1 for an image)
    n        = t · h · w / merge_size²

and the tower's embeddings replace those n token embeddings in order. A record therefore keeps
the expanded ids (what the model sees, token in / token out as for text) and, beside them, the
processed images (`ImageInputs`: the patches `pixel_values` [P, D] with P = Σ t·h·w, `grid_thw`
[I, 3]) plus the encoded originals, for engines that process images themselves (vLLM takes
images, not patches). `VisionProcessor.collapse` turns the expanded ids back into one
placeholder per image, the form vLLM expands itself.

Images come as paths (relative ones against the data file's folder), PIL images, bytes, or the
`{"bytes": ..., "path": ...}` dicts of Hub datasets' `Image` feature. URLs are fetched only when
the hub is not offline (`HF_HUB_OFFLINE` / `HF_DATASETS_OFFLINE`), and refused with a message
saying so otherwise; a download stops at `MAX_URL_BYTES`.

Datasets are not trusted to name any file: `resolve_image` (what `PromptDataset` applies to each
row's images when it loads them) refuses a path outside a root folder (the data file's folder by
default: an absolute path or `../` leading out of it), naming the row and key, and fetches a URL
once, keeping its bytes, so sampling the prompt again never downloads it again.
"""

from __future__ import annotations

import io
import json
import os
import urllib.request
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VISION_MODEL_TYPES",
    "ImageInputs",
    "VisionProcessor",
    "encode_image",
    "image_size",
    "image_token_counts",
    "is_vision_model",
    "load_image",
    "resolve_image",
    "vision_token_ids",
]

VISION_MODEL_TYPES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl")
"""`config.json` model types whose image layout `VisionProcessor` knows (the Qwen2-VL family)."""

IMAGE_PLACEHOLDER = "<image>"
"""In a prompt given as a string, where an image goes (OpenRLHF's and verl's convention)."""

_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")

MAX_URL_BYTES = 32 * 2**20
"""Most bytes read from an image URL; a larger answer is refused (an image is rarely over a few MB)."""


class ImageInputs(msgspec.Struct, kw_only=True):
    """The processed images of one prompt or trajectory, in the order of their placeholder runs.

    Fields (I images, P = Σᵢ tᵢ·hᵢ·wᵢ patches, D = channels · temporal_patch · patch²):
        pixel_values: [P, D] float32, the image processor's patches, image after image.
        grid_thw:     [I, 3] int64, each image's (t, h, w) patch grid.
        images:       the I originals, PNG-encoded (what vLLM is given); empty when not kept.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    images: list[bytes] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.pixel_values, torch.Tensor) or self.pixel_values.dim() != 2:
            raise ValueError(
                f"ImageInputs.pixel_values: expected a [P, D] tensor, got {_shape(self.pixel_values)}"
            )
        grid = torch.as_tensor(self.grid_thw)
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
            raise ValueError(f"ImageInputs.grid_thw: expected an [I, 3] integer tensor, got {_shape(grid)}")
        self.grid_thw = grid.to(torch.int64).contiguous()
        self.pixel_values = self.pixel_values.detach().to(torch.float32).contiguous()
        patches = int(self.grid_thw.prod(-1).sum())
        if self.pixel_values.shape[0] != patches:
            raise ValueError(
                f"ImageInputs.pixel_values: {self.pixel_values.shape[0]} patches, but grid_thw "
                f"{self.grid_thw.tolist()} has {patches}"
            )
        if self.images and len(self.images) != self.num_images:
            raise ValueError(f"ImageInputs.images: {len(self.images)} originals for {self.num_images} images")

    @property
    def num_images(self) -> int:
        """I."""
        return self.grid_thw.shape[0]

    @property
    def num_patches(self) -> torch.Tensor:
        """[I] int64: the patches of each image (tᵢ·hᵢ·wᵢ rows of `pixel_values`)."""
        return self.grid_thw.prod(-1)

    def pil_images(self) -> list[Any]:
        """The originals as RGB PIL images (for vLLM's `multi_modal_data`)."""
        if len(self.images) != self.num_images:
            raise ValueError("ImageInputs: the original images were not kept (images is empty)")
        return [load_image(data, where=f"ImageInputs.images[{i}]") for i, data in enumerate(self.images)]

    @staticmethod
    def concat(parts: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """The images of `parts` one after the other (None parts skipped); None when none has any."""
        present = [part for part in parts if part is not None and part.num_images]
        if not present:
            return None
        if len(present) == 1:
            return present[0]
        keep = all(len(part.images) == part.num_images for part in present)
        return ImageInputs(
            pixel_values=torch.cat([part.pixel_values for part in present]),
            grid_thw=torch.cat([part.grid_thw for part in present]),
            images=[data for part in present for data in part.images] if keep else [],
        )


def _shape(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _is_offline() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in _OFFLINE_VARIABLES
    )


def load_image(value: Any, *, where: str = "image", base_dir: str | os.PathLike[str] | None = None) -> Any:
    """`value` as an RGB `PIL.Image.Image`.

    Accepts a PIL image, bytes (an encoded image file), a path (relative to `base_dir` when
    given), an http(s) URL (fetched only when online), or a Hub `Image` feature dict with
    "bytes" or "path". `where` names the value in errors (e.g. "data.jsonl row 3, key 'images'").
    """
    image = _open_image(value, where, base_dir)
    try:
        return image.convert("RGB")
    except OSError as error:
        raise ValueError(f"{where}: not an image PIL can read ({error})") from None


def image_size(
    value: Any, *, where: str = "image", base_dir: str | os.PathLike[str] | None = None
) -> tuple[int, int]:
    """(height, width) of an image value as `load_image` takes it; a file's pixels are not decoded."""
    width, height = _open_image(value, where, base_dir).size
    return height, width


def _open_image(value: Any, where: str, base_dir: str | os.PathLike[str] | None) -> Any:
    """`value` opened by PIL (lazily: pixels are read on first use)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            return _open_image(value["bytes"], where, base_dir)
        if value.get("path"):
            return _open_image(value["path"], where, base_dir)
        raise ValueError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return Image.open(io.BytesIO(bytes(value)))
        except OSError as error:
            raise ValueError(f"{where}: the bytes are not an image PIL can read ({error})") from None
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if text.startswith(("http://", "https://")):
            return _open_image(_fetch(text, where), f"{where} ({text})", None)
        path = Path(text)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise FileNotFoundError(f"{where}: image file {path} does not exist")
        try:
            return Image.open(path)
        except OSError as error:
            raise ValueError(f"{where}: {path} is not an image PIL can read ({error})") from None
    raise TypeError(
        f"{where}: expected an image (PIL image, bytes, path, URL or a {{'bytes', 'path'}} dict), "
        f"got {type(value).__name__}"
    )


def _fetch(url: str, where: str) -> bytes:
    """The body of an http(s) URL, at most `MAX_URL_BYTES` (ValueError naming `where` beyond)."""
    max_bytes = MAX_URL_BYTES
    if _is_offline():
        raise ValueError(
            f"{where}: {url} is a URL and the hub is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set); "
            "download the images and give their paths, or unset the offline variables"
        )
    with urllib.request.urlopen(url, timeout=30) as response:  # http(s) only, checked by the callers
        body = response.read(max_bytes + 1)
    if len(body) > max_bytes:
        raise ValueError(f"{where}: {url} sends more than {max_bytes} bytes, too many for an image")
    return body


def resolve_image(
    value: Any, *, where: str, base_dir: str | os.PathLike[str] | None, root: str | os.PathLike[str]
) -> Any:
    """An image value of a dataset row, made safe to keep and to open on every sampling.

    A path (or a {"path"} dict without bytes) becomes absolute, relative ones against `base_dir`
    (the data file's folder; the working folder when None), and must lie inside `root` once `..`
    is resolved (symbolic links are followed only when opening; root "/" allows every path); a URL
    is fetched now (at most `MAX_URL_BYTES`) and becomes its bytes; anything else is returned as
    it is. Raises ValueError naming `where` for a path outside `root` or an oversized URL.
    """
    if isinstance(value, dict) and not value.get("bytes") and value.get("path"):
        value = value["path"]
    if not isinstance(value, (str, os.PathLike)):
        return value
    text = os.fspath(value)
    if text.startswith(("http://", "https://")):
        return _fetch(text, where)
    path = os.path.normpath(os.path.join(os.fspath(base_dir) if base_dir is not None else os.getcwd(), text))
    top = os.path.normpath(os.path.abspath(root))
    if os.path.commonpath([path, top]) != top:
        raise ValueError(
            f"{where}: image path {text!r} is outside {top}, the folder image paths must stay in (the data "
            "file's folder); set image_root (--data.image_root) to a folder that holds it, / for any"
        )
    return path


def encode_image(image: Any) -> bytes:
    """An RGB PIL image as PNG bytes (lossless: decoding gives the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _model_type(path: str | os.PathLike[str]) -> str | None:
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


VISION_TOKEN_KEYS: tuple[str, ...] = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)
"""config.json keys of the placeholder tokens that only the prompt and environments place."""


def image_token_counts(grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int) -> torch.Tensor:
    """[I] int64: the placeholder tokens of each image, nᵢ = tᵢ·hᵢ·wᵢ / merge_size², from its
    (t, h, w) patch grid `grid_thw` [I, 3] (the layout rule engines and learners check prompts by)."""
    return torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3).prod(-1) // merge_size**2


def vision_token_ids(config: Any) -> list[int]:
    """The placeholder token ids of a VL model's config (object or dict): tokens the policy never
    samples. Its engines and learners mask them out of every next-token distribution, so
    π(token) = softmax(z with those logits at −∞): a sampled image token would have no image
    behind it and break the next forward. [] for a config without them (a text model)."""
    read = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return sorted({int(value) for key in VISION_TOKEN_KEYS if (value := read(key)) is not None})


def is_vision_model(path: str | os.PathLike[str]) -> bool:
    """Whether the model folder at `path` is a VL model of `VISION_MODEL_TYPES`."""
    return _model_type(path) in VISION_MODEL_TYPES


class VisionProcessor:
    """A VL model's image processor and vision tokens: images to `ImageInputs`, and the ids layout.

    Built with `from_pretrained(model_folder, tokenizer)`. `render` turns chat messages and their
    images into the expanded prompt ids and the `ImageInputs`; `expand` / `collapse` convert
    between one placeholder per image and the model's runs of n; `image_turn` gives the ids an
    environment appends for an image it returns (multi-turn).
    """

    def __init__(
        self,
        image_processor: Any,
        tokenizer: Any,
        *,
        image_token_id: int,
        vision_start_token_id: int,
        vision_end_token_id: int,
        merge_size: int,
        keep_images: bool = True,
        placeholder_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token_id = int(image_token_id)
        self.vision_start_token_id = int(vision_start_token_id)
        self.vision_end_token_id = int(vision_end_token_id)
        self.merge_size = int(merge_size)
        self.keep_images = keep_images
        # tokens the policy never samples (`vision_token_ids`); the video token joins from a config
        self.placeholder_token_ids = sorted(
            {int(token) for token in placeholder_token_ids}
            if placeholder_token_ids is not None
            else {self.image_token_id, self.vision_start_token_id, self.vision_end_token_id}
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        tokenizer: Any = None,
        *,
        keep_images: bool = True,
        **image_processor_kwargs: Any,
    ) -> VisionProcessor:
        """The processor of the VL model folder at `path` (config.json, preprocessor_config.json).

        `image_processor_kwargs` go to the image processor (e.g. min_pixels, max_pixels).
        Raises ValueError naming the folder and its model type when it is not one of
        `VISION_MODEL_TYPES`.
        """
        from transformers import AutoImageProcessor, AutoTokenizer

        model_type = _model_type(path)
        if model_type not in VISION_MODEL_TYPES:
            raise ValueError(
                f"{path}: model type {model_type!r} is not a vision-language model this toolkit knows; "
                f"images need one of {VISION_MODEL_TYPES}"
            )
        config = json.loads((Path(path) / "config.json").read_text())
        with warnings.catch_warnings():  # without torchvision transformers falls back to the PIL backend
            warnings.simplefilter("ignore")
            image_processor = AutoImageProcessor.from_pretrained(os.fspath(path), **image_processor_kwargs)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(os.fspath(path))
        merge = config.get("vision_config", {}).get(
            "spatial_merge_size", getattr(image_processor, "merge_size", 2)
        )
        return cls(
            image_processor,
            tokenizer,
            image_token_id=config["image_token_id"],
            vision_start_token_id=config["vision_start_token_id"],
            vision_end_token_id=config["vision_end_token_id"],
            merge_size=merge,
            keep_images=keep_images,
            placeholder_token_ids=vision_token_ids(config),
        )

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer and the image processor into `path` (what `from_pretrained` reads
        beside the model's config.json)."""
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    # ------------------------------------------------------------------ images

    def process(self, images: Sequence[Any]) -> ImageInputs:
        """Process loaded RGB images (PIL) into one `ImageInputs`, keeping PNG originals if asked."""
        if not images:
            raise ValueError("process: no images")
        output = self.image_processor(images=list(images), return_tensors="pt")
        return ImageInputs(
            pixel_values=output["pixel_values"],
            grid_thw=output["image_grid_thw"],
            images=[encode_image(image) for image in images] if self.keep_images else [],
        )

    @property
    def image_text(self) -> str:
        """One image's placeholder as the chat template writes it: vision start, one image token,
        vision end (e.g. "<|vision_start|><|image_pad|><|vision_end|>")."""
        ids = [self.vision_start_token_id, self.image_token_id, self.vision_end_token_id]
        return "".join(self.tokenizer.convert_ids_to_tokens(ids))

    def num_image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Placeholder tokens of each image: t·h·w / merge_size² (`image_token_counts`)."""
        return image_token_counts(grid_thw, self.merge_size).tolist()

    # ------------------------------------------------------------------ token layout

    def expand(
        self, ids: Sequence[int] | torch.Tensor, grid_thw: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """[L] ids with one image token per image → the model's layout with nᵢ tokens for image i
        (nᵢ from `grid_thw` [I, 3], or given directly as a list of I counts)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        grid = torch.as_tensor(grid_thw)
        counts = self.num_image_tokens(grid) if grid.dim() == 2 else [int(count) for count in grid_thw]
        positions = torch.nonzero(ids == self.image_token_id, as_tuple=True)[0].tolist()
        if len(positions) != len(counts):
            raise ValueError(
                f"the prompt has {len(positions)} image placeholders but {len(counts)} images were given"
            )
        repeats = torch.ones_like(ids)
        for position, count in zip(positions, counts):
            repeats[position] = count
        return torch.repeat_interleave(ids, repeats)

    def collapse(self, ids: Sequence[int] | torch.Tensor) -> list[int]:
        """Expanded ids → one image token per run (the prompt form that vLLM expands itself)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            return []
        is_image = ids == self.image_token_id
        repeat = torch.zeros_like(is_image)
        repeat[1:] = is_image[1:] & is_image[:-1]
        return ids[~repeat].tolist()

    def image_turn(self, images: Sequence[Any]) -> tuple[torch.Tensor, ImageInputs]:
        """What an environment appends for `images` it returns: the ids
        `<|vision_start|> image_token·n <|vision_end|>` per image, and their `ImageInputs`."""
        inputs = self.process(
            [load_image(image, where=f"environment image {i}") for i, image in enumerate(images)]
        )
        pieces = []
        for count in self.num_image_tokens(inputs.grid_thw):
            pieces += [self.vision_start_token_id, *([self.image_token_id] * count), self.vision_end_token_id]
        return torch.tensor(pieces, dtype=torch.int64), inputs

    def render_text(
        self,
        messages: str | Sequence[dict[str, Any]],
        images: Sequence[Any] = (),
        *,
        system_prompt: str | None = None,
        where: str = "prompt",
    ) -> tuple[str, list[Any]]:
        """Chat messages (or one user string) → (the chat template's text with the generation
        prompt and one placeholder token per image, the images in placeholder order).

        A string content may hold `IMAGE_PLACEHOLDER`s ("<image>"); a list content holds parts
        {"type": "image"} / {"type": "text", "text": ...}. `images` are matched to the image
        parts in order and their count must equal the number of parts; when `images` is empty,
        the parts' own {"type": "image", "image": ...} values are the images.
        """
        conversation = (
            [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        )
        conversation = [
            {**message, "content": _content_parts(message.get("content"), where)} for message in conversation
        ]
        if system_prompt is not None:
            conversation = [
                {"role": "system", "content": [{"type": "text", "text": system_prompt}]},
                *conversation,
            ]
        images = list(images)
        if not images:  # images given inside the parts: {"type": "image", "image": ...}
            images = [
                part["image"]
                for message in (messages if not isinstance(messages, str) else [])
                if isinstance(message.get("content"), list)
                for part in message["content"]
                if isinstance(part, dict) and part.get("image") is not None
            ]
        slots = sum(part["type"] == "image" for message in conversation for part in message["content"])
        if slots != len(images):
            raise ValueError(f"{where}: {slots} image placeholders in the messages but {len(images)} images")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return text, images

    def render(
        self,
        messages: str | Sequence[dict[str, Any]],
        images: Sequence[Any] = (),
        *,
        system_prompt: str | None = None,
        where: str = "prompt",
        base_dir: str | os.PathLike[str] | None = None,
    ) -> tuple[torch.Tensor, ImageInputs | None, str]:
        """`render_text`, tokenised, with the images loaded and processed: (expanded prompt ids [L],
        ImageInputs or None without images, text)."""
        text, images = self.render_text(messages, images, system_prompt=system_prompt, where=where)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not images:
            return torch.tensor(ids, dtype=torch.int64), None, text
        loaded = [
            load_image(image, where=f"{where}, image {i}", base_dir=base_dir)
            for i, image in enumerate(images)
        ]
        inputs = self.process(loaded)
        return self.expand(ids, inputs.grid_thw), inputs, text

    def image_tokens_for_size(self, height: int, width: int) -> int:
        """Placeholder tokens of a `height` × `width` image, from the processor's resize rule
        alone (no pixels read): patches / merge_size²."""
        return int(self.image_processor.get_number_of_image_patches(height, width)) // self.merge_size**2


def _content_parts(content: Any, where: str) -> list[dict[str, Any]]:
    """A message content as a list of {"type": "text" | "image"} parts ("<image>" split out of strings)."""
    if isinstance(content, str):
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "image_url") or (isinstance(part, dict) and part.get("image") is not None):
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(
                    f"{where}: a content part must be {{'type': 'text', 'text': ...}} or an image, got {part!r}"
                )
        return parts
    raise ValueError(
        f"{where}: a message content must be a string or a list of parts, got {type(content).__name__}"
    )
