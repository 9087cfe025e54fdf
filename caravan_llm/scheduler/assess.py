"""assess(desired, observation, config, now): what each replica and model is, said once (pure).

An `Observation` is what Nomad and Consul reported; an `Assessment` is what
that means for caravan, and this module is the one place that says it. The
planner (`scheduler/plan.py`), `caravan status` (`scheduler/status.py`), the
metrics and the failure records (`scheduler/publish.py`) all read it, so
they cannot disagree on whether a replica is ready or why it waits.

Per replica job:
- **ready**: a live allocation runs on a ready node and passes its Consul
  check, or, while Consul knows none of the replica's allocations, Nomad's
  deployment calls it healthy;
- **outdated**: its spec hash is not the one its profile renders now (None
  when there is no profile to compare with: a deleted or unrenderable model);
- **node**: the ready node of a live allocation; None means not placed;
- **draining**: it has a drain marker;
- **shares_node_with**: for a CPU model, the live sibling with a lower
  replica index whose ready node this replica's is too (Nomad rescheduled
  one onto the other's node: the anti-affinity a replica job carries is the
  one rendered when it was registered); None otherwise;
- **unplaceable**: why Nomad does not place it, from its evaluations, in
  words (`scheduler/placement_explain.py`); None when it is placed or Nomad
  did not say;
- **failed**: why it failed for good (`scheduler/model_failure.py`);
- **engine_log**: while it is not ready, the last stderr lines of its
  engine's last non-zero exit, when the observation read them
  (`scheduler/engine_logs.py`).

Per model with a profile: its replicas, its prefetch gate (may replicas be
placed, must the prefetch job be registered), and whether it failed for good.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from caravan_llm.common.nomad_api import Evaluation, Node
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_failure import impossible_placement, model_failure, replica_failure
from caravan_llm.scheduler.nomad_time import NS_PER_S
from caravan_llm.scheduler.placement_explain import ReplicaAsk, explain_failed_groups
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.render import RenderError, render, secret_templates, spec_hash
from caravan_llm.scheduler.weights import (
    NO_PREFETCH,
    PrefetchGate,
    prefetch_gate,
    prefetch_job_id,
    render_prefetch,
)
from caravan_llm.scheduler.world import DesiredModel, EngineLogTail, Observation, ObservedReplica

# A replica job younger than this may simply not have been evaluated yet:
# that it has no allocation is not news (neither a log line nor a failure).
UNPLACED_NEWS_AFTER_S = 10.0


@dataclass(frozen=True, slots=True)
class ReplicaAssessment:
    """One replica job, as this pass judges it."""

    job_id: str
    model: str
    replica: int
    ready: bool
    # None: no profile to compare with (a deleted model, or one that does not render).
    outdated: bool | None
    # The ready node of a live allocation; None: not placed.
    node: str | None
    draining: bool
    stopped: bool
    # Why Nomad does not place it, in words; None: placed, or Nomad did not say.
    unplaceable: str | None = None
    # Why it failed for good; None: it has not.
    failed: str | None = None
    # CPU models: the job id of a live sibling with a lower index on the same
    # ready node; None: it has a node to itself among its live siblings, or GPU.
    shares_node_with: str | None = None
    # When it is not ready and its engine exited non-zero: the last stderr
    # lines of that run, or why they could not be read; None: not read.
    engine_log: EngineLogTail | None = None

    @property
    def live(self) -> bool:
        """Counted towards the desired count: neither stopped nor draining."""
        return not self.stopped and not self.draining


@dataclass(frozen=True, slots=True)
class ModelAssessment:
    """A model with a profile, as this pass judges it."""

    model: str
    # Its replica jobs that are not stopped, by replica index.
    replicas: tuple[ReplicaAssessment, ...]
    prefetch: PrefetchGate
    # Why the model failed for good (every replica did, or its prefetch did
    # with no replica ready); None: it has not.
    failure: str | None
    # The profile does not render (terminal until it changes); nothing else is judged.
    render_error: str | None = None

    @property
    def ready(self) -> int:
        return sum(1 for r in self.replicas if r.live and r.ready)


@dataclass(frozen=True, slots=True)
class Assessment:
    # Every observed replica job (deleted models' included), by job id.
    replicas: Mapping[str, ReplicaAssessment]
    # Every model with a profile, by name.
    models: Mapping[str, ModelAssessment]


def placed_node(replica: ObservedReplica, nodes: Mapping[str, Node]) -> str | None:
    """The ready node of one of the replica's live allocations, or None."""
    for alloc in replica.live_allocs():
        node = nodes.get(alloc.node_id)
        if alloc.node_id and node is not None and node.ready:
            return alloc.node_id
    return None


def is_ready(replica: ObservedReplica, nodes: Mapping[str, Node]) -> bool:
    """Running on a ready node and passing its check (or healthy per Nomad if Consul is silent)."""
    for alloc in replica.live_allocs():
        node = nodes.get(alloc.node_id)
        if alloc.client_status != "running" or node is None or not node.ready:
            continue
        if replica.passing is True:
            return True
        if replica.passing is None and alloc.deployment_healthy is True:
            return True
    return False


def replica_ask(profile: ModelProfile, replica: int, config: ClusterConfig) -> ReplicaAsk:
    """What one replica asks Nomad for, in the profile's words (raises RenderError)."""
    job = render(profile, max(replica, 0), config=config)["Job"]
    return ReplicaAsk.from_job(job, profile.gpu.gpu_class if profile.gpu else "")


def unplaceable_reason(
    replica: ObservedReplica, evaluations: Sequence[Evaluation], ask: ReplicaAsk | None
) -> str | None:
    """Why Nomad does not place the replica, from its evaluations; None when it does.

    Never placed: the newest evaluation that explains a failed placement.
    Every allocation stopped or lost (its node died): the newest blocked
    evaluation, which is what Nomad retries when nodes change. `ask` is None
    when there is no profile to say what the replica needs.
    """
    if replica.live_allocs():
        return None
    if not replica.allocs:
        reason = None
        for evaluation in sorted(evaluations, key=lambda e: e.create_index):
            explained = explain_failed_groups(evaluation.failed_tg_allocs, ask or ReplicaAsk())
            if explained:
                reason = explained
        return reason
    blocked = [e for e in evaluations if e.status == "blocked"]
    if not blocked or ask is None:
        return None
    latest = max(blocked, key=lambda e: e.create_index)
    return explain_failed_groups(latest.failed_tg_allocs, ask)


def _failed(
    replica: ObservedReplica,
    observation: Observation,
    *,
    ready: bool,
    ask: ReplicaAsk | None,
    now: float,
) -> str | None:
    if replica.stopped or ready:
        # A ready replica serves, whatever its earlier allocations went through.
        return None
    if replica.allocs:
        return replica_failure(replica, observation.health)
    # No allocation at all: failed for good only when no freed capacity would
    # place it, which needs the profile's ask and a settled evaluation.
    if ask is None or now - replica.submit_time_ns / NS_PER_S < UNPLACED_NEWS_AFTER_S:
        return None
    evaluations = observation.evaluations.get(replica.job_id, ())
    latest = max(evaluations, key=lambda e: e.create_index, default=None)
    if latest is None:
        return None
    return impossible_placement(latest.failed_tg_allocs, ask)


def _replica(
    replica: ObservedReplica,
    observation: Observation,
    *,
    profile: ModelProfile | None,
    want_hash: str | None,
    config: ClusterConfig,
    now: float,
) -> ReplicaAssessment:
    ask: ReplicaAsk | None = None
    if profile is not None and not replica.live_allocs():
        ask = replica_ask(profile, replica.replica, config)
    ready = is_ready(replica, observation.nodes)
    return ReplicaAssessment(
        job_id=replica.job_id,
        model=replica.model,
        replica=replica.replica,
        ready=ready,
        outdated=None if want_hash is None else replica.spec_hash != want_hash,
        node=placed_node(replica, observation.nodes),
        draining=replica.job_id in observation.draining,
        stopped=replica.stopped,
        unplaceable=unplaceable_reason(
            replica, observation.evaluations.get(replica.job_id, ()), ask
        ),
        failed=_failed(replica, observation, ready=ready, ask=ask, now=now),
        engine_log=None if ready else observation.engine_logs.get(replica.job_id),
    )


def _crowding(judged: list[ReplicaAssessment]) -> list[ReplicaAssessment]:
    """Mark each live replica whose node already runs a live sibling with a lower index."""
    first_on: dict[str, str] = {}
    shares: dict[str, str] = {}
    for replica in sorted(judged, key=lambda r: r.replica):
        if replica.live and replica.node is not None:
            first = first_on.setdefault(replica.node, replica.job_id)
            if first != replica.job_id:
                shares[replica.job_id] = first
    return [
        replace(r, shares_node_with=shares[r.job_id]) if r.job_id in shares else r for r in judged
    ]


def _prefetch(
    profile: ModelProfile, observation: Observation, config: ClusterConfig, now: float
) -> PrefetchGate:
    weights = profile.weights
    if weights is None or weights.prefetch is None:
        return NO_PREFETCH
    body = render_prefetch(profile, config, secret_templates(profile))
    return prefetch_gate(
        body, observation.prefetch.get(profile.name), now, weights.prefetch.timeout_s
    )


def _model(
    desired: DesiredModel, observation: Observation, config: ClusterConfig, now: float
) -> tuple[ModelAssessment, list[ReplicaAssessment]]:
    profile = desired.profile
    replicas = [r for r in observation.of_model(profile.name) if not r.stopped]
    try:
        hashes = {r.job_id: spec_hash(profile, r.replica, config) for r in replicas}
        gate = _prefetch(profile, observation, config, now)
        judged = [
            _replica(
                r,
                observation,
                profile=profile,
                want_hash=hashes[r.job_id],
                config=config,
                now=now,
            )
            for r in replicas
        ]
    except RenderError as exc:
        judged = [
            _replica(r, observation, profile=None, want_hash=None, config=config, now=now)
            for r in replicas
        ]
        # Replicas Nomad gave up on have failed whatever their profile now says.
        unrenderable = ModelAssessment(
            model=profile.name,
            replicas=tuple(judged),
            prefetch=NO_PREFETCH,
            failure=model_failure([(r.replica, r.failed) for r in judged]),
            render_error=str(exc),
        )
        return unrenderable, judged
    if not profile.uses_gpu:
        judged = _crowding(judged)
    failure = model_failure([(r.replica, r.failed) for r in judged])
    if failure is None and gate.failed and not any(r.live and r.ready for r in judged):
        # The replicas wait for the prefetch, which will not succeed without a change.
        failure = f"prefetch job {prefetch_job_id(profile.name)} {gate.status}"
    assessed = ModelAssessment(
        model=profile.name, replicas=tuple(judged), prefetch=gate, failure=failure
    )
    return assessed, judged


def assess(
    desired: Mapping[str, DesiredModel],
    observation: Observation,
    config: ClusterConfig,
    now: float,
) -> Assessment:
    """Judge every observed replica and every desired model (pure; `now` in wall-clock seconds)."""
    replicas: dict[str, ReplicaAssessment] = {}
    models: dict[str, ModelAssessment] = {}
    for name in sorted(desired):
        model, judged = _model(desired[name], observation, config, now)
        models[name] = model
        replicas.update((r.job_id, r) for r in judged)
    for job_id, replica in sorted(observation.replicas.items()):
        if job_id not in replicas:
            # A stopped job, or one of a model without a profile here.
            replicas[job_id] = _replica(
                replica, observation, profile=None, want_hash=None, config=config, now=now
            )
    return Assessment(replicas=replicas, models=models)
