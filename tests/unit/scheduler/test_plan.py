"""The scheduler's planner: what it registers, drains, replaces and leaves alone."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st
from profile_builders import make_llamacpp, make_vllm
from world_builders import (
    NOW,
    SimulatedNomad,
    alloc,
    desired,
    nodes,
    replica,
    run_plan,
    world,
)

from caravan_llm.common.contract import DrainRecord
from caravan_llm.scheduler.assess import assess
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.plan import (
    PlanSettings,
    Register,
    Replace,
    StartDrain,
    free_nodes,
)
from caravan_llm.scheduler.status import replica_status
from caravan_llm.scheduler.world import PlannerMemory

GPU = make_vllm(name="gpu", replicas={"min": 0, "max": 8})
CPU = make_llamacpp(name="cpu", replicas={"min": 0, "max": 8})


def kinds(actions) -> list[tuple[str, str]]:
    return [(type(a).__name__, a.job_id) for a in actions]


def test_gpu_replicas_are_registered_together():
    """An empty world with 2 desired GPU replicas registers replicas 0 and 1 at once."""
    result = run_plan(desired((GPU, 2)), world())
    assert kinds(result.actions) == [("Register", "caravan-gpu-0"), ("Register", "caravan-gpu-1")]
    assert result.requeue_after_s is not None


def test_cpu_replicas_are_registered_one_at_a_time():
    """CPU replicas are registered one per pass until each sibling has a node."""
    first = run_plan(desired((CPU, 3)), world())
    assert kinds(first.actions) == [("Register", "caravan-cpu-0")]
    pending = replica(CPU, 0, submitted=NOW - 1)
    assert run_plan(desired((CPU, 3)), world(pending)).actions == ()


def test_new_cpu_replica_avoids_sibling_nodes():
    """The next CPU replica's job carries an anti-affinity for the siblings' nodes."""
    seen = world(replica(CPU, 0, alloc("n1")), replica(CPU, 1, alloc("n2")))
    [action] = run_plan(desired((CPU, 3)), seen).actions
    assert isinstance(action, Register)
    assert action.replica == 2
    assert action.body["Job"]["Affinities"][0]["RTarget"] == "n1,n2"


def test_steady_state_makes_no_writes():
    """With every replica current, placed and passing, the plan is empty and nothing requeues."""
    seen = world(replica(GPU, 0, alloc("n1")), replica(GPU, 1, alloc("n2")))
    result = run_plan(desired((GPU, 2)), seen)
    assert result.actions == ()
    assert result.requeue_after_s is None
    assert result.reports[0].ready == 2


def test_scale_down_drains_the_replica_with_fewest_inflight():
    """Scaling down drains the replica whose engine reports the fewest in-flight requests."""
    seen = world(
        replica(GPU, 0, alloc("n1"), inflight=5),
        replica(GPU, 1, alloc("n2"), inflight=1),
        replica(GPU, 2, alloc("n3"), inflight=3),
    )
    result = run_plan(desired((GPU, 2)), seen)
    assert kinds(result.actions) == [("StartDrain", "caravan-gpu-1")]


def test_scale_down_without_metrics_drains_the_newest():
    """Without engine metrics, scaling down drains the newest (highest index) replica."""
    seen = world(*(replica(GPU, i, alloc(f"n{i + 1}")) for i in range(3)))
    result = run_plan(desired((GPU, 1)), seen)
    assert kinds(result.actions) == [
        ("StartDrain", "caravan-gpu-2"),
        ("StartDrain", "caravan-gpu-1"),
    ]


def test_scale_down_prefers_replicas_that_are_not_ready():
    """A replica that is not ready costs least to lose."""
    seen = world(
        replica(GPU, 0, alloc("n1"), inflight=0),
        replica(GPU, 1, alloc("n2", "pending", healthy=None), passing=None),
    )
    assert kinds(run_plan(desired((GPU, 1)), seen).actions) == [("StartDrain", "caravan-gpu-1")]


def test_draining_replica_is_deregistered_after_its_window():
    """A draining replica is deregistered once its drain window has passed, not before."""
    marker = {"caravan-gpu-1": DrainRecord(model="gpu", since=NOW - 5, drain_s=10, reason="scale")}
    seen = world(replica(GPU, 0, alloc("n1")), replica(GPU, 1, alloc("n2")), draining=marker)
    assert run_plan(desired((GPU, 1)), seen).actions == ()
    later = run_plan(desired((GPU, 1)), seen, now=NOW + 6)
    assert kinds(later.actions) == [("Deregister", "caravan-gpu-1")]
    gone = world(replica(GPU, 0, alloc("n1")), draining=marker)
    assert kinds(run_plan(desired((GPU, 1)), gone).actions) == [
        ("ClearDrainMarker", "caravan-gpu-1")
    ]


def test_rolling_update_surges_before_draining():
    """A changed profile first adds a new replica, and drains an old one only once it is ready."""
    old = [replica(GPU, i, alloc(f"n{i + 1}"), outdated=True) for i in range(2)]
    step1 = run_plan(desired((GPU, 2)), world(*old))
    assert kinds(step1.actions) == [("Register", "caravan-gpu-2")]
    loading = replica(GPU, 2, alloc("n3", "pending", healthy=None), passing=False)
    step2 = run_plan(desired((GPU, 2)), world(*old, loading))
    assert step2.actions == ()
    assert step2.requeue_after_s is not None
    ready = replica(GPU, 2, alloc("n3"))
    step3 = run_plan(desired((GPU, 2)), world(*old, ready))
    assert kinds(step3.actions) == [("StartDrain", "caravan-gpu-1")]


def test_new_spec_that_never_gets_ready_keeps_old_replicas():
    """If the new version never passes, the old replicas keep serving and none is drained."""
    old = replica(GPU, 0, alloc("n1"), outdated=True)
    broken = replica(GPU, 1, alloc("n2"), passing=False)
    assert run_plan(desired((GPU, 1)), world(old, broken)).actions == ()


def test_lost_replica_not_replaced_by_nomad_is_re_registered_with_fresh_hints():
    """A replica lost on a dead node long ago is re-registered, avoiding live siblings."""
    node_map = nodes("n1", "n2", "n3", down=("n1",))
    stuck = replica(CPU, 0, alloc("n1", "lost", at=NOW - 120))
    sibling = replica(CPU, 1, alloc("n2"))
    result = run_plan(desired((CPU, 2)), world(stuck, sibling, node_map=node_map))
    [action] = result.actions
    assert isinstance(action, Replace)
    assert action.job_id == "caravan-cpu-0"
    assert action.body["Job"]["Affinities"][0]["RTarget"] == "n2"


def test_recently_lost_replica_is_left_to_nomad():
    """Nomad replaces lost allocations itself; caravan waits before stepping in."""
    node_map = nodes("n1", "n2", down=("n1",))
    stuck = replica(CPU, 0, alloc("n1", "lost", at=NOW - 5))
    assert run_plan(desired((CPU, 1)), world(stuck, node_map=node_map)).actions == ()


def test_unplaceable_replica_is_reported_not_flapped():
    """A replica Nomad could not place is reported as unplaced and left alone."""
    blocked = replica(GPU, 0, passing=None)
    result = run_plan(desired((GPU, 1)), world(blocked))
    assert result.actions == ()
    assert result.reports[0].unplaced == ("caravan-gpu-0",)


def test_model_without_profile_is_drained_only_after_confirmation():
    """Replicas of a model with no profile are drained only once the absence is confirmed."""
    seen = world(replica(GPU, 0, alloc("n1")))
    first = run_plan({}, seen)
    assert first.actions == ()
    assert first.memory.orphaned_since == {"gpu": NOW}
    confirmed = run_plan({}, seen, memory=first.memory, now=NOW + 20)
    assert kinds(confirmed.actions) == [("StartDrain", "caravan-gpu-0")]


def test_orphan_confirmation_resets_when_the_profile_returns():
    """A profile that reappears clears the orphan memory."""
    seen = world(replica(GPU, 0, alloc("n1")))
    first = run_plan({}, seen)
    back = run_plan(desired((GPU, 1)), seen, memory=first.memory)
    assert back.memory.orphaned_since == {}


def test_unrenderable_profile_is_an_error_and_touches_nothing():
    """A profile that cannot render (multi-node vLLM) is reported; its replicas are left alone."""
    multi = make_vllm(name="gpu", nodes=2)
    seen = world(replica(GPU, 0, alloc("n1")))
    result = run_plan(desired((multi, 1)), seen)
    assert result.actions == ()
    assert "nodes" in result.errors["gpu"]


@settings(max_examples=60, deadline=None)
@given(
    gpu_counts=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    cpu_counts=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    change=st.booleans(),
)
def test_converges_and_then_plans_nothing(gpu_counts, cpu_counts, change):
    """Applying plans to a simulated Nomad converges to the desired counts, then plans nothing."""
    sim = SimulatedNomad(world(node_map=nodes("n1", "n2", "n3", "n4")))
    memory = PlannerMemory()
    now = NOW
    gpu, cpu = GPU, CPU
    for gpu_count, cpu_count in zip(gpu_counts, cpu_counts, strict=False):
        if change:
            gpu = gpu.model_copy(update={"drain_s": gpu.drain_s + 1})
        want = desired((gpu, gpu_count), (cpu, cpu_count))
        for _ in range(40):
            result = run_plan(want, sim.observation, memory, now=now, settings=PlanSettings())
            memory = result.memory
            sim.apply(result.actions, now)
            now += 5
            if not result.actions and result.requeue_after_s is None:
                break
        final = run_plan(want, sim.observation, memory, now=now)
        assert final.actions == ()
        counts = {r.model: 0 for r in final.reports}
        for rep in sim.observation.replicas.values():
            if rep.job_id not in sim.observation.draining:
                counts[rep.model] = counts.get(rep.model, 0) + 1
        assert counts == {"gpu": gpu_count, "cpu": cpu_count}


def test_cpu_replicas_converge_on_distinct_nodes():
    """Three CPU replicas on three nodes end up on three distinct nodes."""
    sim = SimulatedNomad(world())
    now = NOW
    for _ in range(10):
        result = run_plan(desired((CPU, 3)), sim.observation, now=now)
        sim.apply(result.actions, now)
        now += 1
    placed = [r.allocs[0].node_id for r in sim.observation.replicas.values()]
    assert sorted(placed) == ["n1", "n2", "n3"]


def test_stopped_jobs_do_not_count_as_live():
    """A stopped job is not a live replica, so a new one replaces it."""
    stopped = replace(replica(GPU, 0, alloc("n1")), stopped=True)
    result = run_plan(desired((GPU, 1)), world(stopped))
    assert kinds(result.actions) == [("Register", "caravan-gpu-1")]


def test_deleted_model_drains_for_its_last_known_drain_window():
    """Replicas of a deleted model drain as long as the profile last asked, not a default."""
    patient = make_vllm(name="gpu", replicas={"min": 0, "max": 8}, drain_s=45)
    seen = world(replica(patient, 0, alloc("n1")))
    known = run_plan(desired((patient, 1)), seen)
    assert known.memory.drain_s == {"gpu": 45.0}
    first = run_plan({}, seen, memory=known.memory)
    confirmed = run_plan({}, seen, memory=first.memory, now=NOW + 20)
    [drain] = confirmed.actions
    assert isinstance(drain, StartDrain)
    assert drain.drain_s == 45.0


def crowded_world(*extra, node_map=None):
    """CPU replicas 0 and 1 on n1 (Nomad rescheduled 1 there), n2 and n3 free."""
    return world(
        replica(CPU, 0, alloc("n1")), replica(CPU, 1, alloc("n1")), *extra, node_map=node_map
    )


def test_crowded_cpu_replica_is_moved_apart_before_it_drains():
    """Two CPU replicas on one node: a third is placed away from both, then the crowded
    one drains once the new one is ready; after that, nothing."""
    step1 = run_plan(desired((CPU, 2)), crowded_world())
    [action] = step1.actions
    assert isinstance(action, Register)
    assert action.job_id == "caravan-cpu-2"
    assert action.body["Job"]["Affinities"][0]["RTarget"] == "n1"
    assert "caravan-cpu-1 shares node n1 with caravan-cpu-0" in action.reason
    assert {"cpu": NOW} == dict(step1.memory.moved_at)
    assert step1.requeue_after_s is not None

    loading = replica(CPU, 2, alloc("n2", "pending", healthy=None), passing=False)
    step2 = run_plan(desired((CPU, 2)), crowded_world(loading), step1.memory, now=NOW + 2)
    assert step2.actions == ()
    assert step2.requeue_after_s is not None

    ready = replica(CPU, 2, alloc("n2"))
    step3 = run_plan(desired((CPU, 2)), crowded_world(ready), step2.memory, now=NOW + 4)
    [drain] = step3.actions
    assert isinstance(drain, StartDrain)
    assert drain.job_id == "caravan-cpu-1"
    assert "shares its node with caravan-cpu-0" in drain.reason

    apart = world(replica(CPU, 0, alloc("n1")), ready)
    step4 = run_plan(desired((CPU, 2)), apart, step3.memory, now=NOW + 6)
    assert step4.actions == ()
    assert step4.requeue_after_s is None


def test_crowded_replica_stays_when_no_node_is_free():
    """Every ready, eligible node already runs a replica of the model: no move."""
    both_used = crowded_world(replica(CPU, 2, alloc("n2")), node_map=nodes("n1", "n2", "n3"))
    assert run_plan(desired((CPU, 3)), both_used).actions != ()  # n3 is free: it moves
    node_map = nodes("n1", "n2", "n3", down=("n3",))
    node_map["n4"] = replace(nodes("n4")["n4"], eligibility="ineligible")
    node_map["n5"] = replace(nodes("n5")["n5"], drain=True)
    node_map["n7"] = replace(nodes("n7")["n7"], node_pool="gpu")
    seen = crowded_world(replica(CPU, 2, alloc("n2")), node_map=node_map)
    result = run_plan(desired((CPU, 3)), seen)
    assert result.actions == ()
    assert result.requeue_after_s is None


def test_a_move_is_not_retried_within_the_backoff():
    """A move that landed on a sibling's node again is not retried at once."""
    memory = PlannerMemory(moved_at={"cpu": NOW - 10})
    held = run_plan(desired((CPU, 2)), crowded_world(), memory)
    assert held.actions == ()
    assert {"cpu": NOW - 10} == dict(held.memory.moved_at)
    later = NOW - 10 + PlanSettings().move_backoff_s
    retried = run_plan(desired((CPU, 2)), crowded_world(), held.memory, now=later)
    assert kinds(retried.actions) == [("Register", "caravan-cpu-2")]
    assert {"cpu": later} == dict(retried.memory.moved_at)


def test_no_move_while_a_replica_is_not_ready_or_outdated():
    """A move waits for the model to be whole and current: an update comes first."""
    starting = world(
        replica(CPU, 0, alloc("n1")),
        replica(CPU, 1, alloc("n1", "pending", healthy=None), passing=False),
    )
    assert run_plan(desired((CPU, 2)), starting).actions == ()
    outdated = world(replica(CPU, 0, alloc("n1")), replica(CPU, 1, alloc("n1"), outdated=True))
    [surge] = run_plan(desired((CPU, 2)), outdated).actions
    assert isinstance(surge, Register)
    assert "rolling update" in surge.reason


def test_gpu_replicas_sharing_a_node_stay_packed():
    """GPU replicas bin-pack on purpose: two on one node is not crowding."""
    seen = world(replica(GPU, 0, alloc("n1")), replica(GPU, 1, alloc("n1")))
    assert run_plan(desired((GPU, 2)), seen).actions == ()


def test_scale_down_drains_a_crowded_replica_first():
    """Fewer replicas wanted: the one sharing a sibling's node goes, not the newest."""
    seen = crowded_world(replica(CPU, 2, alloc("n2")))
    assert kinds(run_plan(desired((CPU, 2)), seen).actions) == [("StartDrain", "caravan-cpu-1")]


def test_crowded_replicas_end_on_distinct_nodes():
    """Applied to a simulated Nomad, three replicas crowded on one node end on three nodes."""
    sim = SimulatedNomad(
        world(*(replica(CPU, i, alloc("n1")) for i in range(3)), node_map=nodes("n1", "n2", "n3"))
    )
    memory, now = PlannerMemory(), NOW
    settings = PlanSettings(move_backoff_s=0)
    for _ in range(20):
        result = run_plan(desired((CPU, 3)), sim.observation, memory, now=now, settings=settings)
        memory = result.memory
        sim.apply(result.actions, now)
        now += 60
    live = [
        r
        for r in sim.observation.replicas.values()
        if not r.stopped and r.job_id not in sim.observation.draining
    ]
    assert sorted(r.allocs[-1].node_id for r in live) == ["n1", "n2", "n3"]


def test_free_nodes_follow_the_jobs_datacenters_and_pool():
    """A move only counts nodes the job could run on: its datacenters (globs) and pool."""
    node_map = {
        "a": replace(nodes("a")["a"], datacenter="dc1"),
        "b": replace(nodes("b")["b"], datacenter="dc2", node_pool="cpu"),
        "c": replace(nodes("c")["c"], datacenter="east"),
    }
    seen = world(node_map=node_map)
    body = {"Job": {"Datacenters": ["dc*"], "NodePool": "default"}}
    assert free_nodes(body, seen, set()) == ["a"]
    assert free_nodes({"Job": {"Datacenters": ["dc*"], "NodePool": "all"}}, seen, {"a"}) == ["b"]
    assert free_nodes({"Job": {}}, seen, set()) == ["a", "c"]


def test_status_names_the_sibling_a_crowded_replica_shares_its_node_with():
    """`caravan status` reads the same judgement the planner moves on."""
    seen = crowded_world()
    judged = assess(desired((CPU, 2)), seen, ClusterConfig(), NOW)
    shown = {
        job_id: replica_status(judged.replicas[job_id], observed, seen, NOW).shares_node_with
        for job_id, observed in seen.replicas.items()
    }
    assert {"caravan-cpu-0": None, "caravan-cpu-1": "caravan-cpu-0"} == shown
