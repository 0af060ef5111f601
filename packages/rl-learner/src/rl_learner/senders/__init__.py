"""The built-in weight senders, one module per transport, each registered in `rl_learner.SENDERS`.

| transport   | sender            | module                        |
|-------------|-------------------|-------------------------------|
| `broadcast` | `BroadcastSender` | `rl_learner.senders.broadcast`|
| `ipc`       | `IpcSender`       | `rl_learner.senders.ipc`      |
| `file`      | `FileSender`      | `rl_learner.senders.file`     |
| `shm`       | `ShmSender`       | `rl_learner.senders.shm`      |

A plugin's sender is a `rl_learner.WeightSender` subclass with `_send(version)` (move every bucket
of `self.layout`, filled by `self._produce`, to the engines; return the `WeightSyncReport`),
registered with `@SENDERS.register("name")` in a module of its own.
"""

from .broadcast import BroadcastSender
from .file import FileSender
from .ipc import IpcSender
from .shm import ShmSender

__all__ = ["BroadcastSender", "FileSender", "IpcSender", "ShmSender"]
