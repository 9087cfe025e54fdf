"""The simulated vLLM held to the real one: one probe set, both engines, shapes compared.

Both servers start once for the module with the same flags and the same
`--api-key` (tests/real_vllm/standalone.py). Every probe goes to both; what
is compared is the *shape* of each answer (status, content type, JSON keys
and value kinds, SSE framing and the kind of each event, metric names, types
and label names, `cache_config_info`'s label names), never generated text or
timings. A test reports every difference of its area at once; the few that
are intended are in `INTENDED`, each with its reason, and are listed in
devcluster/README.md ("Simulated vs real vLLM: intended differences").

The abort probe (SIGTERM mid-stream) runs last, on the module's servers.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from polling import eventually
from prometheus_client.parser import text_string_to_metric_families
from standalone import real_vllm_server, simulated_vllm_server, terminate, wait_exited

from caravan_llm.devcluster.vllm_build import find_vllm, missing_build_message

pytestmark = pytest.mark.timeout(900)

API_KEY = "sekret-differential"
ABORT_READ_TIMEOUT_S = 10.0
MODEL = "tiny"
KEY = {"Authorization": f"Bearer {API_KEY}"}
# Every metric caravan reads (`grep -rn 'vllm:' scheduler router`), as families.
CARAVAN_READS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)
CHAT = [{"role": "user", "content": "hello there, tell me about the router"}]
PROMPT = "def main():\n    return"

# --- observations ------------------------------------------------------------


@dataclass(slots=True)
class Observation:
    """One probe's answer: status, content type and the decoded body."""

    status: int
    content_type: str
    body: Any = None  # decoded JSON, or text
    events: list[Any] | None = None  # SSE payloads (JSON or "[DONE]"), for event streams
    framing_ok: bool = True  # every SSE line is `data: ...` followed by a blank line
    note: str = ""


def parse_sse(text: str) -> tuple[list[Any], bool]:
    """The `data:` payloads of an SSE body, and whether every event is framed `data: X\\n\\n`."""
    events: list[Any] = []
    framing_ok = text.endswith("\n\n") or text == ""
    for block in text.split("\n\n"):
        if not block:
            continue
        if not block.startswith("data: ") or "\n" in block:
            framing_ok = False
            continue
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events, framing_ok


async def observe(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    body: Any = None,
    raw: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> Observation:
    kwargs: dict[str, Any] = {"headers": dict(headers or {})}
    if raw is not None:
        kwargs["data"] = raw
        kwargs["headers"]["Content-Type"] = "application/json"
    elif body is not None:
        kwargs["json"] = body
    async with session.request(method, url, **kwargs) as response:
        text = await response.text()
        ctype = response.content_type
        obs = Observation(status=response.status, content_type=ctype)
        if ctype == "text/event-stream":
            obs.events, obs.framing_ok = parse_sse(text)
        elif ctype == "application/json":
            obs.body = json.loads(text)
        else:
            obs.body = text
        return obs


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 6, **fields}


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, **fields}


USAGE = {"stream_options": {"include_usage": True}}
# name -> (method, path, json body, with the key)
PROBES: dict[str, tuple[str, str, Any, bool]] = {
    "health": ("GET", "/health", None, False),
    "health with key": ("GET", "/health", None, True),
    "version": ("GET", "/version", None, False),
    "metrics without key": ("GET", "/metrics", None, False),
    "models": ("GET", "/v1/models", None, True),
    "models without key": ("GET", "/v1/models", None, False),
    "chat without key": ("POST", "/v1/chat/completions", _chat(), False),
    "completions without key": ("POST", "/v1/completions", _completion(), False),
    "unknown route": ("GET", "/nope", None, True),
    "unknown /v1 route": ("GET", "/v1/nope", None, True),
    "unknown /v1 route without key": ("GET", "/v1/nope", None, False),
    "tokenize prompt": ("POST", "/tokenize", {"model": MODEL, "prompt": PROMPT}, False),
    "tokenize messages": (
        "POST",
        "/tokenize",
        {"model": MODEL, "messages": CHAT, "add_generation_prompt": True},
        False,
    ),
    "detokenize": ("POST", "/detokenize", {"model": MODEL, "tokens": [5, 6, 7]}, False),
    "messages count_tokens": (
        "POST",
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": CHAT},
        True,
    ),
    "pooling on a generate model": ("POST", "/pooling", {"model": MODEL, "input": "hi"}, True),
    "classify on a generate model": ("POST", "/classify", {"model": MODEL, "input": "hi"}, True),
    "tokenize unknown model": ("POST", "/tokenize", {"model": "nope", "prompt": PROMPT}, False),
    "chat": ("POST", "/v1/chat/completions", _chat(), True),
    "chat stream": ("POST", "/v1/chat/completions", _chat(stream=True), True),
    "chat stream usage": ("POST", "/v1/chat/completions", _chat(stream=True, **USAGE), True),
    "chat n=2": ("POST", "/v1/chat/completions", _chat(n=2), True),
    "chat n=2 stream usage": (
        "POST",
        "/v1/chat/completions",
        _chat(n=2, stream=True, **USAGE),
        True,
    ),
    "chat seed": ("POST", "/v1/chat/completions", _chat(seed=1), True),
    "chat continue_final_message": (
        "POST",
        "/v1/chat/completions",
        _chat(
            messages=[*CHAT, {"role": "assistant", "content": "The router"}],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        True,
    ),
    "completions": ("POST", "/v1/completions", _completion(), True),
    "completions stream": ("POST", "/v1/completions", _completion(stream=True), True),
    "completions stream usage": (
        "POST",
        "/v1/completions",
        _completion(stream=True, **USAGE),
        True,
    ),
    "completions n=2": ("POST", "/v1/completions", _completion(n=2), True),
    "completions n=2 stream usage": (
        "POST",
        "/v1/completions",
        _completion(n=2, stream=True, **USAGE),
        True,
    ),
    "chat unknown model": ("POST", "/v1/chat/completions", _chat(model="nope"), True),
    "completions unknown model": ("POST", "/v1/completions", _completion(model="nope"), True),
    "chat max_tokens above context": (
        "POST",
        "/v1/chat/completions",
        _chat(max_tokens=5000),
        True,
    ),
    "completions max_tokens above context": (
        "POST",
        "/v1/completions",
        _completion(max_tokens=5000),
        True,
    ),
    "chat prompt above context": (
        "POST",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": " x" * 2100}]),
        True,
    ),
    "chat max_tokens string": ("POST", "/v1/chat/completions", _chat(max_tokens="six"), True),
    "chat max_tokens 0": ("POST", "/v1/chat/completions", _chat(max_tokens=0), True),
    "chat messages not a list": ("POST", "/v1/chat/completions", _chat(messages="hi"), True),
    "chat stream not a bool": ("POST", "/v1/chat/completions", _chat(stream="yes"), True),
    "chat n string": ("POST", "/v1/chat/completions", _chat(n="two"), True),
    "completions prompt missing": ("POST", "/v1/completions", {"model": MODEL}, True),
    "completions max_tokens string": (
        "POST",
        "/v1/completions",
        _completion(max_tokens="six"),
        True,
    ),
}
RAW_PROBES: dict[str, tuple[str, bytes]] = {
    "chat invalid json": ("/v1/chat/completions", b"{not json"),
}


@dataclass(slots=True)
class Observations:
    """Everything one engine answered, by probe name."""

    probes: dict[str, Observation] = field(default_factory=dict)
    metrics_text: str = ""
    abort: Observation | None = None
    abort_exit: int | None = None


async def run_probes(base_url: str, *, abort: bool) -> Observations:
    """Send the probe set to one engine; with `abort`, SIGTERM it mid-stream at the end."""
    seen = Observations()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name, (method, path, body, with_key) in PROBES.items():
            seen.probes[name] = await observe(
                session, method, base_url + path, body=body, headers=KEY if with_key else None
            )
        for name, (path, raw) in RAW_PROBES.items():
            seen.probes[name] = await observe(
                session, "POST", base_url + path, raw=raw, headers=KEY
            )

        # Counters move after the requests finish; wait until the last ones are counted.
        async def scraped() -> str:
            obs = await observe(session, "GET", base_url + "/metrics")
            text = str(obs.body)
            return (
                text
                if re.search(r"^vllm:request_success_total\{.*\} [1-9]", text, re.MULTILINE)
                else ""
            )

        seen.metrics_text = await eventually(scraped, 30, f"{base_url} counted requests")
        if abort:
            seen.abort, seen.abort_exit = await _abort_probe(session, base_url)
    return seen


async def _abort_probe(
    session: aiohttp.ClientSession, base_url: str
) -> tuple[Observation, int | None]:
    """A long stream; SIGTERM to the server after its first content token; read to the end."""
    body = _chat(max_tokens=1900, ignore_eos=True, stream=True, **USAGE)
    chunks: list[bytes] = []
    obs = Observation(status=0, content_type="")
    try:
        async with session.post(
            base_url + "/v1/chat/completions", json=body, headers=KEY
        ) as response:
            obs.status = response.status
            obs.content_type = response.content_type
            signalled = False
            while True:
                # A stream that stalls after SIGTERM is a finding, not a hang of the test.
                piece = await asyncio.wait_for(response.content.readany(), ABORT_READ_TIMEOUT_S)
                if not piece:
                    break
                chunks.append(piece)
                if not signalled and b'"content":"' in b"".join(chunks).replace(
                    b'"content":""', b""
                ):
                    terminate(base_url)
                    signalled = True
    except aiohttp.ClientError as exc:
        obs.note = f"stream broken: {type(exc).__name__}"
    except TimeoutError:
        obs.note = f"stream stalled: no bytes for {ABORT_READ_TIMEOUT_S}s after SIGTERM"
    obs.events, obs.framing_ok = parse_sse(b"".join(chunks).decode(errors="replace"))
    exit_status: int | None
    try:
        exit_status = await wait_exited(base_url)
    except TimeoutError:
        exit_status = None
    return obs, exit_status


# --- shapes --------------------------------------------------------------------


def kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def shape_diff(path: str, sim: Any, real: Any) -> list[str]:
    """Every place where two JSON values differ in keys or kinds (lists: each item vs the first)."""
    if kind(sim) != kind(real):
        return [
            f"{path}: simulated {kind(sim)} ({_short(sim)}), real {kind(real)} ({_short(real)})"
        ]
    diffs: list[str] = []
    if isinstance(sim, dict):
        diffs += [
            f"{path}.{key}: only the real engine has it ({_short(real[key])})"
            for key in real.keys() - sim.keys()
        ]
        diffs += [
            f"{path}.{key}: only the simulator has it ({_short(sim[key])})"
            for key in sim.keys() - real.keys()
        ]
        for key in sim.keys() & real.keys():
            diffs.extend(shape_diff(f"{path}.{key}", sim[key], real[key]))
    elif isinstance(sim, list):
        if bool(sim) != bool(real):
            diffs.append(f"{path}: simulated {len(sim)} items, real {len(real)}")
        elif sim:
            for item in sim:
                diffs.extend(shape_diff(f"{path}[]", item, real[0]))
            for item in real[1:]:
                diffs.extend(shape_diff(f"{path}[]", sim[0], item))
    return sorted(set(diffs))


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def event_kind(event: Any) -> str:
    """What an SSE event is: done, usage, role, finish, content (chat) or text (completion)."""
    if event == "[DONE]":
        return "done"
    if "error" in event and "choices" not in event:
        return "error"
    choices = event.get("choices")
    if choices == []:
        return "usage" if event.get("usage") else "empty"
    choice = choices[0]
    if choice.get("finish_reason") is not None:
        return f"finish:{choice['finish_reason']}"
    delta = choice.get("delta")
    if delta is not None and "role" in delta:
        return "role"
    return "content"


def stream_pattern(events: Iterable[Any]) -> list[str]:
    """The kinds of a stream's events, each run of one kind collapsed to one (counts vary)."""
    pattern: list[str] = []
    for event in events:
        k = event_kind(event)
        index = (
            "" if event == "[DONE]" or not event.get("choices") else event["choices"][0]["index"]
        )
        label = f"{k}[{index}]" if index not in ("", 0) else k
        if not pattern or pattern[-1] != label:
            pattern.append(label)
    return pattern


def n2_pattern(events: Iterable[Any]) -> list[str]:
    """For n>1 streams: per choice index, its collapsed pattern (interleaving is not compared)."""
    by_index: dict[str, list[Any]] = {}
    tail: list[str] = []
    for event in events:
        if event == "[DONE]" or not event.get("choices"):
            tail.append(event_kind(event))
            continue
        by_index.setdefault(str(event["choices"][0]["index"]), []).append(event)
    return [
        *(f"{i}: {' '.join(stream_pattern(evs))}" for i, evs in sorted(by_index.items())),
        *tail,
    ]


def compare_observation(name: str, sim: Observation, real: Observation) -> list[str]:
    diffs: list[str] = []
    if sim.status != real.status:
        diffs.append(f"{name}: status simulated {sim.status}, real {real.status}")
    if sim.content_type != real.content_type:
        diffs.append(
            f"{name}: content type simulated {sim.content_type!r}, real {real.content_type!r}"
        )
    if sim.events is not None and real.events is not None:
        if sim.framing_ok != real.framing_ok:
            diffs.append(
                f"{name}: SSE framing ok simulated {sim.framing_ok}, real {real.framing_ok}"
            )
        pattern = n2_pattern if "n=2" in name else stream_pattern
        sim_pattern, real_pattern = pattern(sim.events), pattern(real.events)
        if sim_pattern != real_pattern:
            diffs.append(f"{name}: events simulated {sim_pattern}, real {real_pattern}")
        sim_by_kind = _first_by_kind(sim.events)
        real_by_kind = _first_by_kind(real.events)
        for k in sim_by_kind.keys() & real_by_kind.keys():
            diffs += [f"{name}: {line}" for line in shape_diff(k, sim_by_kind[k], real_by_kind[k])]
    elif kind(sim.body) == "string" and kind(real.body) == "string":
        if (sim.body == "") != (real.body == ""):
            diffs.append(f"{name}: body simulated {_short(sim.body)}, real {_short(real.body)}")
    else:
        diffs += [f"{name}: {line}" for line in shape_diff("body", sim.body, real.body)]
    return diffs


def _first_by_kind(events: list[Any]) -> dict[str, Any]:
    firsts: dict[str, Any] = {}
    for event in events:
        if event != "[DONE]":
            firsts.setdefault(event_kind(event).split(":")[0], event)
    return firsts


# --- metrics -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    type: str
    labels: frozenset[str]
    # Per label, its values (only kept for the labels named in VALUE_LABELS).
    values: Mapping[str, frozenset[str]]


# Labels whose values are part of the shape (the engine's own enumerations).
VALUE_LABELS = frozenset({"finished_reason", "reason", "source", "engine", "model_name"})


def metric_families(text: str) -> dict[str, Family]:
    """`vllm:` families by name (without `_total`): type, label names, enumerated values."""
    families: dict[str, Family] = {}
    for family in text_string_to_metric_families(text):
        # `_created` samples follow their counter or histogram: not compared on their own.
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        labels: set[str] = set()
        values: dict[str, set[str]] = {}
        for sample in family.samples:
            names = set(sample.labels) - {"le", "quantile"}
            labels |= names
            for label in names & VALUE_LABELS:
                values.setdefault(label, set()).add(sample.labels[label])
        families[family.name] = Family(
            family.type, frozenset(labels), {k: frozenset(v) for k, v in values.items()}
        )
    return families


def cache_config_labels(text: str) -> dict[str, str]:
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    return {}


# --- intended differences ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Intended:
    pattern: str  # a regular expression matched against a difference line
    reason: str


# Each entry is listed in devcluster/README.md with the same reason.
INTENDED: tuple[Intended, ...] = ()


def unexplained(diffs: Iterable[str], used: set[str]) -> list[str]:
    left = []
    for diff in diffs:
        match = next((i for i in INTENDED if re.search(i.pattern, diff)), None)
        if match is None:
            left.append(diff)
        else:
            used.add(match.pattern)
    return left


def assert_same(area: str, diffs: list[str], used: set[str]) -> None:
    left = unexplained(diffs, used)
    assert not left, f"{area}: {len(left)} differences, simulated vs real vLLM:\n" + "\n".join(
        f"  - {d}" for d in left
    )


# --- fixtures ------------------------------------------------------------------


@dataclass(slots=True)
class Pair:
    sim: Observations
    real: Observations
    used: set[str] = field(default_factory=set)


async def _observe_pair() -> Pair:
    build = find_vllm()
    if build is None:
        pytest.fail(missing_build_message())
    args = ("--api-key", API_KEY)
    # One at a time: the machine has two cores; the simulator's timings stay out of the way.
    async with simulated_vllm_server(build, extra_args=args) as sim_url:
        sim = await run_probes(sim_url, abort=True)
    async with real_vllm_server(build, extra_args=args) as real_url:
        real = await run_probes(real_url, abort=True)
    return Pair(sim=sim, real=real)


@pytest.fixture(scope="module")
def pair() -> Pair:
    return asyncio.run(_observe_pair())


# --- the comparisons -------------------------------------------------------------


def _compare(pair: Pair, names: Callable[[str], bool]) -> list[str]:
    diffs: list[str] = []
    for name in PROBES.keys() | RAW_PROBES.keys():
        if names(name):
            diffs += compare_observation(name, pair.sim.probes[name], pair.real.probes[name])
    return diffs


PLAIN_ROUTES = ("health", "version", "models", "unknown", "metrics without key")


def test_routes_and_auth(pair: Pair) -> None:
    diffs = _compare(pair, lambda n: n.startswith(PLAIN_ROUTES) or "without key" in n)
    assert_same("routes and the API key", diffs, pair.used)


def test_tokenize_and_detokenize(pair: Pair) -> None:
    diffs = _compare(pair, lambda n: "tokenize" in n)
    assert_same("/tokenize and /detokenize", diffs, pair.used)


def test_generation_shapes(pair: Pair) -> None:
    """Chat and completions, streamed and not, with and without usage, n=2: bodies and SSE."""
    diffs = _compare(
        pair,
        lambda n: (
            n.startswith(("chat", "completions"))
            and "without key" not in n
            and not _is_error_probe(n)
        ),
    )
    assert_same("generation", diffs, pair.used)


def _is_error_probe(name: str) -> bool:
    return any(
        word in name
        for word in ("unknown model", "above context", "string", " 0", "not a", "missing", "json")
    )


def test_error_bodies(pair: Pair) -> None:
    diffs = _compare(pair, lambda n: _is_error_probe(n) and "tokenize" not in n)
    assert_same("errors", diffs, pair.used)


def test_usage_counts_add_up(pair: Pair) -> None:
    """Beyond shape: usage's total is prompt + completion, on both engines."""
    problems = []
    for who, seen in (("simulated", pair.sim), ("real", pair.real)):
        for name in ("chat", "completions", "chat n=2", "completions n=2"):
            usage = seen.probes[name].body["usage"]
            if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
                problems.append(f"{who} {name}: {usage}")
        n2 = seen.probes["chat n=2"].body
        if len(n2["choices"]) != 2 or n2["usage"]["completion_tokens"] != 2 * 6:
            problems.append(f"{who} chat n=2: {len(n2['choices'])} choices, {n2['usage']}")
    assert not problems, problems


def test_metrics(pair: Pair) -> None:
    sim = metric_families(pair.sim.metrics_text)
    real = metric_families(pair.real.metrics_text)
    diffs = [
        f"metric {name}: only the real engine has it" for name in sorted(real.keys() - sim.keys())
    ]
    diffs += [
        f"metric {name}: only the simulator has it" for name in sorted(sim.keys() - real.keys())
    ]
    for name in sorted(sim.keys() & real.keys()):
        s, r = sim[name], real[name]
        if s.type != r.type:
            diffs.append(f"metric {name}: type simulated {s.type}, real {r.type}")
        if s.labels != r.labels:
            diffs.append(
                f"metric {name}: labels simulated {sorted(s.labels)}, real {sorted(r.labels)}"
            )
        for label in s.values.keys() & r.values.keys():
            if s.values[label] != r.values[label]:
                diffs.append(
                    f"metric {name}: {label} values simulated {sorted(s.values[label])}, "
                    f"real {sorted(r.values[label])}"
                )
    missing = [name for name in CARAVAN_READS if name not in sim or name not in real]
    assert not missing, f"metrics caravan reads, missing: {missing}"
    assert_same("metrics", diffs, pair.used)


def test_cache_config_info(pair: Pair) -> None:
    sim = cache_config_labels(pair.sim.metrics_text)
    real = cache_config_labels(pair.real.metrics_text)
    diffs = [
        f"cache_config_info {k}: only the real engine has it ({real[k]!r})"
        for k in sorted(real.keys() - sim.keys())
    ]
    diffs += [
        f"cache_config_info {k}: only the simulator has it ({sim[k]!r})"
        for k in sorted(sim.keys() - real.keys())
    ]
    # The values caravan reads must agree: the KV capacity in tokens.
    for label in ("block_size", "num_gpu_blocks", "enable_prefix_caching"):
        if sim.get(label) != real.get(label):
            diffs.append(
                f"cache_config_info {label}: simulated {sim.get(label)!r}, real {real.get(label)!r}"
            )
    assert_same("cache_config_info", diffs, pair.used)


def real_sigterm_ending(obs: Observation) -> str | None:
    """Which of the real engine's known SIGTERM endings a stream shows (None: another).

    vLLM 0.32 (CPU) ends a stream cut by SIGTERM in one of three ways, varying
    from run to run: a chunk with `finish_reason: "abort"` then `[DONE]`; an
    error event (`EngineCore encountered an issue`) then `[DONE]`; or no more
    bytes at all. caravan's router continues each of them on another replica
    (tests/real_vllm/test_real_vllm_stack.py kills a replica that way).
    """
    pattern = stream_pattern(obs.events or [])
    if obs.note and "stalled" in obs.note:
        return "stall"
    if pattern[-1:] != ["done"]:
        return None
    if "finish:abort" in pattern:
        return "abort"
    if any(isinstance(e, dict) and "error" in e for e in obs.events or []):
        return "error event"
    return None


def test_abort_on_sigterm(pair: Pair) -> None:
    """SIGTERM mid-stream: the simulator ends with vLLM's abort chunk then [DONE]; the
    real engine ends in one of its known ways; both exit."""
    sim, real = pair.sim.abort, pair.real.abort
    assert sim is not None
    assert real is not None
    sim_pattern = stream_pattern(sim.events or [])
    diffs = []
    if sim.note or "finish:abort" not in sim_pattern or sim_pattern[-1:] != ["done"]:
        diffs.append(f"simulated: {sim.note or 'ended'} with events {sim_pattern}")
    if real_sigterm_ending(real) is None:
        diffs.append(
            f"real: {real.note or 'ended'} with events {stream_pattern(real.events or [])}"
        )
    for who, seen in (("simulated", pair.sim), ("real", pair.real)):
        if seen.abort_exit is None:
            diffs.append(f"{who}: still running after SIGTERM")
    if real_sigterm_ending(real) == "abort":
        diffs += compare_observation("abort stream", sim, real)
    assert_same("abort", diffs, pair.used)


def test_every_intended_difference_is_seen(pair: Pair) -> None:
    """Run last: an allow-list entry that no longer matches anything is stale."""
    all_diffs: list[str] = []
    # Recompute everything once more so this test does not depend on the others' order.
    used: set[str] = set()
    unexplained(_compare(pair, lambda _: True), used)
    del all_diffs
    stale = [i.pattern for i in INTENDED if i.pattern not in used | pair.used]
    assert not stale, f"intended differences that no longer occur: {stale}"
