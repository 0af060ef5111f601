"""Weight-sync strategies (`rl_launch.weight_sync.SYNC_STRATEGIES`) as a component kind:
`rollout.weight_sync`, a registered strategy or auto / none."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..weight_sync import SYNC_STRATEGIES
from .base import ComponentKind, Selection

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = ["WEIGHT_SYNC"]


def _select(config: PPOConfig) -> list[Selection]:
    return [
        Selection("rollout.weight_sync", config.rollout.weight_sync, None, {}, {}, allowed=("auto", "none"))
    ]


def _check(config: PPOConfig) -> None:
    if config.rollout.weight_sync == "ipc" and config.ray.device == "cpu":
        raise ConfigError(
            "rollout.weight_sync: ipc (CUDA IPC) needs GPUs, but ray.device is cpu: use shm, broadcast, file or auto"
        )


WEIGHT_SYNC = ComponentKind(
    title="weight-sync strategies",
    singular="weight-sync strategy",
    registry=SYNC_STRATEGIES,
    where="rollout.weight_sync; also auto and none",
    select=_select,
    check=_check,
    extra_names=("auto", "none"),
)
