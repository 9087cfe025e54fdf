"""The hardening settings: environment names, defaults, bounds, and that each is documented."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from caravan_llm.router.settings import RouterSettings

REPO = Path(__file__).resolve().parents[3]
HARDENING_FIELDS = (
    "api_keys_file",
    "trust_priority_header",
    "header_read_timeout_s",
    "body_read_timeout_s",
    "keepalive_timeout_s",
    "max_connections",
    "max_header_field_bytes",
    "max_json_depth",
    "admin_host",
    "admin_port",
)


def test_hardening_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """CARAVAN_ROUTER_API_KEYS_FILE, _ADMIN_PORT, ... set their fields."""
    monkeypatch.setenv("CARAVAN_ROUTER_API_KEYS_FILE", "/etc/caravan/keys.yaml")
    monkeypatch.setenv("CARAVAN_ROUTER_ADMIN_PORT", "9091")
    monkeypatch.setenv("CARAVAN_ROUTER_MAX_CONNECTIONS", "100")
    monkeypatch.setenv("CARAVAN_ROUTER_TRUST_PRIORITY_HEADER", "true")

    settings = RouterSettings()

    assert (Path("/etc/caravan/keys.yaml"), 9091, 100, True) == (
        settings.api_keys_file,
        settings.admin_port,
        settings.max_connections,
        settings.trust_priority_header,
    )


def test_hardening_is_on_by_default() -> None:
    """Timeouts and limits are set, the header is not trusted, no admin listener."""
    settings = RouterSettings()
    assert (10.0, 30.0, 30.0, None, 64, False, None) == (
        settings.header_read_timeout_s,
        settings.body_read_timeout_s,
        settings.keepalive_timeout_s,
        settings.max_connections,
        settings.max_json_depth,
        settings.trust_priority_header,
        settings.admin_port,
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"header_read_timeout_s": 0},
        {"max_connections": 0},
        {"max_json_depth": 1000},
        {"max_header_field_bytes": 100},
        {"admin_port": 70000},
    ],
)
def test_out_of_range_hardening_values_are_refused(overrides: dict[str, object]) -> None:
    """Each bound names its field."""
    with pytest.raises(ValidationError) as caught:
        RouterSettings(**overrides)  # type: ignore[arg-type]
    assert next(iter(overrides)) in str(caught.value)


@pytest.mark.parametrize("doc", ["router/README.md", "docs/security.md"])
def test_every_hardening_setting_is_documented(doc: str) -> None:
    """router/README.md and docs/security.md name each hardening variable."""
    text = (REPO / doc).read_text(encoding="utf-8")
    missing = [
        name
        for name in HARDENING_FIELDS
        if name.upper() not in text and f"_{name.upper()}" not in text
    ]
    assert [] == missing
