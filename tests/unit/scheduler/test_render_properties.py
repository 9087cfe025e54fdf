"""Properties of rendering over generated valid profiles."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from nomad_facts import nomad_fact_violations

from caravan_llm.scheduler.gpu_classes import BUILTIN_GPU_CLASSES
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.render import PlacementHints, render

names = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", fullmatch=True)
node_ids = st.frozensets(st.uuids().map(str), max_size=4)


@st.composite
def profiles(draw: st.DrawFn) -> ModelProfile:
    engine = draw(st.sampled_from(["vllm", "llamacpp"]))
    document: dict[str, Any] = {
        "name": draw(names.filter(lambda n: n not in {"router", "scheduler"})),
        "model": draw(st.sampled_from(["org/model", "/models/m.gguf", "m"])),
        "engine": engine,
        "max_concurrency": draw(st.none() | st.integers(1, 512)),
        "context_length": draw(st.none() | st.integers(16, 131072)),
        "startup_timeout_s": draw(st.none() | st.integers(10, 7200)),
        "drain_s": draw(st.integers(0, 600)),
        "env": draw(
            st.dictionaries(
                st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True),
                st.text(max_size=8),
                max_size=3,
            )
        ),
    }
    low = draw(st.integers(0, 3))
    high = draw(st.integers(max(low, 1), 6))
    document["replicas"] = {"min": low, "max": high}
    if draw(st.booleans()):
        document["resources"] = {
            "cores": draw(st.integers(1, 16)),
            "memory_mb": draw(st.integers(10, 65536)),
        }
    else:
        document["resources"] = {"cpu_mhz": draw(st.integers(1, 64000))}
    gpu_class = draw(st.sampled_from(sorted(BUILTIN_GPU_CLASSES)))
    if engine == "vllm":
        tp = draw(st.sampled_from([1, 2, 4, 8]))
        document["tensor_parallel"] = tp
        document["gpu"] = {"class": gpu_class, "count": tp}
    else:
        document["driver"] = draw(st.sampled_from(["raw_exec", "docker"]))
        if draw(st.booleans()):
            document["gpu"] = {"class": gpu_class, "count": draw(st.integers(1, 8))}
    return ModelProfile.model_validate(document)


@settings(max_examples=150, deadline=None)
@given(profile=profiles(), replica=st.integers(0, 50), hints=node_ids)
def test_every_valid_profile_renders_a_job_nomad_accepts(profile, replica, hints):
    """Every valid profile renders a job that meets the facts sheet's rules."""
    assert nomad_fact_violations(render(profile, replica, PlacementHints(hints))) == []


@settings(max_examples=100, deadline=None)
@given(profile=profiles(), replica=st.integers(0, 50), hints=node_ids)
def test_rendering_is_deterministic(profile, replica, hints):
    """The same inputs always render the same JSON."""
    first = json.dumps(render(profile, replica, PlacementHints(hints)))
    again = json.dumps(render(profile.model_copy(), replica, PlacementHints(frozenset(hints))))
    assert first == again


@settings(max_examples=100, deadline=None)
@given(profile=profiles(), replica=st.integers(0, 50), hints=node_ids, other=node_ids)
def test_spec_hash_ignores_placement_hints(profile, replica, hints, other):
    """Two renders that differ only in hints carry the same spec hash."""
    first = render(profile, replica, PlacementHints(hints))["Job"]["Meta"]["caravan_spec_hash"]
    second = render(profile, replica, PlacementHints(other))["Job"]["Meta"]["caravan_spec_hash"]
    assert first == second


@settings(max_examples=100, deadline=None)
@given(profile=profiles(), replica=st.integers(0, 50))
def test_derived_names_fit_dns_limits(profile, replica):
    """The job id and service name stay within 63 characters."""
    job = render(profile, replica)["Job"]
    assert len(job["TaskGroups"][0]["Services"][0]["Name"]) <= 63
    assert len(job["ID"]) <= 63
