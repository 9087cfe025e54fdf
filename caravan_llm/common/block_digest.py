"""caravan's names for KV-cache blocks: a keyed hash chain over token ids.

An engine names each full block of a prompt by a hash chain over its token
ids; caravan names the same blocks its own way, so that a router and a
replica's KV relay agree on a name without the engine's hashes (seeded per
engine process) and without token ids ever crossing the network:

    digest_0 = H_k(ROOT      || header || tokens[0 : B])
    digest_i = H_k(digest_i-1 || header || tokens[i*B : (i+1)*B])

- `H_k` is BLAKE2b keyed with a key derived from the model's engine API key
  (`DigestKey.from_secret`), which the routers and the relay both hold. An
  unkeyed chain would let anyone who sees the digest stream confirm that a
  known prompt (a system prompt, a document) is cached, block by block: each
  public digest is the parent of the next. Every block is keyed, not only
  the root, for that reason.
- `header` is the block size and the chain's extra key (a LoRA adapter's
  name, or none), length-prefixed, so that no two inputs share an encoding.
- Token ids are 4-byte little-endian unsigned integers (vocabularies are far
  below 2**32), so the same ids give the same bytes on every machine.
- Only full blocks have a digest, as only full blocks produce engine events;
  a digest names its whole prefix, so "how much of this prompt is cached" is
  a walk over set lookups.

Digest size: 8 bytes, read as an unsigned int. That is the engines' own block
hash width (vLLM publishes uint64s), so a collision is no likelier than the
engine's own; with a million blocks held by one replica the chance of any
collision among them is about 3e-8, and a collision only makes a router
believe one block is cached, it never changes an answer. Nobody without the
key can aim for one. An int costs 36 bytes in a set against 49 for 16 bytes,
and hashes faster; 16 bytes would buy nothing a router can use.

Cost, measured with timeit on the shared 2-core dev machine (load average
about 4 from other work; best / median of 7 x 100): 8192 token ids in blocks
of 128 (64 digests) take 0.22 / 0.32 ms (packing the ids is ~0.06 ms of it),
in blocks of 16 (512 digests) 1.0 / 1.05 ms: inside the issue's 2 ms budget
for all routing work at 8k tokens in blocks of 128, tight in blocks of 16
(since measured 0.82 -> 0.64 ms best of 5 x 50 in blocks of 16 after the
loop's names were bound once and the parent and header hashed in one update).

Pure: no I/O, no state beyond the immutable key.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType, cast

if TYPE_CHECKING:
    from collections.abc import Sequence

BlockDigest = NewType("BlockDigest", int)
"""One block's caravan name (an unsigned 64-bit int); it names its whole prefix too."""

DIGEST_BYTES = 8
# The parent of a chain's first block.
_ROOT = bytes(DIGEST_BYTES)
# Domain separation for the key: the digest key is never the engine key itself.
_KEY_PERSON = b"caravan.kvblock"
_TOKEN_BYTES = 4
_ONE_TOKEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class DigestKey:
    """The key of one model's block digests, derived from its engine API key.

    The repr never shows the key; build one with `from_secret`.
    """

    material: bytes = field(repr=False)
    # A keyed BLAKE2b state with no input yet; each block hashes a copy of it,
    # which skips re-absorbing the key for every block.
    _template: hashlib.blake2b = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= len(self.material) <= hashlib.blake2b.MAX_KEY_SIZE:
            raise ValueError(
                f"material must be 1 to {hashlib.blake2b.MAX_KEY_SIZE} bytes,"
                f" got {len(self.material)}"
            )
        template = hashlib.blake2b(key=self.material, digest_size=DIGEST_BYTES)
        object.__setattr__(self, "_template", template)

    @classmethod
    def from_secret(cls, secret: str | bytes) -> DigestKey:
        """The digest key for a model whose engines are called with `secret` (any length).

        An empty secret (an engine without a key) gives a key anyone can
        derive: then the digests hide nothing from whoever sees the stream.
        """
        raw = secret.encode() if isinstance(secret, str) else secret
        return cls(hashlib.blake2b(raw, digest_size=32, person=_KEY_PERSON).digest())

    def hasher(self) -> hashlib.blake2b:
        """A fresh keyed BLAKE2b state for one block's digest."""
        return self._template.copy()


def block_digests(
    tokens: Sequence[int],
    *,
    block_size: int,
    key: DigestKey,
    extra: str | None = None,
    parent: BlockDigest | None = None,
) -> tuple[BlockDigest, ...]:
    """The digests of the full blocks of `tokens`, in order; a partial last block has none.

    `parent` continues a chain: the digest of the block just before
    `tokens[0]` (None: `tokens` starts the sequence). So
    `block_digests(a + b, ...) == d + block_digests(b, ..., parent=d[-1])`
    when `a` is a whole number of blocks and `d = block_digests(a, ...)`.
    Raises ValueError when `block_size` is below 1 or a token id is not an
    int in [0, 2**32).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    count = len(tokens) // block_size
    if count == 0:
        return ()
    used = count * block_size
    data = _pack_tokens(tokens, used)
    header = _header(block_size, extra)
    width = block_size * _TOKEN_BYTES
    view = memoryview(data)
    previous = _ROOT if parent is None else _digest_bytes(parent)
    # The loop runs on the router's event loop for every request: names bound
    # once, one update for the parent and header (the same bytes hashed).
    fresh = key.hasher
    names: list[int] = []
    append = names.append
    from_bytes = int.from_bytes
    for start in range(0, used * _TOKEN_BYTES, width):
        hasher = fresh()
        hasher.update(previous + header)
        hasher.update(view[start : start + width])
        previous = hasher.digest()
        append(from_bytes(previous, "big"))
    # BlockDigest is a NewType of int: the ints are the digests.
    return cast("tuple[BlockDigest, ...]", tuple(names))


def block_digest(
    parent: BlockDigest | None,
    block_tokens: Sequence[int],
    *,
    key: DigestKey,
    extra: str | None = None,
) -> BlockDigest:
    """The digest of one block (all of `block_tokens`) after `parent` (None: the first block)."""
    if not block_tokens:
        raise ValueError("block_tokens must hold at least one token id")
    (name,) = block_digests(
        block_tokens, block_size=len(block_tokens), key=key, extra=extra, parent=parent
    )
    return name


def _pack_tokens(tokens: Sequence[int], count: int) -> bytes:
    head = tokens[:count]
    try:
        return struct.pack(f"<{count}I", *head)
    except struct.error:
        for index, token in enumerate(head):
            try:
                _ONE_TOKEN.pack(token)
            except struct.error:
                raise ValueError(
                    f"token ids must be ints in [0, 2**32): got {token!r} at index {index}"
                ) from None
        raise


def _header(block_size: int, extra: str | None) -> bytes:
    if extra is None:
        return struct.pack("<IB", block_size, 0)
    encoded = extra.encode("utf-8", "surrogatepass")
    return struct.pack("<IBI", block_size, 1, len(encoded)) + encoded


def _digest_bytes(digest: BlockDigest) -> bytes:
    if not 0 <= digest < 2 ** (8 * DIGEST_BYTES):
        raise ValueError(f"parent must be a {DIGEST_BYTES}-byte unsigned digest, got {digest}")
    return digest.to_bytes(DIGEST_BYTES, "big")
