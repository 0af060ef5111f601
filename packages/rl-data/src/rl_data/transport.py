"""The weight-sync names as they were before the transports got a module each (`rl_data.sync`).

Everything here is re-exported from `rl_data.sync` (spec, registry, fingerprint) and its
transport modules `rl_data.sync.broadcast`, `.ipc` and `.file`; `rl_data.shm` keeps the shm
transport's names the same way. New code imports from `rl_data.sync`.
"""

from __future__ import annotations

from .sync.base import (
    BACKENDS,
    TRANSPORTS,
    Transport,
    WeightSyncError,
    WeightSyncSpec,
    layout_fingerprint,
    register_transport,
)
from .sync.broadcast import (
    MAGIC,
    SyncGroup,
    broadcast_buckets,
    free_port,
    local_address,
    receive_buckets,
    reserve_port,
)
from .sync.file import read_buckets, write_buckets
from .sync.ipc import IpcHandle, IpcPayload, ipc_handle, open_ipc_handle, read_ipc_buckets, share_buckets

__all__ = [
    "BACKENDS",
    "MAGIC",
    "TRANSPORTS",
    "IpcHandle",
    "IpcPayload",
    "SyncGroup",
    "Transport",
    "WeightSyncError",
    "WeightSyncSpec",
    "broadcast_buckets",
    "free_port",
    "ipc_handle",
    "layout_fingerprint",
    "local_address",
    "open_ipc_handle",
    "read_buckets",
    "read_ipc_buckets",
    "receive_buckets",
    "register_transport",
    "reserve_port",
    "share_buckets",
    "write_buckets",
]
