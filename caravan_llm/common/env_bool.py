"""Booleans in environment variables, read the way HashiCorp's CLIs read them."""

from __future__ import annotations

from caravan_llm.common.errors import SettingsError

_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def parse_env_bool(name: str, value: str) -> bool:
    """Go's strconv.ParseBool, as the Consul and Nomad CLIs read CONSUL_* / NOMAD_* flags."""
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name} must be a boolean (true/false/1/0), got {value!r}")
