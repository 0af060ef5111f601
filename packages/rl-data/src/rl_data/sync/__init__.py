"""Weight sync, the wire side: one module per transport, each found by name in `TRANSPORTS`.

A learner (sender, `rl_learner`) and the rollout engines (receivers, `rl_rollout`) never import
each other; they share the bucket layout (`rl_data.weights`), the spec (`WeightSyncSpec`, given
to both sides once) and, per transport, the framing and the pair of loops in its module here:

| transport   | module                  | sender loop            | receiver loop        |
|-------------|-------------------------|------------------------|----------------------|
| `broadcast` | `rl_data.sync.broadcast`| `broadcast_buckets`    | `receive_buckets`    |
| `ipc`       | `rl_data.sync.ipc`      | `share_buckets`        | `read_ipc_buckets`   |
| `file`      | `rl_data.sync.file`     | `write_buckets`        | `read_buckets`       |
| `shm`       | `rl_data.sync.shm`      | `ShmPublisher.publish` | `ShmReader.read`     |

Each module registers its `Transport` (name, spec check) when imported; importing this package
imports all four. The sender of a transport is registered in `rl_learner.SENDERS`, its receiver
in `rl_rollout.RECEIVERS`, under the same name. A plugin adds a transport with one module per
side: here `register_transport(Transport(name="mine", check=...))` (its own spec fields ride in
`WeightSyncSpec.options`), a `WeightSender` subclass registered in `rl_learner.SENDERS` and a
`TransportReceiver` subclass registered in `rl_rollout.RECEIVERS`; `rl-launch` adds a start
entry in `rl_launch.components.weight_sync.SYNC_STRATEGIES`. The plugin module must be imported in every
process that builds or decodes its spec (`rl-launch --plugin` does that in the driver and actors).
"""

# The built-in transports register themselves, in this order (the order error messages list).
from . import broadcast, file, ipc, shm
from .base import (
    BACKENDS,
    TRANSPORTS,
    Consume,
    Produce,
    Transport,
    WeightSyncError,
    WeightSyncSpec,
    layout_fingerprint,
    register_transport,
)

__all__ = [
    "BACKENDS",
    "TRANSPORTS",
    "Consume",
    "Produce",
    "Transport",
    "WeightSyncError",
    "WeightSyncSpec",
    "broadcast",
    "file",
    "ipc",
    "layout_fingerprint",
    "register_transport",
    "shm",
]
