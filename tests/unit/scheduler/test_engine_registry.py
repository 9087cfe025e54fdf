"""Every engine has one adapter, and the profile, policy and render seams all ask it."""

from __future__ import annotations

import pytest
from profile_builders import make_llamacpp, make_vllm

from caravan_llm.common.contract import (
    EngineRoute,
    ServiceMetaKey,
    decode_engine_routes,
    decode_stream_traits,
)
from caravan_llm.scheduler.engines.registry import (
    Engine,
    adapter_for,
    all_adapters,
    engine_key_env_names,
)
from caravan_llm.scheduler.profile_policy import DENIED_ENV, DENIED_FLAGS
from caravan_llm.scheduler.profiles import ENGINE_KEY_ENV_NAMES
from caravan_llm.scheduler.render import render


@pytest.mark.parametrize("engine", list(Engine))
def test_every_engine_has_its_own_adapter(engine: Engine) -> None:
    facts = adapter_for(engine).facts

    assert engine.value == facts.name
    assert facts.managed_flags
    assert facts.denied_flags == DENIED_FLAGS[engine]
    assert set(facts.denied_env) <= set(DENIED_ENV)
    assert facts.api_key_env in ENGINE_KEY_ENV_NAMES


def test_engine_key_variables_are_those_of_the_adapters() -> None:
    assert {a.facts.api_key_env for a in all_adapters()} == set(engine_key_env_names())
    assert len(all_adapters()) == len(Engine)


@pytest.mark.parametrize("profile", [make_vllm(), make_llamacpp()], ids=lambda p: p.engine.value)
def test_rendered_meta_publishes_the_adapters_stream_traits(profile) -> None:
    """The router keys on these traits; the job publishes exactly its adapter's."""
    meta = render(profile, 0)["Job"]["TaskGroups"][0]["Services"][0]["Meta"]

    assert adapter_for(profile.engine).facts.stream_traits == decode_stream_traits(meta)
    assert ServiceMetaKey.PREFILL_ECHO in meta


@pytest.mark.parametrize("profile", [make_vllm(), make_llamacpp()], ids=lambda p: p.engine.value)
def test_rendered_meta_publishes_the_adapters_routes(profile) -> None:
    """The router sends a route only where Meta says it is served: exactly the adapter's."""
    meta = render(profile, 0)["Job"]["TaskGroups"][0]["Services"][0]["Meta"]

    assert adapter_for(profile.engine).facts.routes == decode_engine_routes(meta)


@pytest.mark.parametrize(
    ("engine", "missing"),
    [
        (Engine.VLLM, set()),
        (Engine.LLAMACPP, {EngineRoute.SCORE, EngineRoute.POOLING, EngineRoute.CLASSIFY}),
        (
            Engine.SGLANG,
            {
                EngineRoute.MESSAGES,
                EngineRoute.MESSAGES_COUNT_TOKENS,
                EngineRoute.POOLING,
                EngineRoute.CLASSIFY,
            },
        ),
    ],
)
def test_each_engine_declares_the_routes_its_server_mounts(
    engine: Engine, missing: set[EngineRoute]
) -> None:
    """vLLM serves every route; llama-server has no score, pooling or classify; SGLang no
    Anthropic messages (nor their token count), pooling or classify."""
    assert set(EngineRoute) - missing == set(adapter_for(engine).facts.routes)
