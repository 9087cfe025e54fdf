"""The names of the engines and drivers caravan renders: the registry's key types.

Kept apart from the adapters and from `scheduler.profiles` (which re-exports
them) so that a profile can ask the registry for its engine's rules while the
adapters read the profile type: both import this module, neither the other.
"""

from __future__ import annotations

from enum import StrEnum


class Engine(StrEnum):
    """A profile's `engine`; each value has one adapter in `scheduler.engines.registry`."""

    VLLM = "vllm"
    LLAMACPP = "llamacpp"
    SGLANG = "sglang"


class Driver(StrEnum):
    DOCKER = "docker"
    RAW_EXEC = "raw_exec"
