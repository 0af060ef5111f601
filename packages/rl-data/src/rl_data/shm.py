"""The shm weight-sync transport's names at their old address; the module is `rl_data.sync.shm`."""

from .sync.shm import (
    DEFAULT_PREFIX,
    PAGE_BYTES,
    ShmPublisher,
    ShmReader,
    ShmVersion,
    WeightSyncTimeout,
    header_bytes,
    page_checksum,
    remove_stale_directories,
    shm_directory,
    slot_offsets,
)

__all__ = [
    "DEFAULT_PREFIX",
    "PAGE_BYTES",
    "ShmPublisher",
    "ShmReader",
    "ShmVersion",
    "WeightSyncTimeout",
    "header_bytes",
    "page_checksum",
    "remove_stale_directories",
    "shm_directory",
    "slot_offsets",
]
