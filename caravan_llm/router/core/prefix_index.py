"""What a prompt is made of, and an approximate index of what each engine has cached.

The router has no tokenizer, so it works in characters: the prompt (chat
messages rendered as role and text, or a completions prompt) is cut into
blocks of `block_chars` characters, and each full block is named by a hash
chain (the hash of the previous block's name and this block's text), as vLLM
names its KV blocks by a chain over token ids. Two prompts that share their
first k blocks share the first k names, and a name says the whole prefix
before it, so "is this block cached" is a set lookup.

`PromptShape` is computed once per request by the proxy; `BlockIndex` holds,
per endpoint, the names of the blocks this router sent there, least recently
used first. It never holds more blocks than the engine's KV capacity can
(`record` evicts down to the capacity it is given), and it evicts a chain's
last blocks before its first ones, as vLLM frees a finished request's blocks
tail first, so a shared system prompt outlives the conversations under it.

Everything here is pure (no clock, no I/O); hashes are blake2b, the same in
every process, so every router names the same prompt the same way.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from caravan_llm.router.core.affinity import content_text, conversation, stable_hash

DEFAULT_BLOCK_CHARS = 128
DEFAULT_CHARS_PER_TOKEN = 4.0
# The ring key is the name of this block (or the prompt's last full one): long
# enough to tell system prompts apart, short enough to sit inside one.
DEFAULT_KEY_BLOCKS = 4
# Longer prompts are hashed this far only; the rest counts as never cached.
MAX_BLOCKS = 1024

_ROLE_SEPARATOR = "\x1f"
_MESSAGE_END = "\x1e"


@dataclass(frozen=True, slots=True)
class ShapeConfig:
    """How prompts are cut into blocks and how characters convert to tokens."""

    block_chars: int = DEFAULT_BLOCK_CHARS
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    key_blocks: int = DEFAULT_KEY_BLOCKS

    def __post_init__(self) -> None:
        if self.block_chars < 1:
            raise ValueError(f"block_chars must be >= 1, got {self.block_chars}")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.key_blocks < 1:
            raise ValueError(f"key_blocks must be >= 1, got {self.key_blocks}")

    @property
    def block_tokens(self) -> float:
        """Estimated tokens per block."""
        return self.block_chars / self.chars_per_token


@dataclass(frozen=True, slots=True)
class PromptShape:
    """A request's prompt as the cost model sees it."""

    # Names of the prompt's full blocks, in order (each one names its whole prefix).
    blocks: tuple[int, ...]
    # Estimated prompt tokens (all of the prompt, full blocks or not).
    tokens: int
    # Where the prompt's prefix sits on the hash ring when no engine holds it yet.
    ring_key: int | None


def prompt_shape(
    payload: Mapping[str, Any], config: ShapeConfig, *, responses: bool = False
) -> PromptShape | None:
    """The shape of an OpenAI request body's prompt; None when it has none to speak of.

    `responses`: the body is one of the Responses API (its `input` is the prompt).
    """
    messages = conversation(payload, responses=responses)
    if messages is not None:
        text = _chat_text(messages)
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: the first prompt stands for the request
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            # Token ids: the count is exact; one id is about one token's characters.
            text = ",".join(str(token) for token in prompt)
            return _shape(text, config, tokens=len(prompt))
        text = prompt if isinstance(prompt, str) else ""
    if not text:
        return None
    return _shape(text, config, tokens=math.ceil(len(text) / config.chars_per_token))


def _shape(text: str, config: ShapeConfig, *, tokens: int) -> PromptShape:
    blocks = block_chain(text, config.block_chars)
    if blocks:
        ring_key: int | None = blocks[min(config.key_blocks, len(blocks)) - 1]
    else:
        ring_key = stable_hash(text)
    return PromptShape(blocks=blocks, tokens=tokens, ring_key=ring_key)


def block_chain(text: str, block_chars: int) -> tuple[int, ...]:
    """The chain-hash names of the text's full blocks (at most MAX_BLOCKS)."""
    data = text.encode("utf-8", "surrogatepass")
    # Blocks are cut on characters, not bytes, so the same text cuts the same way.
    count = min(len(text) // block_chars, MAX_BLOCKS)
    if len(data) == len(text):  # ASCII: byte offsets are character offsets
        pieces = [data[i * block_chars : (i + 1) * block_chars] for i in range(count)]
    else:
        pieces = [
            text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
            for i in range(count)
        ]
    names: list[int] = []
    previous = b""
    for piece in pieces:
        digest = hashlib.blake2b(previous + piece, digest_size=8).digest()
        names.append(int.from_bytes(digest, "big"))
        previous = digest
    return tuple(names)


def _chat_text(messages: Sequence[Any]) -> str:
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        parts.append(
            f"{role if isinstance(role, str) else ''}{_ROLE_SEPARATOR}"
            f"{content_text(message.get('content'))}{_MESSAGE_END}"
        )
    return "".join(parts)


class BlockIndex:
    """The blocks one router believes one engine holds, least recently used first.

    Not thread-safe; like the rest of the live state it lives on one event loop.
    """

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __eq__(self, other: object) -> bool:
        # Same blocks in the same recency order.
        if not isinstance(other, BlockIndex):
            return NotImplemented
        return list(self._blocks) == list(other._blocks)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"BlockIndex({len(self._blocks)} blocks)"

    def matched(self, blocks: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the index holds."""
        held = self._blocks
        count = 0
        for name in blocks:
            if name not in held:
                break
            count += 1
        return count

    def record(self, blocks: Sequence[int], capacity_blocks: int) -> None:
        """The prompt was sent: its blocks become the most recently used, within capacity.

        Inserted last block first, so the chain's first blocks end up the most
        recent and a chain is evicted from its tail. Afterwards the index holds
        at most `capacity_blocks` (0 empties it).
        """
        capacity = max(0, capacity_blocks)
        held = self._blocks
        for name in reversed(blocks[:capacity]):
            if name in held:
                held.move_to_end(name)
            else:
                held[name] = None
        while len(held) > capacity:
            held.popitem(last=False)

    def shrink(self, capacity_blocks: int) -> None:
        """Forget the least recently used blocks beyond a (new, smaller) capacity."""
        held = self._blocks
        while len(held) > max(0, capacity_blocks):
            held.popitem(last=False)
