"""Datasets built from local files (jsonl, json, parquet, csv, arrow, `save_to_disk` folders).

Every row keeps the file and the row it came from, so a bad row is reported where it is; rows
that are skipped (by choice) or truncated are counted in each dataset's `stats`.

    from rl_data.datasets import PromptDataset, PromptLoader, mix_datasets

    mixed = mix_datasets(["math.jsonl", "code.parquet"], probabilities=[0.7, 0.3], seed=42)
    prompts = PromptDataset(mixed, tokenizer, input_key="question", label_key="answer", max_length=1024)
    loader = PromptLoader(prompts, batch_size=128, seed=42)   # loader.state_dict() resumes exactly
"""

from .common import DatasetStats, as_dataset, load_dataset_source
from .mixing import mix_datasets
from .preference import PreferenceDataset, PreferencePair, UnpairedPreferenceDataset, UnpairedSample
from .prompts import PromptDataset
from .sampler import PromptLoader, ResumableSampler, SamplerState
from .sft import SFTDataset, SFTSample

__all__ = [
    "DatasetStats",
    "PreferenceDataset",
    "PreferencePair",
    "PromptDataset",
    "PromptLoader",
    "ResumableSampler",
    "SFTDataset",
    "SFTSample",
    "SamplerState",
    "UnpairedPreferenceDataset",
    "UnpairedSample",
    "as_dataset",
    "load_dataset_source",
    "mix_datasets",
]
