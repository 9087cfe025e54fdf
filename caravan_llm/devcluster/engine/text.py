"""The simulated engines' tokenizer, chat template and deterministic text generator.

Tokenizer (no vocabulary, no model files): a token is a chat-template marker
such as `<|im_start|>` with the whitespace before it, or a run of word
characters with the whitespace before it, or one punctuation character with the
whitespace before it, or trailing whitespace. Joining the tokens gives back
the text exactly, so `tokenize(a + b)` splits where `tokenize(a)` and
`tokenize(b)` did whenever `b` starts with whitespace or punctuation, which
every generated token does.

Generation: the token at position `i` of a reply is a pure function of
(the prompt the reply answers, the seed, `i`). A reply cut after `k` tokens
and continued elsewhere (the partial reply sent back as a trailing assistant
message) therefore goes on with tokens `k, k+1, ...` of the uninterrupted
reply, and the two halves join into exactly the same text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

_TOKEN_PATTERN = re.compile(r"\s*<\|\w+\|>|\s*\w+|\s*[^\w\s]|\s+")

# The words replies are made of; each generated word token carries a leading space.
_WORDS = (
    "the",
    "a",
    "model",
    "answer",
    "is",
    "that",
    "of",
    "to",
    "and",
    "in",
    "caravan",
    "replica",
    "token",
    "stream",
    "router",
    "engine",
    "cache",
    "prefix",
    "batch",
    "queue",
    "request",
    "fast",
    "small",
    "large",
    "every",
    "one",
    "two",
    "three",
    "node",
    "job",
    "service",
    "health",
    "check",
    "ready",
    "serves",
    "runs",
    "waits",
    "moves",
    "scales",
    "keeps",
    "gives",
    "makes",
    "this",
    "it",
    "with",
    "for",
    "on",
    "at",
    "by",
    "from",
    "hello",
    "world",
    "data",
    "text",
    "line",
    "word",
    "time",
    "step",
    "load",
    "rate",
    "slot",
    "port",
    "host",
    "name",
)
# One token in _PUNCTUATION_EVERY is punctuation, so replies read like sentences.
_PUNCTUATION = (",", ".")
_PUNCTUATION_EVERY = 8

FinishReason = Literal["stop", "length"]

# The Jinja form of the template `render_chatml` applies (what /props reports).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message with its content flattened to text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class PlannedOutput:
    """The text a request will produce, token by token, and why it ends."""

    tokens: tuple[str, ...]
    finish_reason: FinishReason

    @property
    def text(self) -> str:
        return "".join(self.tokens)


VOCAB_SIZE = 2048


class Vocabulary:
    """Token ids for /tokenize and /detokenize: a stable hash of each token's text.

    The simulator has no vocabulary file; ids it handed out map back to their
    text, and an id it never saw detokenizes to a word of the reply vocabulary.
    """

    def __init__(self, size: int = VOCAB_SIZE) -> None:
        self.size = size
        self._texts: dict[int, str] = {}

    def id_of(self, token: str) -> int:
        digest = hashlib.blake2b(token.encode(), digest_size=4).digest()
        token_id = int.from_bytes(digest, "big") % self.size
        self._texts.setdefault(token_id, token)
        return token_id

    def token_of(self, token_id: int) -> str:
        return self._texts.get(token_id, " " + _WORDS[token_id % len(_WORDS)])


def tokenize(text: str) -> list[str]:
    """Split `text` into the simulated engines' tokens; `"".join` undoes it."""
    return _TOKEN_PATTERN.findall(text)


def count_tokens(text: str) -> int:
    return sum(1 for _ in _TOKEN_PATTERN.finditer(text))


def render_chatml(messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
    """The ChatML prompt for `messages` (the template most small chat models use)."""
    parts = [f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_continuation(messages: Sequence[ChatMessage]) -> str:
    """The prompt that continues the last message instead of closing it."""
    head = render_chatml(messages[:-1], add_generation_prompt=False)
    last = messages[-1]
    return f"{head}<|im_start|>{last.role}\n{last.content}"


def generation_key(prompt: str) -> bytes:
    """What a reply is a function of, besides the seed: the prompt it answers."""
    return hashlib.blake2b(prompt.encode(), digest_size=16).digest()


def _draw(key: bytes, seed: int, position: int) -> int:
    material = (
        key + seed.to_bytes(8, "little", signed=True) + position.to_bytes(8, "little", signed=True)
    )
    return int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little")


def generated_token(key: bytes, seed: int, position: int) -> str:
    """The token at `position` of the reply to the prompt behind `key`."""
    draw = _draw(key, seed, position)
    if position > 0 and draw % _PUNCTUATION_EVERY == 0:
        return _PUNCTUATION[(draw >> 8) % len(_PUNCTUATION)]
    return " " + _WORDS[(draw >> 16) % len(_WORDS)]


def natural_length(key: bytes, seed: int, max_output_tokens: int) -> int:
    """Where the reply would emit EOS: between half of `max_output_tokens` and all of it."""
    low = max(1, (max_output_tokens + 1) // 2)
    span = max_output_tokens - low + 1
    return low + _draw(key, seed, -1) % span


def plan_output(
    *,
    key: bytes,
    seed: int,
    start: int,
    max_new_tokens: int,
    natural_len: int,
    stop: Sequence[str] = (),
) -> PlannedOutput:
    """The tokens from `start` on, ending at EOS, `max_new_tokens` or a stop string.

    `start` is the number of tokens of the reply already written (a
    continuation); stop strings are looked for in the new text only, and the
    text ends right before the first one, as vLLM and llama.cpp do.
    """
    remaining = natural_len - start
    finish: FinishReason = "stop"
    if max_new_tokens < remaining:
        remaining = max_new_tokens
        finish = "length"
    tokens = [generated_token(key, seed, start + i) for i in range(max(remaining, 0))]
    if stop:
        text = "".join(tokens)
        cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
        if cut >= 0:
            return PlannedOutput(tokens=_truncate(tokens, cut), finish_reason="stop")
    return PlannedOutput(tokens=tuple(tokens), finish_reason=finish)


def _truncate(tokens: Sequence[str], length: int) -> tuple[str, ...]:
    """The tokens whose joined text is the first `length` characters (the last one cut)."""
    kept: list[str] = []
    used = 0
    for token in tokens:
        if used + len(token) >= length:
            if length > used:
                kept.append(token[: length - used])
            break
        kept.append(token)
        used += len(token)
    return tuple(kept)
