"""Elastic resize of the trainer world: a new world of trainer actors is
built in the background while the old one trains, then one VPS plan over the union of old and
new ranks moves the training state across, and the old actors leave.

- ``plan``: which devices and ranks take part (pure data, no process groups).
- ``member``: what each old or new rank runs in the stop-the-world (inside its actor).
- ``manager``: the driver side over Ray (devices as placement groups, the background build, the
  stop-the-world and the release).
- ``redundancy``: a rank's host copy of its own and its buddy's state (``elastic.redundancy:
  host``), refreshed by one VPS move; ``recovery``: a lost trainer restored from the survivors'
  copies with the resize's own build and stop-the-world.
"""
from .plan import ResizeError, ResizePlan, UnionEndpoint

__all__ = ["ResizeError", "ResizePlan", "UnionEndpoint"]
