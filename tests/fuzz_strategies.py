"""Shared hypothesis strategies and settings for fuzzing every parser that takes outside bytes.

The fuzz tests (`@pytest.mark.fuzz`, issue 26 item 3) draw their inputs from
here, so a hostile form found for one parser (a number past 2**64, a BOM, a
lone surrogate, a `data:` line without its space) is tried against all of them:

- `json_values`: any value `json.loads` can make, numbers at and past the
  64-bit and float limits included;
- `hostile_json`: JSON text the way an attacker writes it: huge numbers,
  `NaN`/`Infinity` tokens, duplicate keys, deep nesting, a BOM, bad UTF-8,
  cut short;
- `request_bodies`: OpenAI request bodies whose every field the router reads
  may take any type;
- `chunkings`: where a byte stream is cut into reads;
- `sse_streams`: engine event streams with garbage, odd `data:` forms and no
  `[DONE]`;
- `exposition_texts`: Prometheus text with the format's corners.

`fuzz_settings(share)` gives a target its example count from the loaded
profile. The suite's profile (`caravan`, tests/conftest.py) keeps the whole
fuzz run to about a minute of `make unit`; `make fuzz-long` loads the
`fuzz-long` profile (`--hypothesis-profile=fuzz-long`), 50 times as many.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


def outcome(call: Callable[[], T], refusal: type[E]) -> tuple[T | None, E | None]:
    """(what `call()` returned, None), or (None, the `refusal` it raised); anything else raises."""
    try:
        return call(), None
    except refusal as refused:
        return None, refused


# -- settings --------------------------------------------------------------------------


# A fuzz target's examples per example of the loaded profile: the suite's profile
# (100) gives a target 40, `fuzz-long` (5,000) gives it 2,000.
_EXAMPLES_PER_PROFILE_EXAMPLE = 0.4


def fuzz_settings(share: float = 1.0, **overrides: Any) -> settings:
    """Settings of one fuzz target: `share` of its examples under the loaded profile (at least 5).

    `share` weighs a target by its cost (a request through a live router) or its
    input space (every decoder of a family in one target).
    """
    examples = settings.default.max_examples * _EXAMPLES_PER_PROFILE_EXAMPLE * share
    return settings(max_examples=max(5, int(examples)), **overrides)


# -- JSON --------------------------------------------------------------------------------

# Integers at the edges of the widths engines and Go servers (Consul, Nomad) parse into.
edge_integers = (
    st.sampled_from(
        [0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1]
    )
    | st.integers(min_value=2**64, max_value=2**200)
    | st.integers(max_value=-(2**64))
)
numbers = (
    st.integers()
    | edge_integers
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e308, -0.0, 5e-324, 2.0, 1.5])
)
# Text with the characters parsers trip on: quotes, backslashes, brackets,
# control and format characters, surrogates, non-ASCII digits and line ends.
tricky_characters = st.sampled_from(
    list('"\\[]{}:,\n\r\t\x00\x1e\x1f\ufeff\u2028\u00e9\u00b2\u0661\ud800\udfff \x7f')
)
texts = st.text(max_size=12) | st.text(tricky_characters, max_size=8)
json_scalars = st.none() | st.booleans() | numbers | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=24,
)
json_objects = st.dictionaries(texts, json_values, max_size=5)

# JSON number and literal tokens that strict parsers refuse or that overflow a reader.
hostile_tokens = st.sampled_from(
    [
        "NaN",
        "-NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        "-1e400",
        "1e-400",
        "18446744073709551616",
        "-9223372036854775809",
        "9" * 5000,
        "1" + "0" * 400,
        "0.1e99999999999999999999",
        "01",
        "1.",
        ".5",
        "+1",
        "0x10",
        "true",
        "null",
        '"\\ud800"',
        '"\\u0000"',
        '"\\x"',
        "[" * 3000,
        "{" * 3000,
        '{"a":' * 3000,
    ]
)


def dumps_loose(value: Any) -> str:
    """JSON text of `value`, NaN and Infinity written as Python's encoder writes them."""
    return json.dumps(value, allow_nan=True, ensure_ascii=False)


@st.composite
def hostile_json(draw: st.DrawFn, values: st.SearchStrategy[Any] = json_values) -> bytes:
    """Bytes of JSON text with an attacker's changes applied."""
    text = dumps_loose(draw(values))
    for _ in range(draw(st.integers(0, 3))):
        change = draw(st.integers(0, 5))
        at = draw(st.integers(0, len(text)))
        if change == 0:  # a hostile token anywhere
            text = text[:at] + draw(hostile_tokens) + text[at:]
        elif change == 1:  # a duplicate key
            key = dumps_loose(draw(texts))
            text = "{" + key + ":1," + key + ":" + dumps_loose(draw(json_values)) + "}"
        elif change == 2:  # cut short
            text = text[:at]
        elif change == 3:  # deep nesting around it
            depth = draw(st.integers(1, 5000))
            text = "[" * depth + text + "]" * draw(st.integers(0, depth))
        elif change == 4:  # whitespace JSON allows, and some it does not
            text = (
                text[:at]
                + draw(st.sampled_from([" ", "\n", "\t", "\r", "\u00a0", "\x0b"]))
                + text[at:]
            )
        else:
            text = text[:at] + draw(texts) + text[at:]
    raw = text.encode("utf-8", "surrogatepass")
    return draw(byte_damage(raw))


@st.composite
def byte_damage(draw: st.DrawFn, raw: bytes) -> bytes:
    """`raw`, perhaps with a BOM in front, bytes that are not UTF-8, or bytes overwritten."""
    change = draw(st.integers(0, 5))
    if change == 0:
        return draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\x00"])) + raw
    if change == 1 and raw:
        at = draw(st.integers(0, len(raw)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\x80"]))
        return raw[:at] + junk + raw[at:]
    if change == 2 and raw:
        at = draw(st.integers(0, len(raw) - 1))
        return raw[:at] + draw(st.binary(min_size=1, max_size=3)) + raw[at + 1 :]
    return raw


# -- OpenAI request bodies ------------------------------------------------------------------

# Every field the router reads or type-checks, and a few it passes through.
REQUEST_FIELDS = (
    "model",
    "messages",
    "prompt",
    "input",
    "instructions",
    "system",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "tools",
    "tool_choice",
    "functions",
    "stop",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "logprobs",
    "top_logprobs",
    "response_format",
    "echo",
    "suffix",
    "seed",
    "user",
    "metadata",
    "continue_final_message",
    "add_generation_prompt",
    "guided_json",
    "ignore_eos",
)
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]) | json_values},
        optional={"text": texts | json_values, "image_url": json_values},
    )
    | json_values,
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])
            | json_values,
            "content": texts | content_parts | json_values,
            "name": json_values,
            "tool_calls": json_values,
            "tool_call_id": json_values,
        },
    )
    | json_values,
    max_size=4,
)
tools = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.just("function") | json_values,
            "function": st.fixed_dictionaries(
                {}, optional={"name": json_values, "parameters": json_values}
            )
            | json_values,
            "name": json_values,
            "input_schema": json_values,
        },
    )
    | json_values,
    max_size=3,
)
_FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", "other", ""]) | json_values,
    "messages": messages | json_values,
    "prompt": texts | st.lists(texts | st.integers() | st.lists(st.integers()), max_size=3),
    "input": texts | messages | st.lists(texts, max_size=3),
    "system": texts | content_parts,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}),
    "tools": tools | json_values,
    "n": st.integers(-2, 3) | json_values,
}


@st.composite
def request_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """An OpenAI-ish request body: known fields with plausible or wrong values, and extras."""
    names = draw(st.lists(st.sampled_from(REQUEST_FIELDS), max_size=8, unique=True))
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["model"] = "tiny"
    for name in names:
        body[name] = draw(_FIELD_VALUES.get(name, json_values))
    body.update(draw(st.dictionaries(texts, json_values, max_size=2)))
    return body


# -- byte streams -------------------------------------------------------------------------


@st.composite
def chunkings(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut into reads at arbitrary places (an empty read never: that is EOF)."""
    if not data:
        return []
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=12))))
    edges = [0, *(cut for cut in cuts if cut < len(data)), len(data)]
    return [data[start:end] for start, end in itertools.pairwise(edges)]


def sse_event(data: bytes, *, form: int = 0) -> bytes:
    """One SSE event carrying `data`, in one of the forms engines (and broken ones) write."""
    match form:
        case 1:
            return b"data:" + data + b"\n\n"
        case 2:
            return b"data: " + data + b"\r\n\r\n"
        case 3:
            return b"event: message\nid: 1\ndata: " + data + b"\n\n"
        case 4:
            return b": keep-alive\n\ndata: " + data + b"\n\n"
        case _:
            return b"data: " + data + b"\n\n"


def chunk_json(content: Any, *, finish: Any = None, index: Any = 0, usage: Any = None) -> bytes:
    """A chat.completion.chunk's JSON with one choice."""
    chunk: dict[str, Any] = {
        "id": "chatcmpl-fuzz",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return json.dumps(chunk, allow_nan=True).encode()


sse_garbage = st.sampled_from(
    [
        b"data: [DONE]\n\n",
        b"data:[DONE]\n\n",
        b"data: [DONE]",
        b"data: \n\n",
        b"data:\n\n",
        b"data\n\n",
        b": comment\n\n",
        b"\n\n",
        b"\r\n",
        b"\n",
        b"retry: 10\n\n",
        b'event: error\ndata: {"error": {"message": "x", "code": 500}}\n\n',
        b'data: {"error": {"message": "bad", "code": 400}}\n\n',
        b'data: {"choices": [{"index": 0, "finish_reason": "abort"}]}\n\n',
        b'data: {"choices": "x", "error": "y"}\n\n',
        b"data: " + b"[" * 5000 + b"\n\n",
        b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"x" * 70_000 + b'"}}]}\n\n',
        b"data: NaN\n\n",
        b'data: {"usage": {"completion_tokens": 1e400}}\n\n',
        b'data: {"usage": {"completion_tokens": ' + b"9" * 5000 + b"}}\n\n",
        b"data: \xff\xfe\n\n",
        b'data: {"a": 1,\ndata: "b": 2}\n\n',
    ]
)


@st.composite
def sse_events(draw: st.DrawFn) -> bytes:
    """One event of an engine's stream: a plausible chunk in some form, or garbage."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(sse_garbage)
    if kind == 1:
        return sse_event(draw(hostile_json()), form=draw(st.integers(0, 4)))
    content = draw(texts | json_values)
    finish = draw(st.none() | st.sampled_from(["stop", "length", "abort", "error"]) | json_values)
    usage = draw(st.none() | st.fixed_dictionaries({"completion_tokens": json_values}))
    index = draw(st.just(0) | json_values)
    data = chunk_json(content, finish=finish, index=index, usage=usage)
    return sse_event(data, form=draw(st.integers(0, 4)))


@st.composite
def sse_streams(draw: st.DrawFn) -> bytes:
    """An engine's whole stream: events, maybe `[DONE]`, maybe a torn last event."""
    body = b"".join(draw(st.lists(sse_events(), max_size=8)))
    if draw(st.booleans()):
        body += b"data: [DONE]\n\n"
    if draw(st.booleans()):
        body += draw(st.binary(max_size=20))
    return body


# -- Prometheus exposition text -------------------------------------------------------------

metric_names = st.sampled_from(
    ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "x"]
) | st.text("abz_:019", min_size=1, max_size=12)
sample_values = (
    st.sampled_from(
        [
            "0",
            "1",
            "-1",
            "1.5",
            "NaN",
            "+Inf",
            "-Inf",
            "1e400",
            "1e308",
            "0x1",
            "1_0",
            "",
            "abc",
            "1 2",
        ]
    )
    | st.floats(allow_nan=True).map(repr)
    | st.integers().map(str)
)
label_sets = st.sampled_from(
    [
        "",
        '{model_name="tiny"}',
        '{engine="0"}',
        '{a="\\""}',
        '{a="\\\\"}',
        '{a="\\n"}',
        "{}",
        '{a="1",}',
        '{a="1",a="2"}',
        '{a="x}',
        "{a=1}",
        '{="x"}',
        '{a="\u00e9"}',
    ]
)


@st.composite
def exposition_lines(draw: st.DrawFn) -> str:
    """One line of exposition text: a sample, a HELP or TYPE comment, or garbage."""
    kind = draw(st.integers(0, 4))
    name = draw(metric_names)
    if kind == 0:
        kind_name = draw(
            st.sampled_from(["gauge", "counter", "histogram", "summary", "untyped", "info", "x"])
        )
        return f"# TYPE {name} {kind_name}"
    if kind == 1:
        return f"# HELP {name} {draw(texts)}"
    if kind == 2:
        return draw(texts)
    timestamp = draw(st.sampled_from(["", " 1", " -1", " 1.5", " x"]))
    return f"{name}{draw(label_sets)} {draw(sample_values)}{timestamp}"


@st.composite
def exposition_texts(draw: st.DrawFn) -> str:
    """A metrics page: lines joined by one of the line ends a server may use."""
    lines = draw(st.lists(exposition_lines(), max_size=10))
    end = draw(st.sampled_from(["\n", "\r\n", "\n\n"]))
    return end.join(lines) + draw(st.sampled_from(["", "\n", "# EOF\n"]))


# -- headers --------------------------------------------------------------------------------

header_values = st.sampled_from(
    ["", "0", "1", "-1", " 7 ", "1e3", "0x10", "1_000", "\u0661", "99999999999999999999999", "abc"]
) | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
