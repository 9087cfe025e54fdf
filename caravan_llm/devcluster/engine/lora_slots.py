"""What LoRA adapters cost a simulated vLLM: its CPU cache, its GPU slots, the time to fill them.

Pure state (no clock, no I/O), stepped by the batch core (`batch.py`) and by
the runtime load route (`server.py`). It follows vLLM's LoRA manager
(`vllm/lora/worker_manager.py`, `LRUCacheWorkerLoRAManager`, and
`vllm/lora/model_manager.py`, `LRUCacheLoRAModelManager`), as of 0.32:

- the engine keeps at most `max_cpu_loras` adapters read from disk (its CPU
  cache; `--max-cpu-loras`, which defaults to `--max-loras`, vLLM's
  `LoRAConfig`), least recently used first out;
- at most `max_loras` of them sit in the GPU slots a forward pass reads
  (`activate_adapter`), also least recently used first out;
- before each step the worker makes every adapter of the batch resident
  (`set_active_adapters` -> `_apply_adapters` -> `add_adapter`): one not in
  the CPU cache is read from disk first (`_load_adapter`), one not in a slot
  is copied into one. Both happen inside the step, so the whole batch waits;
- the scheduler admits a waiting request only while the step's batch mixes
  at most `max_loras` adapters (the v1 scheduler's `scheduled_loras` check):
  a request whose adapter would be one too many is skipped this step and
  the queue behind it goes on;
- `POST /v1/load_lora_adapter` runs `add_lora` on the engine core between
  two steps (a utility call): the adapter is read and activated while no
  step runs.

The registry of names the API accepts (`lora.LoraRegistry`, vLLM's
`lora_requests`) has no limit of its own: an adapter loaded by the API and
pushed out of the CPU cache is read from disk again when a request uses it.

The costs (`LoraCosts`) are the simulator's, not measured on a GPU here:

- reading an adapter: 0.5 s by default. LoRAX (predibase/lorax issue #433)
  measured 500 ms to over 1 s to read an adapter and move it layer by layer
  onto the GPU; we take the low end;
- copying a read adapter into a slot: 0.002 s by default. A rank-16 adapter
  of a 7B Llama on q/k/v/o is 32 layers x 4 modules x 16 x (4096 + 4096)
  values x 2 bytes = 33.5 MB, 1.3 ms over PCIe 4.0 x16 (about 25 GB/s).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass

# The defaults of `LoraCosts` and of the `--sim-lora-*` knobs (module docstring).
DEFAULT_LOAD_SECONDS = 0.5
DEFAULT_SWAP_SECONDS = 0.002


@dataclass(frozen=True, slots=True)
class LoraCosts:
    """Seconds the simulated engine spends on adapters."""

    # Reading an adapter from disk into the CPU cache (vLLM's `_load_adapter`).
    load_seconds: float = DEFAULT_LOAD_SECONDS
    # Copying a cached adapter into a GPU slot (vLLM's `activate_adapter`).
    swap_seconds: float = DEFAULT_SWAP_SECONDS

    def __post_init__(self) -> None:
        for name in ("load_seconds", "swap_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class SlotStats:
    """What the adapter cache did so far, and the most it ever held."""

    disk_loads: int
    swaps: int
    # The most adapters in the GPU slots at once, and in one step's batch.
    max_active: int
    max_batch_adapters: int
    cpu: tuple[str, ...]
    active: tuple[str, ...]


class AdapterSlots:
    """One engine's CPU cache and GPU slots of LoRA adapters (module docstring)."""

    def __init__(self, *, max_loras: int, max_cpu_loras: int | None, costs: LoraCosts) -> None:
        cpu_capacity = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1 or cpu_capacity < max_loras:
            raise ValueError(
                f"max_cpu_loras ({cpu_capacity}) must be >= max_loras ({max_loras}) >= 1"
            )
        self.max_loras = max_loras
        self.max_cpu_loras = cpu_capacity
        self.costs = costs
        # Least recently used first.
        self._cpu: OrderedDict[str, None] = OrderedDict()
        self._active: OrderedDict[str, None] = OrderedDict()
        self._disk_loads = 0
        self._swaps = 0
        self._max_active = 0
        self._max_batch = 0

    def fits(self, batch: Collection[str], adapter: str | None) -> bool:
        """Whether a request for `adapter` may join a step whose batch uses `batch`."""
        return adapter is None or adapter in batch or len(batch) < self.max_loras

    def add(self, name: str) -> float:
        """The runtime load's work on the engine (`add_lora`): read it if needed and
        activate it; the seconds it takes."""
        return self._resident(name, keep=frozenset({name}))

    def remove(self, name: str) -> None:
        """The runtime unload (`remove_lora`): out of the CPU cache and its slot."""
        self._cpu.pop(name, None)
        self._active.pop(name, None)

    def prepare(self, adapters: Iterable[str]) -> float:
        """Make a step's adapters resident before it runs; the seconds that adds to the step."""
        batch = frozenset(adapters)
        if len(batch) > self.max_loras:
            raise ValueError(
                f"Number of requested LoRAs ({len(batch)}) is greater than the number of "
                f"GPU LoRA slots ({self.max_loras})."
            )
        self._max_batch = max(self._max_batch, len(batch))
        return sum(self._resident(name, keep=batch) for name in sorted(batch))

    def stats(self) -> SlotStats:
        return SlotStats(
            disk_loads=self._disk_loads,
            swaps=self._swaps,
            max_active=self._max_active,
            max_batch_adapters=self._max_batch,
            cpu=tuple(self._cpu),
            active=tuple(self._active),
        )

    def _resident(self, name: str, *, keep: frozenset[str]) -> float:
        seconds = 0.0
        if name in self._cpu:
            self._cpu.move_to_end(name)
        else:
            _make_room(self._cpu, self.max_cpu_loras, keep)
            self._cpu[name] = None
            self._disk_loads += 1
            seconds += self.costs.load_seconds
        if name in self._active:
            self._active.move_to_end(name)
        else:
            _make_room(self._active, self.max_loras, keep)
            self._active[name] = None
            self._swaps += 1
            seconds += self.costs.swap_seconds
        self._max_active = max(self._max_active, len(self._active))
        return seconds


def _make_room(cache: OrderedDict[str, None], capacity: int, keep: frozenset[str]) -> None:
    """Drop least recently used entries, other than `keep`, until one more fits."""
    for name in list(cache):
        if len(cache) < capacity:
            return
        if name not in keep:
            del cache[name]
