"""Router settings: environment names, comma-separated keys, validation naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from caravan_llm.router.core.balancer import Policy
from caravan_llm.router.settings import RouterSettings


def test_environment_sets_fields_and_splits_api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """CARAVAN_ROUTER_* variables set the fields; API keys are comma-separated."""
    monkeypatch.setenv("CARAVAN_ROUTER_PORT", "9000")
    monkeypatch.setenv("CARAVAN_ROUTER_POLICY", "round_robin")
    monkeypatch.setenv("CARAVAN_ROUTER_API_KEYS", "k1, k2,,")

    settings = RouterSettings()

    assert (9000, Policy.ROUND_ROBIN) == (settings.port, settings.policy)
    assert ["k1", "k2"] == [key.get_secret_value() for key in settings.api_keys]
    assert "k1" not in repr(settings)


def test_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags passed as arguments win over the environment."""
    monkeypatch.setenv("CARAVAN_ROUTER_PORT", "9000")

    assert 9100 == RouterSettings(port=9100).port


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kv_prefix": "/caravan"}, "kv_prefix"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"scrape_interval_s": 1.0, "scrape_timeout_s": 2.0}, "scrape_timeout_s"),
        ({"policy": "fastest"}, "policy"),
    ],
)
def test_bad_values_are_refused_naming_the_field(overrides: dict[str, object], field: str) -> None:
    """A bad value raises a validation error that names the field."""
    with pytest.raises(ValidationError) as caught:
        RouterSettings(**overrides)  # type: ignore[arg-type]

    assert field in str(caught.value)


def test_settings_build_the_core_policies() -> None:
    """Breaker, balancer and admission knobs reach the core's config objects."""
    settings = RouterSettings(
        breaker_failure_threshold=2, queue_max_per_model=7, cold_start_timeout_s=9.0
    )

    assert 2 == settings.balancer_config().breaker.failure_threshold
    assert (7, 9.0) == (
        settings.admission_policy().max_queue_per_model,
        settings.admission_policy().cold_start_hold_s,
    )


@pytest.mark.parametrize("name", ["vllm_prefill_tokens_per_s", "llamacpp_prefill_tokens_per_s"])
def test_per_engine_prefill_rates_are_retired(name: str) -> None:
    """A rate per named engine is refused at startup, naming the one fallback left."""
    with pytest.raises(ValidationError, match="other_prefill_tokens_per_s"):
        RouterSettings(**{name: 20000.0})
