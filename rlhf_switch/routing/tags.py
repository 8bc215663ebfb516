"""Every message tag the routing package posts under, in one place.

gloo matches a receive to a send by (peer, tag), so two kinds of message between the same pair
under one tag can take each other's receive: each kind has a tag of its own, and ``TAGS`` (the
registry: checked at import, and by ``tests/test_tags.py``) holds them all. NCCL ignores tags;
there a move's messages match by posting order alone (``executor``).
"""
from __future__ import annotations

DEFAULT_TAG = 0  # a ``P2P`` / ``Comm.isend`` without a tag of its own (a benchmark's raw exchange)
MESSAGE_TAG = 1 << 20  # every message of a move: one tag, so gloo matches by posting order, as NCCL does
SAME_HOST_ACK_TAG = MESSAGE_TAG - 3  # a same-host copy's acknowledgement, receiver -> sender (same_host)
SAME_HOST_OFFER_TAG = MESSAGE_TAG - 5  # a same-host copy's offer: where the sender's bytes are (same_host)
CLOSE_TAG = MESSAGE_TAG - 7  # the receive nobody sends, that ``Comm.close`` lets time out
VERIFY_TAG = MESSAGE_TAG - 9  # a pair's checksums after a verified move (verify)

TAGS: dict[str, int] = {name: value for name, value in globals().items() if name.endswith("_TAG")}


def check_distinct(tags: dict[str, int]) -> None:
    """Raise ``ValueError`` naming every pair of ``tags`` that share a value."""
    seen: dict[int, str] = {}
    clashes = []
    for name, value in tags.items():
        if value in seen:
            clashes.append(f"{seen[value]} and {name} are both {value}")
        seen.setdefault(value, name)
    if clashes:
        raise ValueError("message tags must be distinct: " + "; ".join(clashes))


check_distinct(TAGS)
