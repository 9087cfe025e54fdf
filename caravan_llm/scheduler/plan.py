"""plan(desired, observed) -> actions: the scheduler's pure decision core.

Given what the profiles ask for, what Nomad runs and what that means
(`scheduler/assess.py`: ready, outdated, placed, the prefetch gate), decide
what to register, replace, drain and deregister. No I/O, no clock: `now` is
passed in (wall-clock seconds, to compare with Nomad's timestamps). Applying a plan and planning
again from the resulting world yields no actions: steady state makes no writes.

The rules, per model with desired count D and `live` = its replica jobs that
are not draining:

1. Fewer than D live: register new replicas at the lowest free indices. CPU
   replicas are registered one at a time until each sibling has a node, so
   the anti-affinity of the next one knows where the others landed.
2. More than D live: drain the replicas that cost least to lose (outdated
   first, then not ready, then fewest in-flight requests when known, then
   the highest replica index), but never a ready one if that leaves fewer
   than D ready. The highest index is not always the newest replica: new
   replicas take the lowest free index.
3. Exactly D live and some outdated (their spec hash differs from the
   profile's): surge one new replica; rule 2 then drains an outdated one once
   the new one is ready. A model never drops below its ready count during an
   update, and a new profile that never becomes ready leaves the old
   replicas serving.
4. A replica whose only allocation was lost on a dead node and that Nomad has
   not replaced in time is re-registered with fresh placement hints.
5. Draining replicas are deregistered after their drain window.
5a. A model whose `weights.prefetch` has not succeeded for its current
   weights version gets its prefetch job registered (once per version) and
   no new replicas: rules 1, 3 and 4 wait; scaling down still applies.
6. Replicas of a model with no profile are drained only after the profile's
   absence has been confirmed for a while: an empty read is suspect. Its
   prefetch job, if any, is purged after the same confirmation.
7. Exactly D live, all ready and current, and a CPU replica shares its node
   with a sibling (Nomad rescheduled it there after its own node died: a
   replica job keeps the anti-affinity it was registered with) while a ready,
   eligible node in the job's datacenters and pool runs none of the model's
   replicas: surge one new replica, rendered away from every sibling's node;
   rule 2 then drains the crowded one once the new one is ready, as for an
   update, so one node's loss can no longer take two replicas. At most one
   such move per model per `move_backoff_s`: the free node may not fit the
   replica, and a move that lands on a sibling's node again is not retried
   at once.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from caravan_llm.common.contract import DrainRecord, replica_job_id
from caravan_llm.scheduler.assess import Assessment, ModelAssessment, ReplicaAssessment, assess
from caravan_llm.scheduler.nomad_time import NS_PER_S
from caravan_llm.scheduler.render import PlacementHints, RenderError, render
from caravan_llm.scheduler.weights import PrefetchGate, prefetch_job_id
from caravan_llm.scheduler.world import (
    DesiredModel,
    Observation,
    ObservedReplica,
    PlannerMemory,
)

if TYPE_CHECKING:
    from caravan_llm.scheduler.cluster_config import ClusterConfig
    from caravan_llm.scheduler.weights import ObservedPrefetch

DEFAULT_ORPHAN_DRAIN_S = 10.0


@dataclass(frozen=True, slots=True)
class Register:
    """Register a new replica job (or a new version of one).

    `enforce_index` is the JobModifyIndex the plan saw (0: the job did not
    exist); Nomad refuses the write if the job changed since (facts N3).
    """

    job_id: str
    model: str
    replica: int
    body: dict[str, Any] = field(repr=False)
    reason: str
    enforce_index: int


@dataclass(frozen=True, slots=True)
class Replace:
    """Deregister a stuck replica job and register it again with fresh hints.

    The job is purged first, so the registration enforces index 0 (facts N3).
    """

    job_id: str
    model: str
    replica: int
    body: dict[str, Any] = field(repr=False)
    reason: str
    enforce_index: int


@dataclass(frozen=True, slots=True)
class StartDrain:
    """Mark a replica draining: routers stop sending, its in-flight requests finish."""

    job_id: str
    model: str
    drain_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class Deregister:
    """Stop and purge a replica job whose drain window has passed."""

    job_id: str
    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class ClearDrainMarker:
    """Remove the drain marker of a job that no longer exists."""

    job_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class RegisterPrefetch:
    """Register a model's prefetch batch job (absent, or its weights version changed)."""

    job_id: str
    model: str
    body: dict[str, Any] = field(repr=False)
    reason: str
    # The JobModifyIndex the plan saw (0: no such job), as for `Register`.
    enforce_index: int = 0


Action = Register | Replace | StartDrain | Deregister | ClearDrainMarker | RegisterPrefetch


@dataclass(frozen=True, slots=True)
class PlanSettings:
    # How long a lost replica may go without a replacement before caravan
    # re-registers it itself (Nomad replaces lost allocations at once, so
    # this only catches a replica Nomad cannot place any more).
    replace_lost_after_s: float = 60.0
    # How long a model's replicas must be seen without its profile before
    # they are drained.
    orphan_confirm_s: float = 15.0
    # How long a new CPU replica waits for its siblings to be placed.
    sibling_wait_s: float = 15.0
    # Pass again this soon while waiting on something (placement, readiness).
    requeue_s: float = 2.0
    # The least time between two moves of a model's crowded replica (rule 7).
    move_backoff_s: float = 600.0


@dataclass(frozen=True, slots=True)
class ModelReport:
    """What the planner noticed about one model, for status, metrics and logs."""

    model: str
    desired: int
    live: int
    ready: int
    outdated: int
    draining: int
    unplaced: tuple[str, ...] = ()
    # The prefetch job's state in words ("running for 30 s", "failed: ..."); None: no prefetch.
    prefetch: str | None = None
    # The prefetch failed for this weights version: replicas wait until the profile changes.
    prefetch_failed: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...]
    memory: PlannerMemory
    requeue_after_s: float | None
    reports: tuple[ModelReport, ...]
    # Profiles that cannot be rendered (terminal until the profile changes).
    errors: Mapping[str, str]
    # What the plan was decided from; status, metrics and failure records read the same.
    assessment: Assessment


def _needs_replacement(
    replica: ObservedReplica,
    judged: ReplicaAssessment,
    observed: Observation,
    settings: PlanSettings,
    now: float,
) -> str | None:
    """Why this replica must be re-registered by caravan, or None."""
    if judged.node is not None:
        return None
    if replica.job_status == "dead" and not replica.stopped:
        return "job is dead with no running allocation"
    latest = replica.latest_alloc()
    if latest is None:
        # Never placed: Nomad keeps a blocked evaluation and retries when
        # nodes change. Re-registering would only flap.
        return None
    node = observed.nodes.get(latest.node_id)
    lost = latest.client_status == "lost" or (node is not None and not node.ready)
    if not lost:
        return None
    waited = now - latest.modify_time_ns / NS_PER_S
    if waited >= settings.replace_lost_after_s:
        return f"allocation lost on a dead node {waited:.0f}s ago and not replaced by Nomad"
    return None


def _free_indices(used: set[int], count: int) -> list[int]:
    free: list[int] = []
    candidate = 0
    while len(free) < count:
        if candidate not in used:
            free.append(candidate)
        candidate += 1
    return free


def _victim_order(replica: ObservedReplica, outdated: bool, ready: bool) -> tuple[Any, ...]:
    # Cheapest to lose first: outdated (or crowded onto a sibling's node),
    # then not ready, then fewest in-flight requests (unknown counts as
    # busy), then the highest replica index.
    inflight = replica.inflight if replica.inflight is not None else math.inf
    return (not outdated, ready, inflight, -replica.replica)


@dataclass(slots=True)
class _ModelPlanner:
    """Plans one model; a helper object so the rules read top to bottom."""

    desired: DesiredModel
    observed: Observation
    assessed: ModelAssessment
    judged: Mapping[str, ReplicaAssessment]
    config: ClusterConfig
    settings: PlanSettings
    now: float
    # When this model's last crowded replica was moved (rule 7); None: not within the backoff.
    moved_at: float | None = None
    actions: list[Action] = field(default_factory=list)
    waiting: bool = False
    unplaced: list[str] = field(default_factory=list)
    moved: bool = False

    @property
    def profile_name(self) -> str:
        return self.desired.profile.name

    def hints_for(self, siblings: list[ObservedReplica]) -> PlacementHints:
        nodes = {self.judged[r.job_id].node for r in siblings}
        return PlacementHints(sibling_nodes=frozenset(n for n in nodes if n is not None))

    def render(self, replica: int, siblings: list[ObservedReplica]) -> dict[str, Any]:
        return render(self.desired.profile, replica, self.hints_for(siblings), self.config)

    def run(self) -> ModelReport:
        replicas = [r for r in self.observed.of_model(self.profile_name) if not r.stopped]
        live = [r for r in replicas if r.job_id not in self.observed.draining]
        outdated = {r.job_id for r in live if self.judged[r.job_id].outdated}
        crowded = {r.job_id for r in live if self.judged[r.job_id].shares_node_with}
        ready = {r.job_id for r in live if self.judged[r.job_id].ready}
        used = {r.replica for r in self.observed.of_model(self.profile_name)}
        target = self.desired.count

        gate = self._prefetch_gate()
        if gate.ready:
            self._replace_lost(live)
        if len(live) < target:
            if gate.ready:
                self._scale_up(live, used, target - len(live))
        elif len(live) > target:
            self._scale_down(live, outdated | crowded, ready, len(live) - target)
        elif outdated and gate.ready:
            self._surge(live, used, outdated, ready)
        elif crowded and gate.ready and len(ready) == len(live):
            self._separate(live, used, crowded)
        self._note_unplaced(live)
        return ModelReport(
            model=self.profile_name,
            desired=target,
            live=len(live),
            ready=len(ready),
            outdated=len(outdated),
            draining=len(replicas) - len(live),
            unplaced=tuple(self.unplaced),
            prefetch=gate.status,
            prefetch_failed=gate.failed,
        )

    def _prefetch_gate(self) -> PrefetchGate:
        """Register the prefetch job if needed; replicas wait until it has succeeded."""
        gate = self.assessed.prefetch
        if gate.register is not None:
            seen = self.observed.prefetch.get(self.profile_name)
            self.actions.append(
                RegisterPrefetch(
                    job_id=prefetch_job_id(self.profile_name),
                    model=self.profile_name,
                    body=gate.register,
                    reason=gate.status or "prefetch",
                    enforce_index=_prefetch_index(seen),
                )
            )
        if not gate.ready and not gate.failed:
            self.waiting = True
        return gate

    def _replace_lost(self, live: list[ObservedReplica]) -> None:
        for replica in live:
            why = _needs_replacement(
                replica, self.judged[replica.job_id], self.observed, self.settings, self.now
            )
            if why is None:
                continue
            siblings = [r for r in live if r.job_id != replica.job_id]
            self.actions.append(
                Replace(
                    job_id=replica.job_id,
                    model=self.profile_name,
                    replica=replica.replica,
                    body=self.render(replica.replica, siblings),
                    reason=why,
                    enforce_index=0,
                )
            )

    def _enforce_index(self, job_id: str) -> int:
        """The JobModifyIndex this plan read for the job, 0 when it had none (facts N3)."""
        seen = self.observed.replicas.get(job_id)
        return 0 if seen is None else seen.job_modify_index

    def _siblings_settled(self, live: list[ObservedReplica]) -> bool:
        """CPU replicas: every sibling has a node, or has waited too long for one."""
        for replica in live:
            if self.judged[replica.job_id].node is not None:
                continue
            age = self.now - replica.submit_time_ns / NS_PER_S
            if age < self.settings.sibling_wait_s:
                return False
        return True

    def _scale_up(self, live: list[ObservedReplica], used: set[int], missing: int) -> None:
        if not self.desired.profile.uses_gpu:
            # One at a time, so each new CPU replica's anti-affinity knows
            # where its siblings landed (Nomad cannot see across jobs).
            if not self._siblings_settled(live):
                self.waiting = True
                return
            if missing > 1:
                self.waiting = True
            missing = 1
        for index in _free_indices(used, missing):
            self.actions.append(
                Register(
                    job_id=replica_job_id(self.profile_name, index),
                    model=self.profile_name,
                    replica=index,
                    body=self.render(index, live),
                    reason=f"{len(live)} live < {self.desired.count} desired",
                    enforce_index=self._enforce_index(replica_job_id(self.profile_name, index)),
                )
            )
            used.add(index)

    def _scale_down(
        self, live: list[ObservedReplica], outdated: set[str], ready: set[str], excess: int
    ) -> None:
        ordered = sorted(
            live, key=lambda r: _victim_order(r, r.job_id in outdated, r.job_id in ready)
        )
        ready_left = len(ready)
        for replica in ordered[:excess]:
            is_ready_victim = replica.job_id in ready
            if is_ready_victim and ready_left - 1 < self.desired.count:
                # Wait for a surge replica to become ready first.
                self.waiting = True
                break
            if is_ready_victim:
                ready_left -= 1
            why = f"{len(live)} live > {self.desired.count} desired"
            if replica.job_id in outdated:
                shares = self.judged[replica.job_id].shares_node_with
                why = (
                    f"shares its node with {shares}, replaced by a ready replica placed apart"
                    if shares and not self.judged[replica.job_id].outdated
                    else "outdated spec, replaced by a ready replica"
                )
            self.actions.append(
                StartDrain(
                    job_id=replica.job_id,
                    model=self.profile_name,
                    drain_s=float(self.desired.profile.drain_s),
                    reason=why,
                )
            )

    def _surge(
        self,
        live: list[ObservedReplica],
        used: set[int],
        outdated: set[str],
        ready: set[str],
    ) -> None:
        current_not_ready = [r for r in live if r.job_id not in outdated and r.job_id not in ready]
        if current_not_ready:
            self.waiting = True
            return
        [index] = _free_indices(used, 1)
        self.actions.append(
            Register(
                job_id=replica_job_id(self.profile_name, index),
                model=self.profile_name,
                replica=index,
                body=self.render(index, live),
                reason=f"rolling update: {len(outdated)} replica(s) run an outdated spec",
                enforce_index=self._enforce_index(replica_job_id(self.profile_name, index)),
            )
        )
        self.waiting = True

    def _separate(self, live: list[ObservedReplica], used: set[int], crowded: set[str]) -> None:
        """Rule 7: place a new replica apart from every sibling; rule 2 drains a crowded one."""
        if self.moved_at is not None and self.now - self.moved_at < self.settings.move_backoff_s:
            return
        [index] = _free_indices(used, 1)
        body = self.render(index, live)
        free = free_nodes(body, self.observed, {self.judged[r.job_id].node for r in live})
        if not free:
            return
        first = min(crowded, key=lambda job_id: self.judged[job_id].replica)
        judged = self.judged[first]
        self.actions.append(
            Register(
                job_id=replica_job_id(self.profile_name, index),
                model=self.profile_name,
                replica=index,
                body=body,
                reason=(
                    f"{first} shares node {judged.node} with {judged.shares_node_with}: "
                    f"a replica is placed apart ({len(free)} free node(s)), then {first} drains"
                ),
                enforce_index=self._enforce_index(replica_job_id(self.profile_name, index)),
            )
        )
        self.moved = True
        self.waiting = True

    def _note_unplaced(self, live: list[ObservedReplica]) -> None:
        for replica in live:
            if self.judged[replica.job_id].node is None:
                self.unplaced.append(replica.job_id)
                self.waiting = True


def free_nodes(body: Mapping[str, Any], observed: Observation, taken: set[str | None]) -> list[str]:
    """Ready, eligible nodes in the job's datacenters and node pool that run none of `taken`.

    Resources and constraints are Nomad's to judge; this only says whether a
    move has somewhere to go at all.
    """
    job = body["Job"]
    datacenters = job.get("Datacenters") or ["*"]
    pool = job.get("NodePool") or "default"
    return sorted(
        node.id
        for node in observed.nodes.values()
        if node.ready
        and node.eligibility == "eligible"
        and not node.drain
        and node.id not in taken
        and any(fnmatch.fnmatchcase(node.datacenter, dc) for dc in datacenters)
        and pool in {"all", node.node_pool}
    )


def _finish_drains(observed: Observation, now: float) -> list[Action]:
    actions: list[Action] = []
    for job_id, record in sorted(observed.draining.items()):
        replica = observed.replicas.get(job_id)
        if replica is None or replica.stopped:
            actions.append(ClearDrainMarker(job_id=job_id, reason="job is gone"))
        elif now - record.since >= record.drain_s:
            actions.append(
                Deregister(
                    job_id=job_id,
                    model=record.model,
                    reason=f"drained for {now - record.since:.0f}s ({record.reason})",
                )
            )
    return actions


def _orphans(
    desired: Mapping[str, DesiredModel | None],
    observed: Observation,
    memory: PlannerMemory,
    settings: PlanSettings,
    now: float,
) -> tuple[list[Action], dict[str, float], bool]:
    actions: list[Action] = []
    orphaned: dict[str, float] = {}
    waiting = False
    for model in sorted(observed.models() - set(desired)):
        live = [
            r
            for r in observed.of_model(model)
            if not r.stopped and r.job_id not in observed.draining
        ]
        if not live:
            continue
        since = memory.orphaned_since.get(model, now)
        orphaned[model] = since
        if now - since < settings.orphan_confirm_s:
            waiting = True
            continue
        actions.extend(
            StartDrain(
                job_id=r.job_id,
                model=model,
                drain_s=memory.drain_s.get(model, DEFAULT_ORPHAN_DRAIN_S),
                reason="model has no profile (deleted)",
            )
            for r in live
        )
    return actions, orphaned, waiting


def _orphan_prefetches(
    desired: Mapping[str, DesiredModel | None],
    observed: Observation,
    *,
    orphaned: dict[str, float],
    memory: PlannerMemory,
    settings: PlanSettings,
    now: float,
) -> tuple[list[Action], bool]:
    """Purge the prefetch job of a deleted model once its absence is confirmed."""
    actions: list[Action] = []
    waiting = False
    for model in sorted(set(observed.prefetch) - set(desired)):
        since = orphaned.get(model, memory.orphaned_since.get(model, now))
        orphaned[model] = since
        if now - since < settings.orphan_confirm_s:
            waiting = True
            continue
        actions.append(
            Deregister(
                job_id=observed.prefetch[model].job_id,
                model=model,
                reason="model has no profile (deleted): its prefetch job goes too",
            )
        )
    return actions, waiting


def plan(
    desired: Mapping[str, DesiredModel],
    observed: Observation,
    memory: PlannerMemory,
    *,
    config: ClusterConfig,
    settings: PlanSettings,
    now: float,
    leave_alone: frozenset[str] = frozenset(),
    assessment: Assessment | None = None,
) -> Plan:
    """Decide the actions that move `observed` towards `desired`.

    `assessment` is `assess(desired, observed, config, now)`, judged once for
    the whole pass; it is made here when not given. Models in `leave_alone`
    (their profile in KV is invalid) are neither planned nor treated as
    deleted: their replicas keep running as they are.
    """
    if assessment is None:
        assessment = assess(desired, observed, config, now)
    actions: list[Action] = _finish_drains(observed, now)
    reports: list[ModelReport] = []
    errors: dict[str, str] = {}
    waiting = False
    moved = {
        name: at
        for name, at in memory.moved_at.items()
        if name in desired and now - at < settings.move_backoff_s
    }
    for name in sorted(desired):
        assessed = assessment.models[name]
        if assessed.render_error is not None:
            errors[name] = assessed.render_error
            continue
        planner = _ModelPlanner(
            desired[name],
            observed,
            assessed,
            assessment.replicas,
            config,
            settings,
            now,
            moved_at=memory.moved_at.get(name),
        )
        try:
            reports.append(planner.run())
        except RenderError as exc:
            errors[name] = str(exc)
            continue
        actions.extend(planner.actions)
        waiting = waiting or planner.waiting
        if planner.moved:
            moved[name] = now
    protected = {**desired, **dict.fromkeys(leave_alone)}
    orphan_actions, orphaned, orphan_wait = _orphans(protected, observed, memory, settings, now)
    actions.extend(orphan_actions)
    prefetch_actions, prefetch_wait = _orphan_prefetches(
        protected, observed, orphaned=orphaned, memory=memory, settings=settings, now=now
    )
    actions.extend(prefetch_actions)
    orphan_wait = orphan_wait or prefetch_wait
    if observed.draining:
        waiting = True
    drain_s = {
        name: window
        for name, window in memory.drain_s.items()
        if name in orphaned or name in desired
    }
    drain_s.update({name: float(d.profile.drain_s) for name, d in desired.items()})
    new_memory = PlannerMemory(orphaned_since=orphaned, drain_s=drain_s, moved_at=moved)
    return Plan(
        actions=tuple(actions),
        memory=new_memory,
        requeue_after_s=settings.requeue_s if (waiting or orphan_wait or actions) else None,
        reports=tuple(reports),
        errors=errors,
        assessment=assessment,
    )


def drain_record_for(action: StartDrain, now: float) -> DrainRecord:
    """The KV drain marker a StartDrain action writes."""
    return DrainRecord(model=action.model, since=now, drain_s=action.drain_s, reason=action.reason)


def _prefetch_index(seen: ObservedPrefetch | None) -> int:
    """The JobModifyIndex the plan read for the prefetch job, 0 when it had none (facts N3)."""
    return 0 if seen is None else seen.job_modify_index
