"""Prefix affinity: consistent hashing with bounded loads (CHWBL), after KubeAI.

Requests that share the start of their prompt should land on the same replica,
whose engine then already holds that prefix in its KV cache. Every endpoint of
a model owns `virtual_nodes` points on a 64-bit hash ring; a request's key is
hashed onto the ring, and the walk clockwise from there gives its preference
order of endpoints. The balancer takes the first one on the walk whose load is
within the bound (see `within_load_bound`), so a hot prefix spills over to its
ring neighbours instead of melting one replica.

The ring depends only on the set of endpoint ids (sorted, hashed with blake2b,
never Python's salted `hash()`), so every router that sees the same Consul
snapshot makes the same choice without talking to the others, and removing an
endpoint only moves the keys that it owned.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_VIRTUAL_NODES = 256
DEFAULT_PREFIX_CHARS = 100
DEFAULT_LOAD_FACTOR = 1.25


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and every run."""
    # surrogatepass: JSON may decode to lone surrogates, which strict UTF-8 refuses.
    data = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class HashRing:
    """Virtual nodes of a set of endpoint ids, sorted by hash (built once per snapshot)."""

    endpoint_ids: tuple[str, ...]
    points: tuple[int, ...]
    owners: tuple[str, ...]

    @classmethod
    def build(
        cls, endpoint_ids: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    ) -> HashRing:
        """The ring of these ids; the same set in any order gives the same ring."""
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        ids = tuple(sorted(set(endpoint_ids)))
        # The id breaks the (astronomically rare) tie of two equal points, so the
        # order never depends on how the ids were listed.
        nodes = sorted(
            (stable_hash(f"{endpoint_id}#{replica}"), endpoint_id)
            for endpoint_id in ids
            for replica in range(virtual_nodes)
        )
        return cls(
            endpoint_ids=ids,
            points=tuple(point for point, _ in nodes),
            owners=tuple(owner for _, owner in nodes),
        )

    def walk(self, key: int) -> Iterator[str]:
        """Each endpoint id once, in ring order starting at the first point at or after `key`."""
        count = len(self.endpoint_ids)
        if count == 0:
            return
        total_points = len(self.points)
        start = bisect.bisect_left(self.points, key)
        seen: set[str] = set()
        for offset in range(total_points):
            owner = self.owners[(start + offset) % total_points]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == count:
                    return

    def owner(self, key: int) -> str | None:
        """The endpoint the key maps to when load is ignored; None for an empty ring."""
        if not self.points:
            return None
        index = bisect.bisect_left(self.points, key)
        return self.owners[index % len(self.points)]


def load_bound(total_in_flight: int, endpoint_count: int, load_factor: float) -> int:
    """The most in-flight requests (this one included) an endpoint may hold.

    The bound of Mirrokni et al.: ceil(c * (m + 1) / n) with m requests already
    placed on n endpoints. Rounding up guarantees that some endpoint is always
    within it, so the walk never runs dry because of the bound alone.
    """
    return math.ceil(load_factor * (total_in_flight + 1) / endpoint_count)


def within_load_bound(in_flight: int, bound: int) -> bool:
    """Whether one more request keeps the endpoint at or under the bound."""
    return in_flight + 1 <= bound


def affinity_key(
    request_json: Mapping[str, Any],
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    *,
    responses: bool = False,
) -> int | None:
    """The affinity hash of an OpenAI request body, or None when it has no prompt to key on.

    Chat: the system prompt(s) and the first user message, each cut to
    `prefix_chars`; that pair names a conversation, and every later turn of it
    repeats the pair, so the turns meet their own cached prefix. Anthropic
    messages and (`responses`: the body is one of the Responses API) Responses
    requests are read as chats (`conversation`). Completions: the first
    `prefix_chars` characters of the prompt.
    """
    messages = conversation(request_json, responses=responses)
    if messages is not None:
        text = _chat_prefix(messages, prefix_chars)
    else:
        text = _prompt_prefix(request_json.get("prompt"), prefix_chars)
    if not text:
        return None
    return stable_hash(text)


def conversation(payload: Mapping[str, Any], *, responses: bool = False) -> list[Any] | None:
    """A request's prompt as chat messages, whichever API it came by; None for a plain prompt.

    Chat completions: `messages`. Anthropic's Messages API: its top-level
    `system` (a string or text blocks) before `messages`. The Responses API
    (`responses`, since embeddings also have an `input`): `instructions` as the
    system prompt, then `input`, a string (one user message) or a list of items,
    of which those with a role are messages (tool calls and their outputs carry
    no prompt prefix worth keying on).
    """
    messages = payload.get("messages")
    if isinstance(messages, list):
        system = payload.get("system")
        if isinstance(system, str | list) and system:
            return [{"role": "system", "content": system}, *messages]
        return messages
    if not responses:
        return None
    items = payload.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    found: list[Any] = [
        item for item in items if isinstance(item, Mapping) and isinstance(item.get("role"), str)
    ]
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        found.insert(0, {"role": "system", "content": instructions})
    return found


def _chat_prefix(messages: list[Any], prefix_chars: int) -> str | None:
    system_parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role in ("system", "developer"):  # a tuple: a role of any JSON type compares
            system_parts.append(content_text(message.get("content"))[:prefix_chars])
        elif role == "user":
            user = content_text(message.get("content"))[:prefix_chars]
            if not user and not any(system_parts):
                return None
            # Separators keep ("ab", "c") and ("a", "bc") apart.
            return "\x1e".join(system_parts) + "\x1f" + user
    return None


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def _prompt_prefix(prompt: Any, prefix_chars: int) -> str | None:
    # The completions API takes a string, a list of strings (a batch: key on the
    # first), or token ids (a list of ints, or a list of such lists).
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:prefix_chars]
    if isinstance(prompt, list):
        tokens = prompt[:prefix_chars]
        if tokens and all(isinstance(token, int) for token in tokens):
            return ",".join(str(token) for token in tokens)
    return None
