"""Mid-stream failover, pure part: SSE framing, accounting, continuation requests, rewriting."""

from __future__ import annotations

import json
from typing import Any

import pytest

from caravan_llm.common.contract import StreamTraits
from caravan_llm.router.edge.continuation import (
    DONE_EVENT,
    ContinuationRewriter,
    StreamAccount,
    StreamKind,
    Unfaithful,
    build_continuation,
    error_event,
    event_data,
    request_blocker,
    split_complete_events,
)
from caravan_llm.scheduler.engines.registry import Engine, adapter_for


def traits_of(engine: str) -> StreamTraits:
    """The stream traits the engine's adapter publishes (what the router reads from Meta)."""
    return adapter_for(Engine(engine)).facts.stream_traits


def chunk(content: str | None = None, *, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    if content is not None:
        delta["content"] = content
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "qwen",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def events(*chunks: dict[str, Any], done: bool = False) -> bytes:
    block = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return block + (DONE_EVENT if done else b"")


def decode(block: bytes) -> list[Any]:
    out: list[Any] = []
    for event in block.split(b"\n\n"):
        data = event_data(event)
        if data is not None:
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


CHAT: dict[str, Any] = {
    "model": "qwen",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


class TestFraming:
    def test_only_complete_events_are_released(self) -> None:
        """A half-received event stays behind until its blank line arrives."""
        assert (b"data: 1\n\n", b"data: 2") == split_complete_events(b"data: 1\n\ndata: 2")

    def test_crlf_line_ends_are_normalised(self) -> None:
        """Events framed with CRLF are split like LF ones."""
        assert (b"data: 1\n\n", b"") == split_complete_events(b"data: 1\r\n\r\n")

    def test_event_data_joins_data_lines_and_skips_comments(self) -> None:
        """Multi-line data joins with newlines; a comment-only event has no data."""
        assert (b"a\nb", None) == (event_data(b"data: a\ndata:b"), event_data(b": keep-alive"))

    def test_error_event_ends_with_done(self) -> None:
        """An error event is an OpenAI error object followed by [DONE]."""
        body = {"error": {"message": "x", "type": "server_error", "param": None, "code": "c"}}

        assert [body, "[DONE]"] == decode(error_event(body))


class TestAccount:
    def test_accumulates_text_tokens_identity_and_finish(self) -> None:
        """The account holds the streamed text, its chunk count, the first id and the end."""
        account = StreamAccount(StreamKind.CHAT)
        account.feed(events(chunk("", role="assistant"), chunk(" a"), chunk(" b")))
        before_finish = account.finished
        account.feed(events(chunk(" c", finish="length"), done=True))

        assert (" a b c", 3, "chatcmpl-1", 100, "qwen") == (
            account.text,
            account.sent_tokens,
            account.id,
            account.created,
            account.model,
        )
        assert (False, True, True, "length") == (
            before_finish,
            account.finished,
            account.done,
            account.finish_reason,
        )

    def test_usage_counts_tokens_when_the_engine_reports_it(self) -> None:
        """Continuous usage stats give the token count when chunks carry several tokens."""
        account = StreamAccount(StreamKind.CHAT)
        with_usage = chunk(" two words")
        with_usage["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        account.feed(events(with_usage))

        assert 2 == account.sent_tokens

    @pytest.mark.parametrize(
        ("piece", "reason"),
        [
            ({"tool_calls": [{"index": 0}]}, "tool calls"),
            ({"reasoning_content": "hmm"}, "reasoning"),
        ],
    )
    def test_tool_calls_or_reasoning_make_it_unfaithful(
        self, piece: dict[str, Any], reason: str
    ) -> None:
        """A stream that carried tool calls or reasoning cannot be continued as text."""
        account = StreamAccount(StreamKind.CHAT)
        account.feed(events(chunk(**piece)))

        assert account.unfaithful is not None
        assert reason in account.unfaithful

    def test_second_choice_makes_it_unfaithful(self) -> None:
        """A chunk of choice 1 means n > 1."""
        account = StreamAccount(StreamKind.CHAT)
        second = chunk(" x")
        second["choices"][0]["index"] = 1
        account.feed(events(second))

        assert "several choices" in (account.unfaithful or "")

    def test_engine_error_event_finishes_the_stream(self) -> None:
        """An error event from the engine ends the answer: nothing to continue."""
        account = StreamAccount(StreamKind.CHAT)
        account.feed(events({"error": {"message": "boom"}}))

        assert (True, True) == (account.errored, account.finished)


class TestBuildContinuation:
    def account_with(self, text: str, tokens: int) -> StreamAccount:
        account = StreamAccount(StreamKind.CHAT)
        account.feed(events(*(chunk(piece) for piece in _split(text, tokens))))
        return account

    @pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
    def test_chat_appends_partial_assistant_message_and_shrinks_limits(self, engine: str) -> None:
        """The partial text becomes an assistant message to continue; limits lose what was sent."""
        payload = {**CHAT, "max_tokens": 10, "max_completion_tokens": 12, "seed": 3}
        account = self.account_with(" a b c", 3)

        body = build_continuation(payload, account, traits_of(engine))

        assert isinstance(body, dict)
        assert [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": " a b c"},
        ] == body["messages"]
        assert (7, 9, 3) == (body["max_tokens"], body["max_completion_tokens"], body["seed"])
        assert (True, False) == (body["continue_final_message"], body["add_generation_prompt"])
        assert payload["messages"] == CHAT["messages"]  # the original is untouched

    def test_client_continuation_extends_its_own_message(self) -> None:
        """A request that itself continues an assistant message gets that message extended."""
        payload = {
            **CHAT,
            "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure:"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }

        body = build_continuation(payload, self.account_with(" one", 1), traits_of("vllm"))

        assert isinstance(body, dict)
        assert {"role": "assistant", "content": "Sure: one"} == body["messages"][-1]
        assert 2 == len(body["messages"])

    def test_completion_at_its_limit_cannot_continue(self) -> None:
        """Nothing is left of max_tokens: no continuation."""
        body = build_continuation(
            {**CHAT, "max_tokens": 2}, self.account_with(" a b", 2), traits_of("vllm")
        )

        assert Unfaithful("the answer is already at its token limit") == body

    def test_completions_prompt_gets_the_text_appended(self) -> None:
        """Legacy completions continue from prompt + text, with vLLM's default limit applied."""
        account = StreamAccount(StreamKind.COMPLETION)
        account.feed(
            events(
                {
                    "id": "cmpl-1",
                    "created": 1,
                    "model": "m",
                    "choices": [{"index": 0, "text": " x"}],
                }
            )
        )
        payload = {"model": "m", "prompt": "Once", "stream": True}

        assert {**payload, "prompt": "Once x", "max_tokens": 15} == build_continuation(
            payload, account, traits_of("vllm")
        )
        assert {**payload, "prompt": "Once x"} == build_continuation(
            payload, account, traits_of("llamacpp")
        )

    @pytest.mark.parametrize(
        ("extra", "kind"),
        [
            ({"n": 2}, StreamKind.CHAT),
            ({"logprobs": True}, StreamKind.CHAT),
            ({"response_format": {"type": "json_object"}}, StreamKind.CHAT),
            ({"guided_json": {}}, StreamKind.CHAT),
            ({"messages": [{"role": "assistant", "content": "x"}]}, StreamKind.CHAT),
            ({"prompt": [1, 2, 3]}, StreamKind.COMPLETION),
            ({"prompt": "p", "echo": True}, StreamKind.COMPLETION),
        ],
    )
    def test_requests_that_cannot_be_continued_say_why(
        self, extra: dict[str, Any], kind: StreamKind
    ) -> None:
        """Several choices, log-probabilities, constrained output, echo: each has a reason."""
        assert request_blocker({**CHAT, **extra}, kind) is not None

    def test_plain_chat_request_can_be_continued(self) -> None:
        """A plain chat request has nothing that blocks a continuation."""
        assert request_blocker({**CHAT, "tools": [{"type": "function"}]}, StreamKind.CHAT) is None


class TestRewriter:
    def test_continuation_events_carry_the_first_streams_identity(self) -> None:
        """The role chunk is dropped and id/created/model are the first stream's."""
        account = StreamAccount(StreamKind.CHAT)
        account.feed(events(chunk("", role="assistant"), chunk(" a")))
        rewriter = ContinuationRewriter(account, tokens_before=1)
        other = {"id": "chatcmpl-2", "created": 200, "model": "qwen-other"}

        out = rewriter.rewrite(
            events(
                {**chunk("", role="assistant"), **other},
                {**chunk(" b"), **other},
                {**chunk(None, finish="stop"), **other},
                done=True,
            )
        )

        decoded = decode(out)
        assert "[DONE]" == decoded[-1]
        assert [" b", None] == [c["choices"][0]["delta"].get("content") for c in decoded[:-1]]
        assert {("chatcmpl-1", 100, "qwen")} == {
            (c["id"], c["created"], c["model"]) for c in decoded[:-1]
        }
        assert (" a b", True, "stop") == (account.text, account.done, account.finish_reason)

    def test_usage_is_recounted_over_the_whole_answer(self) -> None:
        """Tokens of the partial answer move from the prompt count back to the completion count."""
        account = StreamAccount(StreamKind.CHAT)
        account.feed(events(chunk(" a"), chunk(" b")))
        rewriter = ContinuationRewriter(account, tokens_before=2)
        usage_chunk = {
            "id": "x",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
        }

        decoded = decode(rewriter.rewrite(events(usage_chunk)))

        assert {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17} == decoded[0][
            "usage"
        ]

    def test_repeated_prefill_is_cut_from_the_first_delta(self) -> None:
        """An engine that repeats the continued text in its first delta has it removed once."""
        account = StreamAccount(StreamKind.CHAT)
        account.feed(events(chunk(" a"), chunk(" b")))
        rewriter = ContinuationRewriter(account, tokens_before=2, echo=" a b")

        decoded = decode(rewriter.rewrite(events(chunk(" a b c"), chunk(" a b"))))

        assert [" c", " a b"] == [c["choices"][0]["delta"]["content"] for c in decoded]


def _split(text: str, tokens: int) -> list[str]:
    words = [f" {word}" for word in text.split()]
    assert tokens == len(words)
    return words
