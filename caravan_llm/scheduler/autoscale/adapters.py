"""LoRA adapters and the autoscaler (pure): a hot adapter spreads before the model scales out.

Requests for an adapter are the base model's requests: routers queue and
count them under the base model's served name, and the engines run them, so
the autoscaler's signals (engine in-flight, router queues, cold-start demand)
already count adapter demand toward the base model.

What an adapter adds is unevenness: an adapter held on few replicas can
saturate those while the model's other replicas have room. Scaling out then
would not help it (a new replica holds no adapter until the plan or a router
loads one there), while spreading it does: the routers' cost model loads it
on a replica with room when its holders queue (router/edge/adapter_loader.py),
and the plan gives it more copies by its demand (scheduler/lora/plan.py). So
`spread_first` holds a scale-up for as long as some adapter with demand has
every holder at or over `target_inflight` while a replica that does not
hold it is under it. Once the adapter is on every replica with room, or the
whole model is busy, the scale-up goes ahead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from caravan_llm.common.contract import ModelAdapters, nomad_service_id
from caravan_llm.scheduler.autoscale.memory import Direction
from caravan_llm.scheduler.autoscale.policy import ScaleDecision
from caravan_llm.scheduler.lora.plan import AdapterDemand


def adapter_to_spread(
    inflight: Mapping[str, float | None],
    holders: Mapping[str, Iterable[str]],
    demand: AdapterDemand,
    target_inflight: float,
) -> str | None:
    """The hottest adapter that saturates all its holders while another replica has room.

    `inflight` maps each ready replica to its running + waiting requests
    (None: unknown, which counts as neither saturated nor with room);
    `holders` maps an adapter to the replicas that hold it.
    """
    room = {r for r, value in inflight.items() if value is not None and value < target_inflight}
    hot = sorted(
        ((rate, name) for name, rate in demand.requests_per_s.items() if rate > 0),
        key=lambda item: (-item[0], item[1]),
    )
    for _, name in hot:
        held = {r for r in holders.get(name, ()) if r in inflight}
        if not held or held & room:
            continue
        saturated = all(
            (value := inflight[r]) is not None and value >= target_inflight for r in held
        )
        if saturated and room - held:
            return name
    return None


def holders_by_adapter(document: ModelAdapters | None, model: str) -> dict[str, set[str]]:
    """Adapter -> the Consul service ids (the scrapes' replica ids) of the replicas holding it."""
    found: dict[str, set[str]] = {}
    for replica in () if document is None else document.replicas:
        for name in replica.loaded:
            found.setdefault(name, set()).add(nomad_service_id(replica.alloc_id, model))
    return found


def spread_first(
    decision: ScaleDecision,
    current: int,
    *,
    inflight: Mapping[str, float | None],
    holders: Mapping[str, Iterable[str]],
    demand: AdapterDemand,
    target_inflight: float | None,
) -> ScaleDecision:
    """The decision, with a scale-up held while a hot adapter can still spread (docstring)."""
    if decision.direction is not Direction.UP or target_inflight is None:
        return decision
    adapter = adapter_to_spread(inflight, holders, demand, target_inflight)
    if adapter is None:
        return decision
    return replace(
        decision,
        direction=Direction.NONE,
        target=current,
        reason=(
            f"{decision.reason}; held: adapter {adapter!r} saturates the replicas holding it "
            "while others have room, so it spreads to them before the model scales out"
        ),
    )
