"""Where a router's /metrics is, as its Consul Meta says (`RouterMetaKey.METRICS_ADDR`)."""

from __future__ import annotations

import pytest

from caravan_llm.common.contract import RouterMetaKey, router_metrics_addr, router_metrics_base_url
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.app import router_registration


def test_without_the_meta_key_metrics_are_on_the_public_port() -> None:
    assert router_metrics_base_url("10.0.0.5", 8080, {}) == "http://10.0.0.5:8080"
    assert router_metrics_base_url("fd00::5", 8080, {}) == "http://[fd00::5]:8080"


@pytest.mark.parametrize(
    ("host", "port", "url"),
    [("10.0.0.5", 9100, "http://10.0.0.5:9100"), ("fd00::5", 9100, "http://[fd00::5]:9100")],
)
def test_the_published_address_round_trips(host: str, port: int, url: str) -> None:
    meta = {RouterMetaKey.METRICS_ADDR: router_metrics_addr(host, port)}
    assert router_metrics_base_url("10.9.9.9", 8080, meta) == url


@pytest.mark.parametrize(
    "value", ["", "9100", "host", "host:", ":9100", "host:0", "host:70000", "a/b:1", "::1:9100"]
)
def test_a_malformed_address_is_not_scraped(value: str) -> None:
    assert router_metrics_base_url("10.0.0.5", 8080, {RouterMetaKey.METRICS_ADDR: value}) is None


def test_a_router_with_an_admin_listener_publishes_it() -> None:
    settings = RouterSettings(host="10.0.0.5", port=8080, admin_host="0.0.0.0", admin_port=9100)
    registration = router_registration(settings, 8080, 9100)
    assert registration.meta == {RouterMetaKey.METRICS_ADDR: "10.0.0.5:9100"}
    plain = router_registration(settings.model_copy(update={"admin_port": None}), 8080, None)
    assert dict(plain.meta) == {}
