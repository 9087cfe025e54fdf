"""A chat's leading token ids, found on the event loop from the messages it repeats (issue 24).

A conversation's next turn repeats every earlier message, and many chats
open with the same system prompt. When a model's worker thread tokenizes a
chat, it also notes how many of the chat's ids its first messages fill
(`ModelTokenizer.chat_checkpoints`: the rendered text of those messages,
without the generation prompt, up to its last added token). The registry
keeps those ids here, keyed by a digest of the messages (`message_chain`).
A later request whose messages begin with the same ones finds them here on
the event loop, by digesting its own messages (no template, no tokenizer, no
wait for the worker thread), and the prefix index gets them at once: a
request that queues behind other prompts on the model's one worker thread
is routed on its history's blocks instead of on the approximate index.

This holds where a template renders a chat's first messages as a prefix of
the whole chat's text, as ChatML and most templates do. The worker thread
checks it for the chat that records ids; the registry checks every early
hand-over against the ids the thread then computes, and a model whose
template renders earlier turns differently once later ones follow (some
drop the reasoning of earlier turns) stops using this (logged once).

Bounded: at most `max_ids` ids per model, least recently used dropped first,
4 bytes each. Loop-owned: read and written on the event loop only.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from caravan_llm.router.tokens.conversation import ChatPrompt

# About 16 MB of ids per model.
DEFAULT_MAX_IDS = 4_000_000
# Digest size: 128 bits, no collision among the chats one router sees.
_DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The ids a chat's first `messages` messages fill, and the characters they cover."""

    messages: int
    ids: int
    chars: int


@dataclass(frozen=True, slots=True)
class ChainLink:
    """A chat's first k messages: their digest, and the k-th message's JSON length."""

    digest: bytes
    chars: int


@dataclass(frozen=True, slots=True)
class KnownPrefix:
    """The leading ids of a chat found here: they cover its first `messages` messages."""

    ids: Sequence[int]
    chars: int
    messages: int
    # The JSON length of the chat's messages after those: the text still to tokenize.
    rest_chars: int


def message_chain(prompt: ChatPrompt) -> tuple[ChainLink, ...] | None:
    """Per k in 1..n, a digest of the chat's first k messages; None if one is not JSON.

    The digest covers the messages as the request gave them and the
    template switches that apply to every turn (`reasoning_effort`), never
    `add_generation_prompt` or `continue_final_message`, which only change
    the end of the text.
    """
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"caravan-chat")
    hasher.update(json.dumps(prompt.reasoning_effort).encode())
    links: list[ChainLink] = []
    for message in prompt.messages:
        try:
            encoded = json.dumps(
                message, sort_keys=True, separators=(",", ":"), ensure_ascii=False
            ).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError):
            return None
        hasher.update(len(encoded).to_bytes(8, "big"))
        hasher.update(encoded)
        links.append(ChainLink(hasher.copy().digest(), len(encoded)))
    return tuple(links)


class ConversationPrefixes:
    """One model's recorded chat prefixes: digest of the first messages -> their ids."""

    def __init__(self, *, max_ids: int = DEFAULT_MAX_IDS) -> None:
        self._max_ids = max_ids
        self._entries: OrderedDict[bytes, tuple[array[int], int]] = OrderedDict()
        self._held_ids = 0
        # False once an early hand-over disagreed with the thread's ids (module docstring).
        self.enabled = True

    @property
    def held_ids(self) -> int:
        return self._held_ids

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self,
        chain: Sequence[ChainLink],
        ids: Sequence[int],
        checkpoints: Sequence[Checkpoint],
    ) -> None:
        """Keep the ids each checkpoint of a tokenized chat names (`ids`: the chat's ids)."""
        if not self.enabled:
            return
        for checkpoint in checkpoints:
            if not 0 < checkpoint.messages <= len(chain) or not 0 < checkpoint.ids <= len(ids):
                continue
            if checkpoint.ids > self._max_ids:
                continue
            key = chain[checkpoint.messages - 1].digest
            old = self._entries.pop(key, None)
            if old is not None:
                self._held_ids -= len(old[0])
            self._entries[key] = (array("I", ids[: checkpoint.ids]), checkpoint.chars)
            self._held_ids += checkpoint.ids
        while self._held_ids > self._max_ids:
            _, (dropped, _) = self._entries.popitem(last=False)
            self._held_ids -= len(dropped)

    def longest(self, chain: Sequence[ChainLink]) -> KnownPrefix | None:
        """The ids of the most leading messages of the chat recorded here, or None."""
        if not self.enabled:
            return None
        rest = 0
        for count in range(len(chain), 0, -1):
            key = chain[count - 1].digest
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                ids, chars = found
                return KnownPrefix(ids=ids, chars=chars, messages=count, rest_chars=rest)
            rest += chain[count - 1].chars
        return None

    def disable(self) -> None:
        """Stop recording and finding (the template breaks the prefix rule); forget all."""
        self.enabled = False
        self._entries.clear()
        self._held_ids = 0
