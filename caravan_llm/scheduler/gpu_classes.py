"""The GPU class catalog: the short names profiles use, and what Nomad sees.

A profile says `gpu: {class: h100}`; Nomad's NVIDIA device plugin fingerprints
the card by its NVML model name (`NVIDIA H100 80GB HBM3`) and its memory in
MiB. A class maps one name to the model names it accepts and the memory each
card has, so that rendering can constrain the device request to exactly those
cards. A cluster config file may add classes or override built-in ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GpuClass(BaseModel):
    """One GPU class: the NVML model names it accepts and the card memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models: tuple[str, ...] = Field(min_length=1)
    memory_mib: int = Field(gt=0)

    @field_validator("models")
    @classmethod
    def _models_have_no_commas(cls, models: tuple[str, ...]) -> tuple[str, ...]:
        # Rendering joins model names with commas for `set_contains_any`.
        for name in models:
            if "," in name or not name.strip():
                raise ValueError(f"GPU model name must be non-empty and contain no comma: {name!r}")
        return models

    @property
    def min_memory_mib(self) -> int:
        """The memory floor used in device constraints.

        Drivers report slightly less than the marketing size (an 80 GB H100
        reports 81559 MiB, some drivers a little less), so the constraint asks
        for 95% of the nominal figure: enough to exclude a smaller card of the
        same family, loose enough not to exclude the card itself.
        """
        return self.memory_mib * 95 // 100


BUILTIN_GPU_CLASSES: Mapping[str, GpuClass] = MappingProxyType(
    {
        "h100": GpuClass(
            models=("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"),
            memory_mib=81559,
        ),
        "h200": GpuClass(models=("NVIDIA H200", "NVIDIA H200 NVL"), memory_mib=143771),
        "a100-80gb": GpuClass(
            models=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
            memory_mib=81920,
        ),
        "a100-40gb": GpuClass(
            models=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
            memory_mib=40960,
        ),
        "l40s": GpuClass(models=("NVIDIA L40S",), memory_mib=46068),
        "l4": GpuClass(models=("NVIDIA L4",), memory_mib=23034),
        "a10g": GpuClass(models=("NVIDIA A10G",), memory_mib=23028),
    }
)


class UnknownGpuClassError(ValueError):
    """A profile names a GPU class the catalog does not have."""

    def __init__(self, name: str, known: Mapping[str, GpuClass]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(f"unknown GPU class {name!r}; known classes: {', '.join(self.known)}")


def merge_gpu_classes(
    overrides: Mapping[str, GpuClass], base: Mapping[str, GpuClass] = BUILTIN_GPU_CLASSES
) -> Mapping[str, GpuClass]:
    """The catalog with a cluster's classes added or replacing built-in ones."""
    merged = dict(base)
    merged.update(overrides)
    return MappingProxyType(merged)


def lookup_gpu_class(name: str, catalog: Mapping[str, GpuClass]) -> GpuClass:
    """The class called `name`, or an error that lists the known ones."""
    try:
        return catalog[name]
    except KeyError:
        raise UnknownGpuClassError(name, catalog) from None
