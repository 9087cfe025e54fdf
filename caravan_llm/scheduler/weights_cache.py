"""A profile's `weights:` block: the schema, and its rules against the engine's facts.

A profile's `weights` block names a volume (Nomad's group `volume` block),
the path replicas mount it at (`volume_mount`, read-only), and optionally a
`prefetch`: a Nomad batch job that fills the volume once. The blocks and the
prefetch job rendered from it are `caravan_llm.scheduler.weights`'.
"""

from __future__ import annotations

import posixpath
from enum import StrEnum
from typing import TYPE_CHECKING, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from collections.abc import Mapping

    from caravan_llm.scheduler.engines.base import EngineFacts

_FROZEN = ConfigDict(frozen=True, extra="forbid")
# Paths that are Nomad's own inside every task.
_RESERVED_MOUNT_ROOTS = ("/alloc", "/local", "/secrets", "/tmp")  # noqa: S108 - Nomad's task dirs
CSI_ACCESS_MODES = frozenset(
    {
        "single-node-reader-only",
        "single-node-writer",
        "multi-node-reader-only",
        "multi-node-single-writer",
        "multi-node-multi-writer",
    }
)


class VolumeType(StrEnum):
    HOST = "host"
    CSI = "csi"


class WeightsVolume(BaseModel):
    """The Nomad volume that holds the weights: a client host volume or a CSI volume."""

    model_config = _FROZEN

    type: VolumeType
    # The host volume's name in the clients' `host_volume` blocks, or the CSI volume ID.
    source: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-\[\]]+$")
    # CSI only (Nomad's `access_mode` / `attachment_mode`).
    access_mode: str | None = None
    attachment_mode: Literal["file-system"] | None = None

    @model_validator(mode="after")
    def _modes_fit_the_type(self) -> Self:
        if self.type is VolumeType.HOST:
            if self.access_mode is not None or self.attachment_mode is not None:
                raise ValueError(
                    "weights.volume: access_mode and attachment_mode are for type: csi only"
                )
        elif self.access_mode is not None and self.access_mode not in CSI_ACCESS_MODES:
            raise ValueError(
                f"weights.volume.access_mode: {self.access_mode!r} is not one of "
                f"{', '.join(sorted(CSI_ACCESS_MODES))}"
            )
        return self


class Prefetch(BaseModel):
    """A batch job that fills the volume once before replicas are placed."""

    model_config = _FROZEN

    # The command line (argv). Default: the engine's download (`hf download <model>`
    # into HF_HOME for vLLM and SGLang; llama.cpp has none).
    command: tuple[str, ...] = ()
    driver: Literal["docker", "exec"] = "docker"
    # For docker: the image (default: the engine's image from the cluster config).
    image: str | None = Field(default=None, min_length=1)
    cpu_mhz: int = Field(default=1000, ge=100)
    memory_mb: int = Field(default=2048, ge=64)
    # After this long without success `caravan status` says the prefetch is stuck.
    timeout_s: int = Field(default=3600, ge=60)

    @field_validator("command")
    @classmethod
    def _command_has_no_blank(cls, command: tuple[str, ...]) -> tuple[str, ...]:
        if command and not command[0].strip():
            raise ValueError("weights.prefetch.command: the first item must be the program")
        return command


class WeightsCache(BaseModel):
    """`weights:` in a profile: where the weights live and how they get there."""

    model_config = _FROZEN

    volume: WeightsVolume
    # Where replicas (and the prefetch) see the volume; the engine's cache.
    path: str = Field(min_length=1)
    prefetch: Prefetch | None = None
    # How replicas mount the volume. None: read-only with a prefetch (it
    # filled the cache), read-write without one (the first replica on a cold
    # cache downloads into it). True without a prefetch: the operator fills it.
    read_only: bool | None = None

    @model_validator(mode="after")
    def _prefetched_means_read_only(self) -> Self:
        if self.prefetch is not None and self.read_only is False:
            raise ValueError(
                "weights.read_only: false is for a cache the replicas fill themselves; "
                "with a prefetch, replicas mount the volume read-only"
            )
        mode = self.volume.access_mode or ""
        if mode.endswith("-reader-only") and not self.replicas_read_only:
            # Nomad refuses a read-write claim in a reader-only mode.
            raise ValueError(
                f"weights.volume.access_mode: {mode} volumes are mounted read-only, but "
                "replicas that fill the cache themselves write it; add a prefetch or "
                "set weights.read_only: true"
            )
        return self

    @property
    def replicas_read_only(self) -> bool:
        if self.read_only is not None:
            return self.read_only
        return self.prefetch is not None

    @field_validator("path")
    @classmethod
    def _path_is_a_clean_absolute_folder(cls, path: str) -> str:
        clean = posixpath.normpath(path)
        if not path.startswith("/") or clean != path.rstrip("/") or clean == "/":
            raise ValueError(
                f"weights.path: {path!r} must be an absolute folder path such as /models"
            )
        for root in _RESERVED_MOUNT_ROOTS:
            if clean == root or clean.startswith(f"{root}/"):
                raise ValueError(f"weights.path: {path!r} is inside Nomad's task folder {root}")
        return clean


def check_weights(
    weights: WeightsCache, model: str, env: Mapping[str, str], facts: EngineFacts
) -> None:
    """Rules across `weights`, the rest of the profile and its engine (raises ValueError)."""
    hub_cache_env = facts.weights.hub_cache_env
    if hub_cache_env is None and not model.startswith(f"{weights.path}/"):
        raise ValueError(
            f"weights.path: {facts.shown} loads `model` from the volume, so model "
            f"({model!r}) must be a file under {weights.path}/"
        )
    if (
        weights.prefetch is not None
        and not weights.prefetch.command
        and facts.weights.default_download is None
    ):
        raise ValueError(
            f"weights.prefetch.command: {facts.shown} has no default download; give the "
            "command that writes the weights under weights.path"
        )
    if hub_cache_env is not None and hub_cache_env in env:
        raise ValueError(
            f"env: {hub_cache_env} is set by weights.path (the volume is {facts.shown}'s cache)"
        )
