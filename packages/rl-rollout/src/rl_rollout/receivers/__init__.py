"""The built-in weight receivers, one module per transport, each registered in `rl_rollout.RECEIVERS`.

| transport   | receiver            | module                          |
|-------------|---------------------|---------------------------------|
| `broadcast` | `BroadcastReceiver` | `rl_rollout.receivers.broadcast`|
| `ipc`       | `IpcReceiver`       | `rl_rollout.receivers.ipc`      |
| `file`      | `FileReceiver`      | `rl_rollout.receivers.file`     |
| `shm`       | `ShmReceiver`       | `rl_rollout.receivers.shm`      |

A plugin's receiver is a `rl_rollout.TransportReceiver` subclass registered with
`@RECEIVERS.register("name")` in a module of its own; `rl_rollout.WeightReceiver` finds it by
the spec's transport name.
"""

from .broadcast import BroadcastReceiver
from .file import FileReceiver
from .ipc import IpcReceiver
from .shm import ShmReceiver

__all__ = ["BroadcastReceiver", "FileReceiver", "IpcReceiver", "ShmReceiver"]
