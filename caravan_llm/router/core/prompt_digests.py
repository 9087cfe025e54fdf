"""A request's prompt as the exact prefix index sees it: its block digests, per replica kind.

A replica's KV relay names the blocks its engine holds by caravan's keyed
block digests (`caravan_llm.common.block_digest`): a chain over the prompt's
token ids in blocks of the engine's block size, keyed with a key derived
from the model's engine key. To ask the exact index (`kv_index.KvIndex`) how
much of a prompt a replica holds, the router names the prompt's blocks the
same way, from the token ids the engine will compute (the model's tokenizer
and chat template, behind the edge's `PromptTokens`).

`exact_prompt` computes the digests once per request for each (model
service, block size) among the replicas with a stream, not once per
replica: replicas of one model share their engine key, and usually one block
size. `events_cached` is then one walk of set lookups per candidate.

Pure: no clock (`now` is a parameter), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests

if TYPE_CHECKING:
    from caravan_llm.router.core.endpoints import Endpoint

# Longer prompts are named this far only; the rest counts as never cached. At a
# block size of 16 that is 8192 digests, about 16 ms: the cap bounds what one
# request can cost the router's loop (a prompt this long takes seconds to prefill).
MAX_EXACT_TOKENS = 2**17

# (model service name, block size): the digests of one prompt differ by both.
DigestKind = tuple[str, int]


@dataclass(frozen=True, slots=True)
class ExactPrompt:
    """A prompt's token count and the digests of its full blocks, per (service, block size)."""

    tokens: int
    digests: Mapping[DigestKind, tuple[BlockDigest, ...]]


@dataclass(frozen=True, slots=True)
class EventsCached:
    """How much of a prompt one replica holds, by its own KV events."""

    # The prompt's leading tokens the replica holds: cached blocks x block size.
    tokens: int
    # The prompt's tokens (the token ids counted).
    of: int

    @property
    def share(self) -> float:
        """The cached share of the prompt, in [0, 1]."""
        return min(1.0, self.tokens / self.of) if self.of > 0 else 0.0


class CachedBlocksView(Protocol):
    """What the decision core reads of the exact index (`kv_index.KvIndex` has this shape)."""

    def block_size(self, replica: str) -> int | None: ...

    def cached_blocks(
        self, replica: str, digests: Sequence[BlockDigest], *, block_size: int, now: float
    ) -> int | None: ...


def exact_prompt(
    token_ids: Sequence[int],
    *,
    keys: Mapping[str, DigestKey],
    kinds: Iterable[DigestKind],
) -> ExactPrompt:
    """The prompt's digests for each (service, block size) of `kinds` whose service has a key.

    Raises ValueError when a token id is not an int in [0, 2**32) (a tokenizer bug).
    """
    head = token_ids[:MAX_EXACT_TOKENS]
    digests: dict[DigestKind, tuple[BlockDigest, ...]] = {}
    for service, block_size in sorted(set(kinds)):
        key = keys.get(service)
        if key is not None:
            digests[service, block_size] = block_digests(head, block_size=block_size, key=key)
    return ExactPrompt(tokens=len(token_ids), digests=MappingProxyType(digests))


def endpoint_digests(
    kv: CachedBlocksView, endpoint: Endpoint, prompt: ExactPrompt | None
) -> tuple[BlockDigest, ...]:
    """The prompt's digests as the endpoint's relay names blocks; () when it has none.

    None of them without an exact prompt, a relay (`kv_port`), a stream that
    said its block size, or digests computed in that size.
    """
    if prompt is None or endpoint.kv_port is None:
        return ()
    block_size = kv.block_size(endpoint.id)
    if block_size is None:
        return ()
    return prompt.digests.get((endpoint.service, block_size), ())


def events_cached(
    kv: CachedBlocksView, endpoint: Endpoint, prompt: ExactPrompt | None, now: float
) -> EventsCached | None:
    """How much of the prompt the endpoint holds by its KV events; None: not known from events.

    None when the request has no exact prompt, the endpoint has no live
    stream (absent, resyncing, stale: the caller uses the approximate index),
    or the prompt was not named in the endpoint's block size.
    """
    if prompt is None or endpoint.kv_port is None:
        return None
    block_size = kv.block_size(endpoint.id)
    if block_size is None:
        return None
    digests = prompt.digests.get((endpoint.service, block_size))
    if digests is None:
        return None
    blocks = kv.cached_blocks(endpoint.id, digests, block_size=block_size, now=now)
    if blocks is None:
        return None
    return EventsCached(tokens=blocks * block_size, of=prompt.tokens)
