"""A resize as data: the devices and ranks of the old and new trainer worlds, and the ranks of
the union group the one move runs over (old ranks first, then new ones)."""
from __future__ import annotations

from dataclasses import dataclass

from ..timeouts import MOVE_S


class ResizeError(ValueError):
    """A resize that cannot be done (bad devices, a world that failed to build): raised before
    any rank of the old world has moved a byte; the old world trains on."""


@dataclass(frozen=True)
class ResizePlan:
    """``old_devices[r]`` / ``new_devices[r]``: the logical device of old / new trainer rank ``r``
    (device ids are the device manager's). Devices in both are kept (an old and a new actor share
    the device during the transition); the others are added or released."""

    old_devices: tuple[int, ...]
    new_devices: tuple[int, ...]

    def __post_init__(self):
        for side, devices in (("old", self.old_devices), ("new", self.new_devices)):
            if not devices:
                raise ResizeError(f"the {side} trainer world has no device")
            if len(set(devices)) != len(devices):
                raise ResizeError(f"the {side} trainer world names a device twice: {list(devices)}")

    @property
    def old_world(self) -> int:
        return len(self.old_devices)

    @property
    def new_world(self) -> int:
        return len(self.new_devices)

    @property
    def union_size(self) -> int:
        return self.old_world + self.new_world

    @property
    def added(self) -> tuple[int, ...]:
        return tuple(d for d in self.new_devices if d not in self.old_devices)

    @property
    def released(self) -> tuple[int, ...]:
        """Devices of the old world the new one does not use: free once the old actors are gone."""
        return tuple(d for d in self.old_devices if d not in self.new_devices)

    def union_rank(self, side: str, rank: int) -> int:
        """The rank of old or new trainer rank ``rank`` in the union group."""
        world = {"old": self.old_world, "new": self.new_world}[side]
        if not 0 <= rank < world:
            raise ResizeError(f"{side} rank {rank} is not in a world of {world}")
        return rank if side == "old" else self.old_world + rank

    def endpoint(self, host: str, port: int, side: str, rank: int, timeout_s: float = MOVE_S) -> "UnionEndpoint":
        return UnionEndpoint(host, port, self.union_size, self.union_rank(side, rank), side, timeout_s)


@dataclass(frozen=True)
class UnionEndpoint:
    """What one member needs to join the union group: the store old rank 0 hosts on its own node
    (``host:port``, a port the OS picked there), the group's size and this member's rank and side."""

    host: str
    port: int
    world_size: int
    rank: int
    side: str            # "old" (sends its state) or "new" (receives it)
    timeout_s: float = MOVE_S
