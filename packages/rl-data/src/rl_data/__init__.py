"""rl_data: the formats and data that every rl-* package speaks.

- Wire formats (msgspec structs, tensors as raw bytes, never pickle): `Trajectory` (one
  token-in/token-out response), `ExperienceBatch` (what a learner consumes, packed), and the
  weight-sync layout (`WeightSyncMeta`, buckets, checksums). `encode` / `decode` move them
  between processes.
- Packing and dynamic batching: padding-free packing with per-sequence position ids and
  `cu_seqlens`; micro-batches under a token budget, balanced across data-parallel ranks.
- Chat templates: prompts rendered for generation, conversations tokenized with exact
  assistant loss masks (also for templates that are not append-only).
- Images (VL models): `ImageInputs` ride on prompts, trajectories and batches next to the
  token ids; `rl_data.vision.VisionProcessor` renders image prompts and their placeholder runs.
- Datasets from local files live in `rl_data.datasets`; a tiny locally built model and
  tokenizer for tests and presets in `rl_data.tiny` (`build_tiny_vl_checkpoint`: a tiny Qwen2-VL).

    from rl_data import Trajectory, build_experience, decode, encode, plan_micro_batches

    records = decode(encode(records), list[Trajectory])
    plan = plan_micro_batches([r.num_tokens for r in records], max_tokens=16384, num_ranks=8)
"""

from .__about__ import __version__
from .adapters import LoraAdapter
from .batching import MicroBatchPlan, greedy_partition, karmarkar_karp, plan_micro_batches
from .errors import DataError
from .experience import ExperienceBatch, build_experience, micro_batches
from .layout_check import check_layout_shapes, safetensors_shapes
from .packing import (
    PackedSequences,
    cu_seqlens_from_lengths,
    pack_sequences,
    packed_attention_mask,
    packed_to_padded,
    padded_to_packed,
    position_ids_from_cu_seqlens,
    unpack_sequences,
)
from .records import FINISH_REASONS, PromptSample, Trajectory
from .serialization import Decoder, Encoder, decode, encode
from .templates import ConversationTokens, render_prompt, tokenize_conversation
from .tensors import dtype_from_name, dtype_name, tensor_checksum
from .vision import ImageInputs
from .weights import (
    BucketMeta,
    ParamMeta,
    WeightSyncMeta,
    WeightSyncReport,
    bucket_checksum,
    compare_checksums,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from .wire import WIRE_FORMAT, check_wire_format

__all__ = [
    "FINISH_REASONS",
    "WIRE_FORMAT",
    "BucketMeta",
    "ConversationTokens",
    "DataError",
    "Decoder",
    "Encoder",
    "ExperienceBatch",
    "ImageInputs",
    "LoraAdapter",
    "MicroBatchPlan",
    "PackedSequences",
    "ParamMeta",
    "PromptSample",
    "Trajectory",
    "WeightSyncMeta",
    "WeightSyncReport",
    "__version__",
    "bucket_checksum",
    "build_experience",
    "check_layout_shapes",
    "check_wire_format",
    "compare_checksums",
    "cu_seqlens_from_lengths",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "greedy_partition",
    "karmarkar_karp",
    "micro_batches",
    "pack_bucket",
    "pack_sequences",
    "packed_attention_mask",
    "packed_to_padded",
    "padded_to_packed",
    "plan_buckets",
    "plan_micro_batches",
    "position_ids_from_cu_seqlens",
    "render_prompt",
    "safetensors_shapes",
    "tensor_checksum",
    "tokenize_conversation",
    "unpack_bucket",
    "unpack_sequences",
]
