"""Node addresses: each devcluster draws its own loopback block; two on one host never collide."""

from __future__ import annotations

import pytest

from caravan_llm.devcluster.nomad.fingerprint import loopback_address


def test_block_zero_keeps_the_classic_addresses() -> None:
    assert [loopback_address(n) for n in (1, 2, 252, 253)] == [
        "127.0.0.2",
        "127.0.0.3",
        "127.0.0.253",
        "127.0.1.1",
    ]


def test_another_block_gives_other_addresses_for_the_same_nodes() -> None:
    mine = {loopback_address(n, 7) for n in range(1, 600)}
    theirs = {loopback_address(n, 8) for n in range(1, 600)}
    assert "127.7.0.2" in mine
    assert not mine & theirs


@pytest.mark.parametrize("block", [-1, 256])
def test_a_block_outside_the_octet_is_refused(block: int) -> None:
    with pytest.raises(ValueError, match="loopback block"):
        loopback_address(1, block)
