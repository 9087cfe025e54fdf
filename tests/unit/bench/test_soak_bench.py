"""The soak bench's own arithmetic: fault timeline, failure causes, periods, trends, verdicts."""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from bench_scripts import load_bench

soak_plan = load_bench("soak_plan")

FAULT_DURATIONS_S = soak_plan.FAULT_DURATIONS_S
FAULT_GAP_S = soak_plan.FAULT_GAP_S
FAULT_KINDS = soak_plan.FAULT_KINDS
PeriodModel = soak_plan.PeriodModel
ProcessSample = soak_plan.ProcessSample
ReadySample = soak_plan.ReadySample
RequestRecord = soak_plan.RequestRecord
account_periods = soak_plan.account_periods
balance_order = soak_plan.balance_order
classify_failure = soak_plan.classify_failure
is_classified = soak_plan.is_classified
judge = soak_plan.judge
judge_processes = soak_plan.judge_processes
message_class = soak_plan.message_class
minute_stats = soak_plan.minute_stats
parse_faults = soak_plan.parse_faults
parse_range = soak_plan.parse_range
percentile = soak_plan.percentile
periods = soak_plan.periods
pick_target = soak_plan.pick_target
plan_faults = soak_plan.plan_faults
trend = soak_plan.trend

HOUR = 3600.0


class TestPlanFaults:
    def test_one_seed_gives_one_timeline(self) -> None:
        """The same seed and settings plan the same faults; another seed plans others."""
        first = plan_faults(7, HOUR, (60, 180))
        assert first == plan_faults(7, HOUR, (60, 180))
        assert first != plan_faults(8, HOUR, (60, 180))

    def test_faults_come_one_interval_apart_and_end_before_the_next(self) -> None:
        """Starts are 60-180 s apart; each fault ends FAULT_GAP_S before the next and the run."""
        faults = plan_faults(3, HOUR, (60, 180))
        starts = [f.at_s for f in faults]
        assert 60 <= starts[0] <= 180
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert all(60 <= gap <= 180 for gap in gaps), gaps
        ends = [f.at_s + f.duration_s for f in faults]
        assert all(
            end <= nxt - FAULT_GAP_S + 1e-6 for end, nxt in zip(ends, starts[1:], strict=False)
        )
        assert ends[-1] <= HOUR - FAULT_GAP_S + 1e-6

    def test_an_hour_at_one_to_three_minutes_holds_at_least_twenty_faults(self) -> None:
        """With the default interval an hour plans 20 or more faults (issue 26's recorded run)."""
        assert all(len(plan_faults(seed, HOUR, (60, 180))) >= 20 for seed in range(20))

    def test_durations_stay_in_each_kinds_range(self) -> None:
        """With room enough, a fault lasts between its kind's shortest and longest duration."""
        for fault in plan_faults(11, 4 * HOUR, (100, 180)):
            shortest, longest = FAULT_DURATIONS_S[fault.kind]
            assert shortest <= fault.duration_s <= longest, fault

    def test_only_the_chosen_kinds_are_planned(self) -> None:
        """A subset of kinds plans only those kinds."""
        kinds = {f.kind for f in plan_faults(5, HOUR, (60, 180), ("netem", "node_kill"))}
        assert kinds <= {"netem", "node_kill"}

    def test_short_intervals_cut_durations_to_fit(self) -> None:
        """Intervals shorter than a duration cut it so it still ends before the next fault."""
        faults = plan_faults(2, 600, (20, 25), ("consul_down",))
        assert faults
        assert all(f.duration_s <= 25 - FAULT_GAP_S for f in faults)

    def test_no_kinds_no_faults(self) -> None:
        """An empty choice of kinds plans nothing."""
        assert () == plan_faults(1, HOUR, (60, 180), ())


class TestParsing:
    def test_range(self) -> None:
        """LOW-HIGH in seconds parses to floats."""
        assert (30.0, 60.5) == parse_range("30-60.5")

    @pytest.mark.parametrize("text", ["60", "0-10", "90-60", "a-b", ""])
    def test_bad_range_names_the_text(self, text: str) -> None:
        """A malformed or empty range is refused with the text in the message."""
        with pytest.raises(ValueError, match="LOW"):
            parse_range(text)

    def test_faults_keep_the_canonical_order(self) -> None:
        """Chosen kinds come back in FAULT_KINDS order; `all` is every kind."""
        assert ("node_kill", "netem") == parse_faults("netem, node_kill")
        assert FAULT_KINDS == parse_faults("all")

    def test_unknown_fault_is_named(self) -> None:
        """An unknown kind is refused, naming it and the choices."""
        with pytest.raises(ValueError, match="meteor"):
            parse_faults("node_kill,meteor")


def test_pick_target_is_stable_over_candidate_order() -> None:
    """The same draw picks the same target whatever order the candidates come in."""
    assert pick_target(["c", "a", "b"], 0.5) == pick_target(["b", "c", "a"], 0.5) == "b"
    assert "c" == pick_target(["a", "b", "c"], 0.999)
    assert pick_target([], 0.3) is None


class TestBalanceOrder:
    def test_round_robin_moves_the_rotation_on_each_turn(self) -> None:
        """Round robin ignores what is outstanding: each turn starts one further along."""
        busy = {"router-a": 300, "router-b": 0}
        assert balance_order(["router-a", "router-b"], busy, 0, "round-robin") == [
            "router-a",
            "router-b",
        ]
        assert balance_order(["router-a", "router-b"], busy, 1, "round-robin") == [
            "router-b",
            "router-a",
        ]

    def test_least_request_sends_to_the_router_with_fewer_outstanding(self) -> None:
        """A router with a backlog (the one that alone carried the load while the other
        restarted) is tried last whatever the turn, and still tried."""
        busy = {"router-a": 2, "router-b": 300}
        for turn in range(4):
            assert balance_order(["router-a", "router-b"], busy, turn, "least-request") == [
                "router-a",
                "router-b",
            ]

    def test_least_request_alternates_between_equals(self) -> None:
        """Equal counts (an unseen router counts 0) keep the rotation's order."""
        names = ["r1", "r2", "r3"]
        firsts = [balance_order(names, {"r2": 1}, turn, "least-request")[0] for turn in range(4)]
        assert firsts == ["r1", "r3", "r3", "r1"]
        assert balance_order(names, {}, 1, "least-request") == ["r2", "r3", "r1"]

    def test_no_router_and_an_unknown_balancer(self) -> None:
        assert balance_order([], {}, 3, "least-request") == []
        with pytest.raises(ValueError, match="'random'"):
            balance_order(["r1"], {}, 0, "random")


class TestCauses:
    def test_openai_error_with_names_and_numbers_normalised(self) -> None:
        """A router error reads as status, code and the message with its names replaced."""
        body = {
            "error": {
                "message": "Timed out waiting for free capacity of model 'tiny-chat' after 30 s",
                "type": "service_unavailable",
                "code": "no_capacity",
            }
        }
        expected = (
            "http 503 no_capacity: Timed out waiting for free capacity of model <name> after <n> s"
        )
        assert expected == classify_failure(status=503, body=body)

    def test_equal_causes_on_different_replicas_read_the_same(self) -> None:
        """Replica ids and numbers do not split one cause into many."""
        one = message_class("Replica 5f0c1a2b-aaaa failed the request: answered HTTP 500")
        two = message_class("Replica 9e8d7c6b-bbbb failed the request: answered HTTP 502")
        assert one == two

    def test_client_side_and_stream_causes(self) -> None:
        """Exceptions, stream error events, missing [DONE] and unfinished answers are named."""
        assert "client ServerDisconnectedError" == classify_failure(
            status=None, exception="ServerDisconnectedError"
        )
        assert "stream error replica_failed: cut" == classify_failure(
            status=200, stream_error={"code": "replica_failed", "message": "cut"}
        )
        assert "stream incomplete (no [DONE])" == classify_failure(status=200, done=False)
        assert "answer without finish_reason" == classify_failure(status=200, unfinished=True)

    def test_a_non_openai_error_body_is_unexplained(self) -> None:
        """A 500 with a body that is no OpenAI error is classified as unparsed, unexplained."""
        cause = classify_failure(status=500, body=None)
        assert "http 500 unparsed error body" == cause
        assert not is_classified(cause)
        assert is_classified("client ClientConnectorError")


def record(
    model: str, start: float, end: float, cause: str | None = None, ttft: float | None = None
):
    return RequestRecord(model, ttft is not None, start, end, ttft, cause)


class TestPeriods:
    def test_each_fault_opens_a_period(self) -> None:
        """Faults cut the run; the first period has no fault, the last ends with the run."""
        cut = periods(300.0, [(200.0, "netem"), (100.0, "node_kill")])
        assert [(0.0, 100.0, None), (100.0, 200.0, "node_kill"), (200.0, 300.0, "netem")] == [
            (p.start_s, p.end_s, p.fault) for p in cut
        ]

    def test_a_request_counts_where_it_ended(self) -> None:
        """A stream started before a fault and cut by it fails in the fault's period."""
        cut = periods(200.0, [(100.0, "node_kill")])
        requests = [
            record("m", 95.0, 101.0, "stream error replica_failed: cut"),
            record("m", 10, 12),
        ]
        ready = [ReadySample(50.0, "m", 2), ReadySample(110.0, "m", 1), ReadySample(150.0, "m", 2)]
        rows = account_periods(cut, ["m"], requests, ready)
        assert [(0, 2, 1, 0), (1, 1, 1, 1)] == [
            (r.period, r.min_ready, r.requests, r.failures) for r in rows
        ]
        assert {"stream error replica_failed: cut": 1} == rows[1].causes

    def test_the_state_entering_a_period_counts(self) -> None:
        """The last sample before a period starts is part of its fewest-ready count."""
        cut = periods(200.0, [(100.0, "alloc_crash")])
        ready = [ReadySample(99.0, "m", 1), ReadySample(120.0, "m", 2)]
        rows = account_periods(cut, ["m"], [], ready)
        assert 1 == rows[1].min_ready

    def test_unknown_samples_are_skipped_and_none_known_is_none(self) -> None:
        """Unreadable samples (Consul down) do not count; a period with none known is None."""
        cut = periods(100.0, [])
        assert (
            2
            == account_periods(cut, ["m"], [], [ReadySample(5, "m", None), ReadySample(6, "m", 2)])[
                0
            ].min_ready
        )
        assert account_periods(cut, ["m"], [], [ReadySample(5, "m", None)])[0].min_ready is None


class TestMinutes:
    def test_percentiles_are_nearest_rank(self) -> None:
        """p50 and p99 of 1..100 are 50 and 99; no values give None."""
        values = [float(v) for v in range(1, 101)]
        assert (50.0, 99.0) == (percentile(values, 50), percentile(values, 99))
        assert percentile([], 50) is None

    def test_per_minute_latency_counts_only_successes(self) -> None:
        """TTFT comes from successful streams, end-to-end from successes; failures are counted."""
        requests = [
            record("m", 0.0, 2.0, ttft=0.5),
            record("m", 1.0, 2.0),
            record("m", 3.0, 50.0, cause="client TimeoutError"),
            record("m", 61.0, 62.0),
        ]
        first, second = minute_stats(requests, ["m"], 120.0)
        assert (3, 1, 0.5, 1.0, 2.0) == (
            first.requests,
            first.failures,
            first.ttft_p50_s,
            first.e2e_p50_s,
            first.e2e_p99_s,
        )
        assert (1, None) == (second.requests, second.ttft_p50_s)


def series(process: str, incarnation: int, start: float, end: float, rss, *, fds=50.0, tasks=20.0):
    samples = []
    at = start
    while at <= end:
        samples.append(ProcessSample(at, process, incarnation, rss(at), fds, tasks))
        at += 10.0
    return samples


class TestProcesses:
    def test_trend_of_a_line(self) -> None:
        """A straight line's levels are its ends; its slope is per hour."""
        line = trend([(0.0, 100.0), (10.0, 110.0), (20.0, 120.0)])
        assert line is not None
        assert (100.0, 120.0, 0.2, 3600.0) == (
            line.first,
            line.last,
            round(line.relative, 6),
            round(line.per_hour, 6),
        )
        assert trend([(0.0, 1.0), (1.0, 2.0)]) is None

    def test_dips_and_peaks_are_not_growth(self) -> None:
        """Descriptors closed for a moment (an outage) and a burst in flight leave it level."""
        values = [19.0] * 100
        values[3] = 13.0
        values[90:96] = [40.0] * 6
        line = trend([(float(i * 5), v) for i, v in enumerate(values)])
        assert line is not None
        assert 0.0 == line.change

    def test_a_raised_floor_is_growth(self) -> None:
        """A series whose floor climbs from 20 to 30 changes by about 10, peaks aside."""
        values = [20.0 + 10.0 * i / 99 + (15.0 if i % 7 == 0 else 0.0) for i in range(100)]
        line = trend([(float(i * 5), v) for i, v in enumerate(values)])
        assert line is not None
        assert 7.5 < line.change < 10.5

    def test_a_growing_process_fails_and_a_level_one_passes(self) -> None:
        """RSS growing 10% over the window fails the 5% limit; a level series passes."""
        samples = [
            *series("router-a", 0, 0, 3600, lambda t: 100e6 * (1 + 0.1 * max(0.0, t - 600) / 3000)),
            *series("router-b", 0, 0, 3600, lambda t: 100e6),
        ]
        verdicts = {v.process: v for v in judge_processes(samples, 600, 3600, 1500)}
        assert (False, True) == (verdicts["router-a"].rss_ok, verdicts["router-b"].rss_ok)
        assert verdicts["router-b"].fds_flat

    def test_objects_growing_under_a_level_rss_fail_the_blocks_line(self) -> None:
        """RSS level (the allocator reuses a burst's slack) while the Python blocks grow 8%:
        the blocks line fails, RSS's passes; a process without the gauge is not judged on it."""
        level = series("router-a", 0, 0, 3600, lambda t: 100e6)
        growing = [
            ProcessSample(
                s.at_s,
                s.process,
                0,
                s.rss_bytes,
                s.fds,
                s.tasks,
                1e6 * (1 + 0.08 * max(0.0, s.at_s - 600) / 3000),
            )
            for s in level
        ]
        (verdict,) = judge_processes(growing, 600, 3600, 1500)
        assert (True, False) == (verdict.rss_ok, verdict.blocks_ok)
        (unknown,) = judge_processes(level, 600, 3600, 1500)
        assert unknown.blocks_ok is None
        names = [v.name for v in judge([], [verdict]) if v.passed is False]
        assert any("Python heap blocks" in name for name in names)

    def test_a_restarted_process_warms_up_from_its_own_start(self) -> None:
        """Incarnation 1, started at 1200 s, is judged from 1800 s; a late one is not judged."""
        samples = [
            *series("scheduler-a", 1, 1200, 3600, lambda t: 50e6),
            *series("scheduler-b", 1, 3300, 3600, lambda t: 50e6),
        ]
        verdicts = {v.process: v for v in judge_processes(samples, 600, 3600, 1500)}
        assert (1800.0, 3600.0) == verdicts["scheduler-a"].window
        assert not verdicts["scheduler-b"].judged
        assert "under the 1500s" in verdicts["scheduler-b"].reason

    def test_climbing_descriptors_are_not_flat(self) -> None:
        """Descriptors climbing by 100 over the window are not flat; tasks level are."""
        samples = series("router-a", 0, 0, 3600, lambda t: 1e8)
        climbing = [
            ProcessSample(s.at_s, s.process, 0, s.rss_bytes, 50 + s.at_s / 30, s.tasks)
            for s in samples
        ]
        (verdict,) = judge_processes(climbing, 600, 3600, 1500)
        assert (False, True) == (verdict.fds_flat, verdict.tasks_flat)

    def test_a_backlog_draining_after_warm_up_is_no_leak(self) -> None:
        """Tasks high when the window opens (a queue after a fault), at their floor later: flat."""
        samples = series("router-a", 0, 0, 3600, lambda t: 1e8)
        draining = [
            ProcessSample(
                s.at_s, s.process, 0, s.rss_bytes, s.fds, 300.0 if s.at_s < 1500 else 30.0
            )
            for s in samples
        ]
        (verdict,) = judge_processes(draining, 600, 3600, 1500)
        assert verdict.tasks is not None
        assert verdict.tasks.change < -200
        assert verdict.tasks_flat


class TestJudge:
    def test_a_failure_with_two_ready_replicas_fails_the_run(self) -> None:
        """One failed request in a period with 2 ready replicas fails the first line."""
        rows = [
            PeriodModel(0, "m", 2, 100, 0),
            PeriodModel(1, "m", 2, 100, 1, {"client TimeoutError": 1}),
            PeriodModel(2, "m", 1, 100, 3, {"http 503 no_capacity: x": 3}),
        ]
        first, second, *_ = judge(rows, [])
        assert (False, True) == (first.passed, second.passed)
        assert "period 1 m (1)" in first.detail

    def test_an_unparsed_failure_below_two_replicas_is_unexplained(self) -> None:
        """Below 2 replicas failures are allowed only with a cause; unparsed ones fail."""
        rows = [PeriodModel(0, "m", 1, 10, 2, {"http 500 unparsed error body": 2})]
        first, second, *_ = judge(rows, [])
        assert (True, False) == (first.passed, second.passed)

    def test_processes_without_a_judged_window_are_not_judged(self) -> None:
        """When no incarnation lived long enough after warm-up, the process lines are unknown."""
        samples = series("router-a", 0, 0, 100, lambda t: 1e8)
        verdicts = judge([], judge_processes(samples, 600, 100, 60))
        assert [None, None, None, None] == [v.passed for v in verdicts[2:]]


def soak_script() -> Any:
    return load_bench("soak")


def test_disk_full_never_fills_a_file_system_bigger_than_a_node_tmpfs(tmp_path: Path) -> None:
    # tmp_path is on the machine's own disk (as a node folder is once its tmpfs is
    # unmounted): the fault refuses it, and leaves no file behind.
    soak = soak_script()
    with pytest.raises(RuntimeError, match="not on a node tmpfs"):
        soak.fill(tmp_path, limit_bytes=1024 * 1024)
    assert list(tmp_path.iterdir()) == []


def test_a_disk_full_that_fails_leaves_no_filler_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill that fails is reported as not injected, and no undo would free its file: it
    removes the file itself."""
    soak = soak_script()

    def broken(_fd: int, _offset: int, _length: int) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(soak.os, "posix_fallocate", broken)
    with pytest.raises(RuntimeError, match="boom"):
        soak.fill(tmp_path, limit_bytes=2**62)
    assert list(tmp_path.iterdir()) == []


class _QueueingRouter:
    """A router stand-in: of each model's burst of `burst` requests, the first `room` wait
    until the whole burst has arrived, the rest are refused `429 queue_full`; /metrics
    shows the waiting ones as the queue depth."""

    def __init__(self, room: int, burst: int) -> None:
        self.room, self.burst = room, burst
        self.waiting: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.arrived: dict[str, asyncio.Event] = {}

    async def chat(self, request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        arrived = self.arrived.setdefault(model, asyncio.Event())
        self.seen[model] = self.seen.get(model, 0) + 1
        if self.seen[model] == self.burst:
            arrived.set()
        if self.waiting.get(model, 0) >= self.room:
            error = {"message": "queue is full", "type": "x", "code": "queue_full"}
            return web.json_response({"error": error}, status=429)
        self.waiting[model] = self.waiting.get(model, 0) + 1
        await arrived.wait()
        self.waiting[model] -= 1
        return web.json_response({"choices": [{"message": {"content": "x"}}]})

    async def metrics(self, _request: web.Request) -> web.Response:
        lines = [f'caravan_router_queue_depth{{model="{m}"}} {n}' for m, n in self.waiting.items()]
        return web.Response(text="\n".join(lines) + "\n")


async def test_saturation_counts_each_models_answers_and_sees_the_queue_fill() -> None:
    """Each model's burst gets `room` answers and the rest 429 queue_full: filled; a router
    that never refuses (its queue never reached the bound) is reported as not filled."""
    soak = soak_script()
    burst = 4 + soak.SATURATION_EXTRA
    fake = _QueueingRouter(room=6, burst=burst)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    app.router.add_get("/metrics", fake.metrics)
    router = SimpleNamespace(name="router-a", pid=os.getpid())
    async with (
        TestServer(app, host="127.0.0.1") as server,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        load = soak.Load([router], {"router-a": server.port}, "key", 4, 0.0, 0.0, session)
        (row,) = await soak.saturate_queues(
            load, ["m1", "m2"], queue_max=4, max_tokens=4, metrics_token="t"
        )
        fake.room, fake.seen, fake.arrived = burst, {}, {}
        (unfilled,) = await soak.saturate_queues(
            load, ["m1"], queue_max=4, max_tokens=4, metrics_token="t"
        )
    assert row.statuses == {
        "m1": {"200": 6, "429 queue_full": burst - 6},
        "m2": {"200": 6, "429 queue_full": burst - 6},
    }
    assert row.filled
    assert row.rss_before_bytes is not None
    assert row.deepest_queue["m1"] <= 6
    assert unfilled.statuses == {"m1": {"200": burst}}
    assert not unfilled.filled
