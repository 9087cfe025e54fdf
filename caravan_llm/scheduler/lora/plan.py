"""Which LoRA adapters each replica of a model holds: a pure plan, weighted by demand.

`plan_adapters(replicas, adapters, demand, max_loras)` answers, for each
ready replica, the set of adapters it should hold. It is pure (no I/O, no
clock) and deterministic; the scheduler's pass (scheduler/lora/apply.py)
loads and unloads the difference through the engine's API.

The rules, in order:

1. Capacity is `max_loras` per replica: no replica is ever asked to hold more.
2. Every adapter is placed once when the capacity allows; when it does not,
   the hottest are placed and the rest are `unplaced` (routers may still load
   one on demand, issue 25's routing).
3. Spare slots go to extra copies by demand, D'Hondt style: the next copy goes
   to the adapter with the most demand per copy it has (ties: more demand,
   then the name), at most one copy per replica. So a hot adapter spreads
   over several replicas, a cold one stays on one, and an adapter never has
   fewer copies than a colder one. Spare slots are all used: a loaded adapter
   costs a slot and nothing else, and more copies give routers more choice.
4. Stability: a copy stays where it is held now whenever the counts allow
   (minimal churn between passes); new copies go to the replica with the most
   free slots (then the lowest id). Planning again on the plan's own output
   changes nothing.

When the adapters outnumber the slots (some can only be loaded on demand),
the scheduler plans with one slot less per replica (`on_demand_slots`, when a
replica has two or more): that slot is the routers'. A router loads an
adapter held nowhere into it, replacing the one it loaded there before, and
the scheduler keeps what a router loaded there (`kept_on_demand`) instead of
unloading it on its next pass. So the plan and the routers never both fill
the same slot, and no replica is asked to hold more than `max_loras`, even
while a pass and a router's load overlap (with one router; several routers
may each load one).

Demand is requests per second per adapter, as routers measure it and write
it to `adapter-demand/<model>/<router>` (summed by `demand_from_records`: the
input of this plan, `AdapterDemand`); an adapter with no figure counts as the
mean of the known ones (1.0 when none is known), so with no demand at all
every adapter weighs the same.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from caravan_llm.common.contract import AdapterDemandRecord

# The weight of an adapter when no adapter has a demand figure.
UNKNOWN_DEMAND = 1.0
# Demand below this counts as this: an idle adapter still holds its one copy.
MIN_DEMAND = 1e-9


@dataclass(frozen=True, slots=True)
class AdapterDemand:
    """How much each adapter of a model is asked for: requests per second, by adapter name.

    An adapter absent from `requests_per_s` has no figure (unknown, not zero).
    Routers publish these figures (`adapter-demand/<model>/<router>`); the
    scheduler sums the fresh ones (`demand_from_records`).
    """

    requests_per_s: Mapping[str, float] = field(default_factory=dict)

    def weights(self, adapters: Collection[str]) -> dict[str, float]:
        """Each adapter's weight: its figure, else the mean of the known figures of `adapters`."""
        known = [
            max(self.requests_per_s[name], MIN_DEMAND)
            for name in adapters
            if name in self.requests_per_s
        ]
        default = sum(known) / len(known) if known else UNKNOWN_DEMAND
        return {
            name: max(self.requests_per_s[name], MIN_DEMAND)
            if name in self.requests_per_s
            else default
            for name in adapters
        }


NO_DEMAND = AdapterDemand()

# A router's demand record older than this is not counted (a router that stopped
# writing: gone, or no longer asked for the model's adapters).
DEMAND_MAX_AGE_S = 60.0
# ... and older than this it is deleted (`forgotten_demand`): a router that went away
# leaves its keys behind, and routers come and go (one key per process and port).
DEMAND_FORGET_AFTER_S = 600.0


def demand_from_records(
    records: Iterable[AdapterDemandRecord], now: float, max_age_s: float = DEMAND_MAX_AGE_S
) -> AdapterDemand:
    """The routers' figures summed, adapter by adapter, over the records still fresh.

    Each router counts the requests it received, so the sum is the fleet's.
    An adapter no fresh record names has no figure (unknown, not zero). With
    no fresh record at all: `NO_DEMAND`.
    """
    total: dict[str, float] = {}
    for record in records:
        if now - record.at > max_age_s:
            continue
        for adapter, rate in record.requests_per_s.items():
            total[adapter] = total.get(adapter, 0.0) + rate
    return AdapterDemand(MappingProxyType(total)) if total else NO_DEMAND


def forgotten_demand(
    records: Mapping[str, Iterable[AdapterDemandRecord]],
    now: float,
    forget_after_s: float = DEMAND_FORGET_AFTER_S,
) -> list[tuple[str, str]]:
    """The (model, router) records to delete: written longer than `forget_after_s` ago.

    A router rewrites its record every few seconds while it runs (even with
    no figures), so one this old belongs to a router that is gone.
    """
    return sorted(
        (model, record.router)
        for model, found in records.items()
        for record in found
        if record.router and now - record.at > forget_after_s
    )


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    """What each replica should hold, and what the capacity left out."""

    # Replica id -> the adapters it should hold (every replica of the input is a key).
    holds: Mapping[str, frozenset[str]]
    # Adapters placed nowhere because the replicas' slots ran out (hottest placed first).
    unplaced: tuple[str, ...] = ()

    def copies(self, adapter: str) -> int:
        """On how many replicas the adapter is placed."""
        return sum(1 for held in self.holds.values() if adapter in held)


def _hotness(weights: Mapping[str, float]) -> list[str]:
    """Adapters hottest first; ties by name, so the order is total and deterministic."""
    return sorted(weights, key=lambda name: (-weights[name], name))


def copy_counts(weights: Mapping[str, float], replicas: int, max_loras: int) -> dict[str, int]:
    """How many replicas each adapter goes on (0 for those the capacity leaves out)."""
    order = _hotness(weights)
    capacity = replicas * max_loras
    counts = dict.fromkeys(order, 0)
    if replicas == 0:
        return counts
    for name in order[:capacity]:
        counts[name] = 1
    spare = capacity - sum(counts.values())
    while spare > 0:
        candidates = [n for n in order if 0 < counts[n] < replicas]
        if not candidates:
            break
        # D'Hondt: the most demand per copy it would then have; ties to the hotter.
        best = max(candidates, key=lambda n: (weights[n] / (counts[n] + 1), weights[n], _neg(n)))
        counts[best] += 1
        spare -= 1
    return counts


def _neg(name: str) -> tuple[int, ...]:
    """A key that orders names in reverse, so `max` prefers the lowest name on a tie."""
    return (*tuple(-ord(char) for char in name), 0)


def plan_adapters(
    replicas: Mapping[str, Collection[str]],
    adapters: Collection[str],
    demand: AdapterDemand,
    max_loras: int,
) -> AdapterPlacement:
    """The adapters each replica should hold.

    `replicas` maps each ready replica's id to what it holds now (names not in
    `adapters` are dropped: removed from the profile, they are unloaded);
    `adapters` are the profile's adapters that may be placed.
    """
    if max_loras < 1:
        raise ValueError(f"max_loras must be at least 1, got {max_loras}")
    weights = demand.weights(sorted(set(adapters)))
    counts = copy_counts(weights, len(replicas), max_loras)
    order = _hotness(weights)
    ids = sorted(replicas)
    holds: dict[str, set[str]] = {replica: set() for replica in ids}

    def free(replica: str) -> int:
        return max_loras - len(holds[replica])

    # 1. Keep copies where they are, hottest first, within each count and slot.
    for name in order:
        for replica in ids:
            placed = sum(1 for r in ids if name in holds[r])
            if placed >= counts[name]:
                break
            if name in replicas[replica] and free(replica) > 0:
                holds[replica].add(name)
    # 2. First copies of what is placed nowhere, then 3. the extra copies.
    for first_only in (True, False):
        for name in order:
            wanted = min(counts[name], 1) if first_only else counts[name]
            while sum(1 for r in ids if name in holds[r]) < wanted:
                _place_one(name, ids, holds, max_loras)
    return AdapterPlacement(
        holds=MappingProxyType({r: frozenset(holds[r]) for r in ids}),
        unplaced=tuple(name for name in order if counts[name] == 0),
    )


def _place_one(name: str, ids: list[str], holds: dict[str, set[str]], max_loras: int) -> None:
    """Put one more copy of `name` on a replica without it (the counts guarantee room).

    The replica with the most free slots (then the lowest id) takes it. When
    every replica with a free slot holds `name` already, an adapter moves from
    a full replica without `name` to one with a free slot, freeing a place:
    the full replica holds max_loras adapters other than `name`, the one with
    room at most max_loras - 2 of them, so one of the full replica's is
    missing there.
    """
    without = [r for r in ids if name not in holds[r]]
    open_ = [r for r in without if len(holds[r]) < max_loras]
    if open_:
        target = max(open_, key=lambda r: (max_loras - len(holds[r]), _neg(r)))
        holds[target].add(name)
        return
    roomy = next(r for r in ids if len(holds[r]) < max_loras)
    full = without[0]
    moved = min(holds[full] - holds[roomy])
    holds[full].remove(moved)
    holds[roomy].add(moved)
    holds[full].add(name)


def on_demand_slots(max_loras: int, adapters: int, replicas: int) -> int:
    """Slots per replica the plan leaves to routers' on-demand loads (module docstring).

    One when the adapters outnumber the replicas' slots (some are placed
    nowhere and routers load them on demand) and a replica has at least two
    slots; else none (the plan fills every slot, as before).
    """
    return 1 if max_loras >= 2 and adapters > replicas * max_loras else 0


def kept_on_demand(
    held: Collection[str],
    planned: Collection[str],
    planned_before: Collection[str],
    slots: int,
    demand: AdapterDemand,
) -> frozenset[str]:
    """What a replica keeps beyond its plan: adapters a router loaded on demand.

    Those held that the plan does not want there now and did not want there
    before either (a copy the plan moved away is unloaded, not kept), at most
    `slots` of them, the most asked for first (ties by name).
    """
    candidates = sorted(set(held) - set(planned) - set(planned_before))
    if slots < 1 or not candidates:
        return frozenset()
    weights = demand.weights(candidates)
    return frozenset(sorted(candidates, key=lambda n: (-weights[n], n))[:slots])


# How much more an adapter placed now weighs when the next plan is made (`sticky`).
STICKINESS = 1.5


def sticky(
    demand: AdapterDemand, placed: Collection[str], factor: float = STICKINESS
) -> AdapterDemand:
    """The demand the next plan weighs: an adapter placed now counts `factor` times its figure.

    The routers' figures are counts over a window, noisy for a cold adapter
    (a few requests a minute); without this, two adapters near the edge of
    what fits would swap places pass after pass, and each move reads an
    adapter from disk and holds an engine while it does. Adapters without a
    figure keep none (they weigh the mean, as before).
    """
    boosted = {
        name: rate * factor if name in placed else rate
        for name, rate in demand.requests_per_s.items()
    }
    return AdapterDemand(MappingProxyType(boosted)) if boosted else demand
