"""A profile's LoRA adapters (`adapters:`) and limits (`lora:`): the schema and its rules.

```yaml
adapters:
  - {name: sql, source: /models/loras/sql, rank: 8}   # a folder on the node / weights volume
  - {name: chat, source: acme/chat-lora}              # a Hugging Face id
lora: {max_loras: 4, max_lora_rank: 16}
```

An adapter is served as a model of its own: a request whose `model` is the
adapter's name gets the base model with that adapter. Its `source` is an
absolute folder path (with a `weights:` block, under `weights.path`: the
volume the replicas mount) or a Hugging Face id (`org/name`), which the
weights prefetch brings into the cache with the model (scheduler/weights.py)
or, without a prefetch, the engine downloads itself.

`rank` is the adapter's LoRA rank as declared in the profile: caravan never
opens the adapter at validation (the submitting machine does not see the
nodes' files), so a declared rank is checked against `lora.max_lora_rank`
and an undeclared one is checked by the engine when it loads the adapter
(vLLM refuses a load whose rank exceeds its `--max-lora-rank`; the scheduler
reports the refusal in `caravan status`).

The rules that need the engine's facts (whether it takes adapters at all, the
ranks its flag accepts) are `check_adapters`', applied by the profile loaders
with the engine's other rules.
"""

from __future__ import annotations

import posixpath
import re
from typing import TYPE_CHECKING, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from collections.abc import Sequence

    from caravan_llm.scheduler.engines.base import EngineFacts
    from caravan_llm.scheduler.weights_cache import WeightsCache

_FROZEN = ConfigDict(frozen=True, extra="forbid")

# What a request sends as `model`: letters, digits, '.', '_', '-' (no '/' or ':',
# which engines read as a hub id or SGLang's `<base>:<adapter>`).
ADAPTER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$")
# A Hugging Face repository id, `org/name`.
HF_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# vLLM's own defaults (vllm/config/lora.py), except max_loras (vLLM: 1): four
# adapters per replica, so a few adapters fit on one replica without tuning.
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
# More adapters than this in one profile is a mistake, not a fleet.
MAX_ADAPTERS = 1000


class LoraAdapter(BaseModel):
    """One LoRA adapter, served as a model of its own under `name`."""

    model_config = _FROZEN

    name: str = Field(min_length=1, max_length=128)
    # An absolute folder path on the nodes (the weights volume), or a Hugging Face id.
    source: str = Field(min_length=1, max_length=512)
    # The adapter's LoRA rank (`r` in its adapter_config.json), when declared.
    rank: int | None = Field(default=None, ge=1, le=4096)

    @field_validator("name")
    @classmethod
    def _name_is_a_model_name(cls, name: str) -> str:
        if not ADAPTER_NAME_PATTERN.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a valid adapter name: use letters, digits, '.', '_' and '-', "
                "starting and ending with a letter or digit (it is the `model` clients send)"
            )
        return name

    @field_validator("source")
    @classmethod
    def _source_is_a_path_or_a_hub_id(cls, source: str) -> str:
        if source.startswith("/"):
            clean = posixpath.normpath(source)
            if clean != source.rstrip("/") or clean == "/":
                raise ValueError(
                    f"{source!r} must be a clean absolute folder path such as /models/loras/sql"
                )
            return clean
        if not HF_ID_PATTERN.fullmatch(source):
            raise ValueError(
                f"{source!r} is neither an absolute folder path nor a Hugging Face id (org/name)"
            )
        return source

    @property
    def is_path(self) -> bool:
        """Whether `source` is a folder on the nodes (else a Hugging Face id)."""
        return self.source.startswith("/")


class LoraLimits(BaseModel):
    """`lora:` in a profile: how many adapters a replica holds, and their largest rank."""

    model_config = _FROZEN

    # Adapters one replica holds at once (vLLM --max-loras, SGLang
    # --max-loras-per-batch): the placement never asks a replica for more.
    max_loras: int = Field(default=DEFAULT_MAX_LORAS, ge=1, le=256)
    # The largest rank a replica can serve (vLLM --max-lora-rank).
    max_lora_rank: int = Field(default=DEFAULT_MAX_LORA_RANK, ge=1, le=4096)
    # Adapters kept in CPU memory (vLLM --max-cpu-loras, SGLang
    # --max-loaded-loras); None: the engine's default (max_loras).
    max_cpu_loras: int | None = Field(default=None, ge=1, le=4096)

    @model_validator(mode="after")
    def _cpu_holds_the_batch(self) -> Self:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.max_cpu_loras ({self.max_cpu_loras}) must be at least "
                f"lora.max_loras ({self.max_loras})"
            )
        return self


def check_adapter_list(adapters: Sequence[LoraAdapter], served_name: str) -> None:
    """Names unique within the profile and apart from its served name (ValueError)."""
    if len(adapters) > MAX_ADAPTERS:
        raise ValueError(f"adapters: {len(adapters)} adapters is more than {MAX_ADAPTERS}")
    seen: set[str] = set()
    for index, adapter in enumerate(adapters):
        if adapter.name == served_name:
            raise ValueError(
                f"adapters[{index}].name: {adapter.name!r} is the profile's own served name"
            )
        if adapter.name in seen:
            raise ValueError(f"adapters[{index}].name: {adapter.name!r} is declared twice")
        seen.add(adapter.name)


def check_adapters(
    adapters: Sequence[LoraAdapter],
    limits: LoraLimits | None,
    *,
    weights: WeightsCache | None,
    facts: EngineFacts,
) -> None:
    """The rules across `adapters`, `lora`, `weights` and the engine (raises ValueError)."""
    if not adapters and limits is None:
        return
    support = facts.adapters
    if support.loading is None:
        field = "adapters" if adapters else "lora"
        raise ValueError(f"{field}: {support.refusal}")
    resolved = limits or LoraLimits()
    if support.ranks is not None and resolved.max_lora_rank not in support.ranks:
        accepted = ", ".join(str(rank) for rank in sorted(support.ranks))
        raise ValueError(
            f"lora.max_lora_rank: {facts.shown} takes one of {accepted} "
            f"(got {resolved.max_lora_rank})"
        )
    for index, adapter in enumerate(adapters):
        if adapter.rank is not None and adapter.rank > resolved.max_lora_rank:
            raise ValueError(
                f"adapters[{index}].rank: {adapter.rank} is above lora.max_lora_rank "
                f"({resolved.max_lora_rank}); raise the limit or use a smaller adapter"
            )
        if weights is not None and adapter.is_path:
            root = weights.path
            if not adapter.source.startswith(f"{root}/"):
                raise ValueError(
                    f"adapters[{index}].source: {adapter.source!r} is not on the weights "
                    f"volume the replicas mount at {root}/ (weights.path)"
                )
