"""Message tags (routing/tags.py): one registry, every tag distinct, no module with tags of its own.

gloo matches a receive to a send by (peer, tag): two kinds of message under one tag can take
each other's receive (``Comm.close``'s receive, which must time out, once shared its tag with
``verify``'s checksum messages)."""
from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

from rlhf_switch.routing import tags

ROUTING = pathlib.Path(tags.__file__).parent


def test_every_tag_is_distinct():
    values = list(tags.TAGS.values())
    assert len(values) == len(set(values)), tags.TAGS
    tags.check_distinct(tags.TAGS)


def test_the_registry_holds_every_tag_of_the_module():
    assert {n for n in vars(tags) if n.endswith("_TAG")} == set(tags.TAGS)
    assert {"MESSAGE_TAG", "CLOSE_TAG", "VERIFY_TAG", "SAME_HOST_OFFER_TAG", "SAME_HOST_ACK_TAG"} <= set(tags.TAGS)


def test_the_check_names_tags_that_collide():
    with pytest.raises(ValueError, match="CLOSE_TAG and VERIFY_TAG are both 1048569"):
        tags.check_distinct({"MESSAGE_TAG": 1 << 20, "CLOSE_TAG": (1 << 20) - 7, "VERIFY_TAG": (1 << 20) - 7})


def test_close_and_verify_do_not_share_a_tag():
    comm, verify = importlib.import_module("rlhf_switch.routing.comm"), importlib.import_module(
        "rlhf_switch.routing.verify")
    assert comm.CLOSE_TAG != verify.VERIFY_TAG


@pytest.mark.parametrize("path", sorted(p.name for p in ROUTING.glob("*.py") if p.name != "tags.py"))
def test_no_routing_module_defines_a_tag_of_its_own(path):
    """A tag is an integer bound to a ``*_TAG`` name at module level: only ``tags.py`` binds one;
    the others import theirs from it (so they are the registry's own values)."""
    source = (ROUTING / path).read_text()
    own = [node.targets[0].id for node in ast.parse(source).body
           if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
           and node.targets[0].id.upper().endswith("TAG")]
    assert not own, f"routing/{path} defines {own}: add them to routing/tags.py"
    module = importlib.import_module(f"rlhf_switch.routing.{path[:-3]}")
    for name, value in vars(module).items():
        if name.endswith("_TAG"):
            assert tags.TAGS.get(name) == value, (path, name, value)


def test_a_close_does_not_take_a_peers_checksums(world2):
    """A rank that closes its group after a failed move while its peer, done with its own move,
    already sent it checksums: the close's receive times out as it must, closing the pair (the
    peer's send fails "Connection closed"), and this rank lives. Under one tag the receive took
    the 32-byte message into its 1-byte buffer and gloo aborted the process (SIGABRT)."""
    import fault_jobs

    closer, verifier = world2.run(fault_jobs.close_while_a_peer_sends_checksums, timeout=60)
    assert closer == "closed"
    assert "Connection closed" in verifier, verifier
