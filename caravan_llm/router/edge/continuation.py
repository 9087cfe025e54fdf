"""Mid-stream failover, the pure part: SSE events, what a stream has sent, the continuation.

When an engine dies in the middle of a streaming completion, the router asks
another engine to go on from where the first one stopped, and keeps writing
into the same client response (only NVIDIA Dynamo does this elsewhere):

1. `StreamAccount` accumulates, from the complete SSE events forwarded so
   far, the text of choice 0, how many tokens that was, the stream's `id`,
   `created` and `model`, the finish reason and whether `[DONE]` came.
2. `build_continuation` turns the original request and the account into the
   request for the next engine: chat appends the text as a partial assistant
   message with `continue_final_message: true` and `add_generation_prompt:
   false` (engines that follow vLLM need the flags; llama-server would
   continue a trailing assistant message anyway, as a prefill, but only with
   the flags does it leave the partial text out of its first delta),
   completions append it to the prompt; `max_tokens` and
   `max_completion_tokens` shrink by the tokens already sent, and a
   completion without `max_tokens` on an engine with a default limit states
   what is left of that limit. What an engine does is read from its
   published `StreamTraits` (service Meta), never from its name.
3. `ContinuationRewriter` rewrites the continuation's events so the client
   sees one stream: the first stream's `id`/`created`/`model`, no second
   role-only chunk, usage counted over both halves, and (for an engine whose
   traits say it may repeat the prefill, as llama-server versions without the
   flag do) the partial text cut from the front of the first delta.

A continuation is refused (`Unfaithful`, with the reason) when it could not
read as the same answer: several choices (`n` > 1), log-probabilities, tool
calls or reasoning in the stream, guided decoding or a JSON response format
(the grammar would restart inside the partial text), a completion already at
its token limit, a completions prompt that is not one string, `echo` or
`suffix`, or a chat request that already ends with an assistant message it
did not ask to continue. The stream then ends with an error event.

Token counts: an engine usually sends one token per chunk; the account counts
chunks with text, or takes `usage.completion_tokens` when the engine reports
usage on every chunk (vLLM's `continuous_usage_stats`). An engine that packs
several tokens into one chunk makes the count low, so a continued answer can
overrun `max_tokens` by that difference, never stop short of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from caravan_llm.common.contract import StreamTraits

DONE_EVENT = b"data: [DONE]\n\n"
_DONE_DATA = b"[DONE]"
_TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


class StreamKind(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"


@dataclass(frozen=True, slots=True)
class Unfaithful:
    """Why the stream cannot be continued so that it reads as one answer."""

    reason: str


# -- SSE framing ------------------------------------------------------------------


def engine_json(data: bytes | str) -> Any:
    """The JSON value of bytes an engine sent; ValueError when they hold none.

    `json.loads`, except that a value nested past Python's recursion limit (an
    event of `[[[[...`) is the ValueError of text that is not JSON here, not a
    RecursionError out of the stream's relay.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested deeper than the recursion limit") from None


def split_complete_events(buffer: bytes) -> tuple[bytes, bytes]:
    """(the complete events at the start of `buffer`, the incomplete rest).

    Only complete events are forwarded, so that if the engine dies halfway
    through one, the client never holds half an event that a continuation's
    first event would then be glued to. `\\r\\n` line ends are normalised.
    """
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    cut = buffer.rfind(b"\n\n")
    if cut < 0:
        return b"", buffer
    return buffer[: cut + 2], buffer[cut + 2 :]


def iter_event_data(block: bytes) -> Iterator[bytes]:
    """The `data` of each event in a block of complete events; events without data are skipped."""
    for event in block.split(b"\n\n"):
        data = event_data(event)
        if data is not None:
            yield data


def event_data(event: bytes) -> bytes | None:
    """The data of one event, its `data:` lines joined by newlines; None when it has none."""
    parts = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in event.split(b"\n")
        if line.startswith(b"data:")
    ]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b"\n".join(parts)


# vLLM ends the streams it is running with this finish reason when it shuts
# down (SIGTERM), or with a server-side error event ("EngineCore encountered an
# issue"): the answer is cut, not complete (seen on vLLM 0.32, varying by run).
ABORT_FINISH = "abort"
_ENGINE_ERROR_TYPES = frozenset({"InternalServerError", "EngineDeadError", "server_error"})
_STOP_MARKS = (b'"abort"', b'"error"')


def cut_at_engine_stop(block: bytes) -> tuple[bytes, str | None]:
    """(the events of `block` before the engine gave up, why it did or None).

    The event whose choice finishes with `abort`, or a server-side error event
    (a 5xx code or an internal error type), and everything after it (usage,
    `[DONE]`) are the engine stopping, not the answer's end: they never reach
    the client, and the stream is continued elsewhere instead. An error event
    for the request itself (a 4xx code) is the answer, and passes.
    """
    if not any(mark in block for mark in _STOP_MARKS):
        return block, None
    kept: list[bytes] = []
    for event in block.split(b"\n\n"):
        if not event:
            continue
        data = event_data(event)
        reason = _engine_stop(data) if data is not None else None
        if reason is not None:
            return b"".join(kept), reason
        kept.append(event + b"\n\n")
    return block, None


def _engine_stop(data: bytes) -> str | None:
    if not any(mark in data for mark in _STOP_MARKS):
        return None
    try:
        chunk = engine_json(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(chunk, dict):
        return None
    error = chunk.get("error")
    if isinstance(error, Mapping) and "choices" not in chunk:
        code = error.get("code")
        server_side = isinstance(code, int) and not isinstance(code, bool) and code >= 500
        kind = error.get("type")
        if server_side or (isinstance(kind, str) and kind in _ENGINE_ERROR_TYPES):
            return "the engine failed mid-stream"
        return None
    choices = chunk.get("choices")
    if isinstance(choices, list) and any(
        isinstance(choice, Mapping) and choice.get("finish_reason") == ABORT_FINISH
        for choice in choices
    ):
        return "the engine aborted the stream"
    return None


def encode_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_event(error_body: Mapping[str, Any]) -> bytes:
    """An OpenAI-style error event followed by `[DONE]`, the way a stream ends in error."""
    return encode_event(error_body) + DONE_EVENT


# -- what a stream has sent ---------------------------------------------------------


@dataclass(slots=True)
class StreamAccount:
    """What the client has received of one streamed answer, across continuations."""

    kind: StreamKind
    id: str | None = None
    created: int | None = None
    model: str | None = None
    text_parts: list[str] = field(default_factory=list)
    content_chunks: int = 0
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    # The engine sent an error event: the stream is over, nothing to continue.
    errored: bool = False
    unfaithful: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def sent_tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return max(self.usage_completion_tokens, self.content_chunks)
        return self.content_chunks

    @property
    def finished(self) -> bool:
        """The answer is complete (a finish reason or `[DONE]` came, or an error event)."""
        return self.done or self.errored or self.finish_reason is not None

    def feed(self, block: bytes) -> None:
        """Account for a block of complete events that went to the client."""
        for data in iter_event_data(block):
            if data == _DONE_DATA:
                self.done = True
                continue
            try:
                chunk = engine_json(data)
            except (ValueError, UnicodeDecodeError):
                self.unfaithful = "the stream carried an event that is not JSON"
                continue
            if isinstance(chunk, dict):
                self.account_chunk(chunk)

    def account_chunk(self, chunk: Mapping[str, Any]) -> None:
        """Account for one decoded chunk."""
        if "error" in chunk and "choices" not in chunk:
            self.errored = True
            return
        if self.id is None:
            self._take_identity(chunk)
        usage = chunk.get("usage")
        if isinstance(usage, Mapping):
            tokens = usage.get("completion_tokens")
            if isinstance(tokens, int) and not isinstance(tokens, bool):
                self.usage_completion_tokens = tokens
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, Mapping):
                self._account_choice(choice)

    def _take_identity(self, chunk: Mapping[str, Any]) -> None:
        chunk_id, created, model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        self.id = chunk_id if isinstance(chunk_id, str) else None
        self.created = created if isinstance(created, int) else None
        self.model = model if isinstance(model, str) else None

    def _account_choice(self, choice: Mapping[str, Any]) -> None:
        if choice.get("index", 0) != 0:
            self.unfaithful = "the request asked for several choices"
            return
        if choice.get("logprobs") is not None:
            self.unfaithful = "the stream carries log-probabilities"
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self.finish_reason = finish
        if self.kind is StreamKind.CHAT:
            delta = choice.get("delta")
            if not isinstance(delta, Mapping):
                return
            if delta.get("tool_calls") or delta.get("function_call"):
                self.unfaithful = "the stream carries tool calls"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.unfaithful = "the stream carries reasoning"
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.text_parts.append(text)
            self.content_chunks += 1


# -- the continuation request --------------------------------------------------------


def request_blocker(payload: Mapping[str, Any], kind: StreamKind) -> str | None:
    """Why a stream of this request could never be continued faithfully; None if it could."""
    n = payload.get("n")
    if n is not None and n != 1:
        return "the request asked for several choices"
    best_of = payload.get("best_of")
    if best_of is not None and best_of != 1:
        return "the request uses best_of"
    if payload.get("logprobs") or payload.get("top_logprobs"):
        return "the request asks for log-probabilities"
    response_format = payload.get("response_format")
    if isinstance(response_format, Mapping) and response_format.get("type") not in (None, "text"):
        return "the request constrains the response format"
    if any(key.startswith("guided_") or key == "structured_outputs" for key in payload):
        return "the request uses guided decoding"
    if kind is StreamKind.COMPLETION:
        if _single_prompt(payload.get("prompt")) is None:
            return "the completions prompt is not one string"
        if payload.get("echo"):
            return "the request asks to echo the prompt"
        if payload.get("suffix"):
            return "the request has a suffix"
        return None
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], Mapping):
        return "the request has no messages"
    last = messages[-1]
    if last.get("role") == "assistant" and not (
        payload.get("continue_final_message") is True and isinstance(last.get("content"), str)
    ):
        return "the request already ends with an assistant message"
    return None


def build_continuation(
    payload: Mapping[str, Any], account: StreamAccount, traits: StreamTraits
) -> dict[str, Any] | Unfaithful:
    """The request that makes an engine with `traits` go on where the stream stopped."""
    blocker = request_blocker(payload, account.kind) or account.unfaithful
    if blocker is not None:
        return Unfaithful(blocker)
    sent = account.sent_tokens
    body = dict(payload)
    for name in _TOKEN_LIMIT_FIELDS:
        limit = payload.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            if limit - sent <= 0:
                return Unfaithful("the answer is already at its token limit")
            body[name] = limit - sent
    text = account.text
    if account.kind is StreamKind.COMPLETION:
        prompt = _single_prompt(payload.get("prompt"))
        body["prompt"] = f"{prompt}{text}"
        default_limit = traits.completion_default_max_tokens
        if "max_tokens" not in payload and default_limit is not None:
            if default_limit - sent <= 0:
                return Unfaithful("the answer is already at its token limit")
            body["max_tokens"] = default_limit - sent
        return body
    messages = list(payload["messages"])
    last = messages[-1]
    if last.get("role") == "assistant":
        # The client itself asked to continue this message: extend it.
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    body["messages"] = messages
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False
    return body


def _single_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


# -- rewriting the continuation's events -----------------------------------------------


@dataclass(slots=True)
class ContinuationRewriter:
    """Turns a continuation's events into events of the stream the client already has.

    Each event is also fed to the account, so a second failure continues from
    everything sent so far.
    """

    account: StreamAccount
    # Tokens sent before this continuation started (its usage counts from there).
    tokens_before: int
    # Text the engine may repeat at the start of its first delta (llama-server's
    # prefill echo); cut once if it is there, then forgotten.
    echo: str = ""

    def rewrite(self, block: bytes) -> bytes:
        """The events to forward for a block of complete continuation events."""
        out: list[bytes] = []
        for data in iter_event_data(block):
            if data == _DONE_DATA:
                self.account.done = True
                out.append(DONE_EVENT)
                continue
            try:
                chunk = engine_json(data)
            except (ValueError, UnicodeDecodeError):
                continue
            if not isinstance(chunk, dict):
                continue
            if self.account.kind is StreamKind.CHAT and _is_role_only(chunk):
                continue
            if self.echo:
                self._cut_echo(chunk)
            self._restamp(chunk)
            self.account.account_chunk(chunk)
            out.append(encode_event(chunk))
        return b"".join(out)

    def _cut_echo(self, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        holder = choice.get("delta") if self.account.kind is StreamKind.CHAT else choice
        key = "content" if self.account.kind is StreamKind.CHAT else "text"
        if not isinstance(holder, dict) or not isinstance(holder.get(key), str):
            return
        text: str = holder[key]
        if not text:
            return
        if text.startswith(self.echo):
            holder[key] = text[len(self.echo) :]
        self.echo = ""

    def _restamp(self, chunk: dict[str, Any]) -> None:
        account = self.account
        if "error" in chunk and "choices" not in chunk:
            return
        if account.id is not None:
            chunk["id"] = account.id
        if account.created is not None:
            chunk["created"] = account.created
        if account.model is not None:
            chunk["model"] = account.model
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            _shift_usage(usage, self.tokens_before)


def _is_role_only(chunk: Mapping[str, Any]) -> bool:
    """The first chunk of a chat stream: a role and no text (dropped from continuations)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    if not isinstance(delta, Mapping) or "role" not in delta:
        return False
    if choice.get("finish_reason") is not None:
        return False
    return all(key in ("role", "content") for key in delta) and not delta.get("content")


def _shift_usage(usage: dict[str, Any], tokens_before: int) -> None:
    """Usage of the continuation, recounted as usage of the whole answer.

    The continuation's prompt held the partial answer, so those tokens move
    from the prompt count back to the completion count; the total stays.
    """
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        usage["prompt_tokens"] = max(prompt - tokens_before, 0)
        usage["completion_tokens"] = completion + tokens_before
