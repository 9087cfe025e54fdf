"""Fuzzing the Consul and Nomad answer decoders: a value of the declared types, or HashiError."""

from __future__ import annotations

import dataclasses
import itertools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from fuzz_strategies import fuzz_settings, header_values, json_values, outcome, texts
from hypothesis import example, given
from hypothesis import strategies as st

from caravan_llm.common import consul_api, nomad_api
from caravan_llm.common.errors import HashiError, HashiMalformedAnswer, parse_index

pytestmark = pytest.mark.fuzz


def satisfies(value: Any, hint: Any) -> bool:
    """Whether `value` has the type `hint` says (dataclasses field by field, recursively)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(satisfies(value, arg) for arg in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(satisfies(item, args[0]) for item in value)
    if origin is list:
        return isinstance(value, list) and all(satisfies(item, args[0]) for item in value)
    if origin in (Mapping, dict, typing.Mapping):
        return isinstance(value, Mapping) and all(
            satisfies(k, args[0]) and satisfies(v, args[1]) for k, v in value.items()
        )
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            return False
        hints = typing.get_type_hints(hint)
        return all(
            satisfies(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(hint)
        )
    return isinstance(value, hint)


def decodes_typed(decode: Callable[[], Any], hint: Any) -> None:
    value, refused = outcome(decode, HashiError)
    if refused is not None:
        assert isinstance(refused, HashiMalformedAnswer)
        assert refused.retryable
    else:
        assert satisfies(value, hint), value


# Field names the decoders read, so wrong types land where they look.
CONSUL_FIELDS = st.sampled_from(
    [
        "Node",
        "Address",
        "Service",
        "ID",
        "Port",
        "Tags",
        "Meta",
        "Checks",
        "CheckID",
        "Status",
        "Key",
        "Value",
        "Flags",
        "Session",
        "LockIndex",
        "CreateIndex",
        "ModifyIndex",
        "TTL",
        "Name",
        "Behavior",
        "LockDelay",
        "KV",
        "Results",
        "Errors",
        "OpIndex",
        "What",
    ]
)
NOMAD_FIELDS = st.sampled_from(
    [
        "ID",
        "Namespace",
        "Version",
        "Status",
        "Stop",
        "SubmitTime",
        "Meta",
        "JobModifyIndex",
        "ModifyIndex",
        "AllocatedResources",
        "Shared",
        "Ports",
        "Label",
        "Value",
        "To",
        "HostIP",
        "DeploymentStatus",
        "Healthy",
        "TaskStates",
        "Events",
        "Type",
        "Time",
        "ExitCode",
        "JobVersion",
        "Job",
        "NodeResources",
        "Cpu",
        "CpuShares",
        "Memory",
        "MemoryMB",
        "Devices",
        "Instances",
        "Attributes",
        "memory",
        "Int",
        "HTTPAddr",
        "FailedTGAllocs",
        "QueuedAllocations",
        "CreateIndex",
        "Path",
        "Items",
        "Data",
        "File",
        "Offset",
    ]
)


def shaped(fields: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """JSON of the answer's shape: objects with its field names, holding anything."""
    return st.recursive(
        json_values,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(fields, inner, max_size=6),
        max_leaves=16,
    )


CONSUL_ANSWERS = shaped(CONSUL_FIELDS)
NOMAD_ANSWERS = shaped(NOMAD_FIELDS)
INDEXES = st.none() | header_values | st.integers() | texts

CONSUL_DECODERS: dict[str, tuple[Callable[[Any, Any], Any], Any]] = {
    "health": (consul_api.decode_health, tuple[int, tuple[consul_api.HealthEntry, ...]]),
    "services": (consul_api.decode_services, tuple[int, dict[str, tuple[str, ...]]]),
    "kv": (consul_api.decode_kv, tuple[int, consul_api.KVEntry | None]),
    "kv recurse": (consul_api.decode_kv_recurse, tuple[int, tuple[consul_api.KVEntry, ...]]),
    "keys": (consul_api.decode_keys, tuple[int, tuple[str, ...]]),
    "session": (consul_api.decode_session, tuple[int, consul_api.SessionInfo | None]),
}


def _pair_satisfies(value: Any, hint: Any) -> bool:
    index_hint, rest_hint = typing.get_args(hint)
    return satisfies(value[0], index_hint) and satisfies(value[1], rest_hint)


@fuzz_settings()
@given(st.sampled_from(sorted(CONSUL_DECODERS)), INDEXES, CONSUL_ANSWERS)
@example("health", "12", [{"Node": {"Node": "n", "Address": "a"}, "Service": []}])
@example("health", "garbage", [])
@example("health", None, [])
@example("kv", "1", {"Key": "k", "CreateIndex": "x"})
@example("session", "1", {"ID": "s", "TTL": "1.2.3s"})
def test_consul_answers_decode_to_their_types_or_a_malformed_answer(
    name: str, raw_index: Any, raw: Any
) -> None:
    """Any X-Consul-Index and any JSON: the decoded types, or HashiMalformedAnswer (retryable)."""
    decode, hint = CONSUL_DECODERS[name]
    value, refused = outcome(lambda: decode(raw_index, raw), HashiMalformedAnswer)
    if refused is not None:
        assert refused.retryable
    else:
        assert _pair_satisfies(value, hint), value


@fuzz_settings()
@given(st.sampled_from([200, 409, 500]), CONSUL_ANSWERS)
@example(409, {"Errors": [{"OpIndex": "x"}]})
@example(200, {"Results": [{"KV": {"Key": "k", "Value": "%%%"}}]})
def test_consul_txn_answers_decode_to_entries_or_a_typed_error(status: int, body: Any) -> None:
    """Any txn answer: KV entries, or a typed HashiError (a conflict, a denial, malformed)."""
    try:
        entries = consul_api.parse_txn_answer(status, body)
    except HashiError:
        return
    assert satisfies(entries, tuple[consul_api.KVEntry, ...])


NOMAD_DECODERS: dict[str, type[Any]] = {
    "job": nomad_api.JobStub,
    "allocation": nomad_api.Allocation,
    "node": nomad_api.Node,
    "evaluation": nomad_api.Evaluation,
    "variable metadata": nomad_api.VariableMetadata,
    "variable": nomad_api.Variable,
}


@fuzz_settings()
@given(st.sampled_from(sorted(NOMAD_DECODERS)), NOMAD_ANSWERS)
@example("job", {"Version": "x"})
@example("allocation", {"TaskStates": {"t": {"Events": [{"Time": []}]}}})
@example("node", {"NodeResources": {"Devices": [{"Attributes": {"memory": None}}]}})
@example("node", {"NodeResources": {"Devices": [{"Attributes": {"memory": {"Int": "x"}}}]}})
@example("evaluation", {"QueuedAllocations": {"g": "x"}})
def test_nomad_answers_decode_to_their_types_or_a_malformed_answer(name: str, data: Any) -> None:
    """Any JSON as any Nomad object: its dataclass, fields of their types, or a typed error."""
    kind = NOMAD_DECODERS[name]
    decodes_typed(lambda: kind.from_api(data), kind)


@fuzz_settings()
@given(INDEXES)
@example("18446744073709551616")
@example("\u0661")
@example("1e3")
def test_an_index_header_is_a_uint64_or_a_malformed_answer(raw: Any) -> None:
    """X-Consul-Index / X-Nomad-Index: a 64-bit unsigned integer, or HashiMalformedAnswer."""
    try:
        index = parse_index(raw, "fuzz")
    except HashiMalformedAnswer:
        return
    assert 0 <= index < 2**64


@fuzz_settings()
@given(st.lists(NOMAD_ANSWERS, max_size=3), st.lists(st.integers(min_value=0), max_size=6))
@example([], [])
def test_nomad_log_frames_decode_or_raise_typed_whatever_the_cuts(
    documents: list[Any], cuts: list[int]
) -> None:
    """A log stream of any JSON documents, cut anywhere: frames, or a HashiError, never another."""
    import json  # noqa: PLC0415 - local to the one test that writes frames

    stream = "".join(json.dumps(doc) for doc in documents).encode()
    stream += b"[" * (5000 if cuts and cuts[0] % 7 == 0 else 0)
    edges = sorted({0, len(stream), *(cut % max(1, len(stream)) for cut in cuts)})
    decoder = nomad_api.LogFrameDecoder()
    try:
        for start, end in itertools.pairwise(edges):
            for frame in decoder.feed(stream[start:end]):
                assert satisfies(frame, nomad_api.LogFrame)
        decoder.close()
    except HashiError:
        return
