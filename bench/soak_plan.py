"""The soak's arithmetic, apart from its I/O (bench/soak.py runs it; tests/unit/bench hold it).

- `plan_faults`: the fault timeline from a seed (kind, when, how long, which target);
- `balance_order`: the routers a request tries, in order, as the balancer in front picks;
- `classify_failure`: one failed request -> its cause, a short stable string;
- `periods` / `account_periods`: the run cut at each fault; per period and model
  the fewest ready replicas seen, the requests and the failures by cause;
- `minute_stats`: requests, failures and latency percentiles per minute;
- `trend` / `judge_process`: a process's RSS, descriptors and tasks after warm-up;
- `judge`: the acceptance lines of issue 26, each pass or fail with its reason.

Every function here is pure: the same inputs give the same answer.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FAULT_KINDS = (
    "node_kill",
    "alloc_crash",
    "leader_kill",
    "consul_down",
    "nomad_down",
    "router_restart",
    "engine_freeze",
    "netem",
    "disk_full",
)
# How long each fault lasts (seconds, drawn uniformly), before it is undone:
# the node powered back on (empty), the killed scheduler started again as a
# standby, Consul or Nomad back, the engine thawed, the latency or the filler
# file removed. 0: instant (the system undoes it itself).
FAULT_DURATIONS_S: Mapping[str, tuple[float, float]] = {
    "node_kill": (30.0, 60.0),
    "alloc_crash": (0.0, 0.0),
    "leader_kill": (5.0, 15.0),
    "consul_down": (10.0, 30.0),
    "nomad_down": (10.0, 30.0),
    "router_restart": (0.0, 0.0),
    "engine_freeze": (20.0, 60.0),
    "netem": (20.0, 60.0),
    "disk_full": (20.0, 60.0),
}
# A fault is undone this long before the next one starts, at the latest.
FAULT_GAP_S = 5.0


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One fault of the timeline: its kind, start (s after the load began), length, target draw.

    `pick` (0 <= pick < 1) chooses the target among the candidates present when
    the fault fires (sorted by name), so one seed gives one timeline.
    """

    index: int
    at_s: float
    kind: str
    duration_s: float
    pick: float


def parse_range(text: str) -> tuple[float, float]:
    """'60-180' -> (60.0, 180.0); ValueError naming the text unless it is LOW-HIGH, 0<LOW<=HIGH."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*-\s*(\d+(?:\.\d+)?)\s*", text)
    if match is None:
        raise ValueError(f"expected LOW-HIGH in seconds, such as 60-180, got {text!r}")
    low, high = float(match.group(1)), float(match.group(2))
    if not 0 < low <= high:
        raise ValueError(f"expected 0 < LOW <= HIGH, got {text!r}")
    return low, high


def parse_faults(text: str) -> tuple[str, ...]:
    """'node_kill,netem' -> the kinds, in FAULT_KINDS order; 'all' -> every kind."""
    if text.strip() == "all":
        return FAULT_KINDS
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(FAULT_KINDS))
    if unknown or not names:
        raise ValueError(
            f"unknown fault(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(FAULT_KINDS)} or all"
        )
    return tuple(kind for kind in FAULT_KINDS if kind in names)


def plan_faults(
    seed: int,
    run_s: float,
    interval_s: tuple[float, float],
    kinds: Sequence[str] = FAULT_KINDS,
    *,
    durations_s: Mapping[str, tuple[float, float]] = FAULT_DURATIONS_S,
    gap_s: float = FAULT_GAP_S,
) -> tuple[PlannedFault, ...]:
    """The faults of a run of `run_s` seconds, one every `interval_s` (drawn), from `seed`.

    The first comes one interval after the start. Each lasts its kind's drawn
    duration, cut so that it ends `gap_s` before the next fault and before the
    run's end; the last fault is one that still fits its shortest duration.
    """
    if not kinds:
        return ()
    rng = random.Random(seed)
    low, high = interval_s
    at = rng.uniform(low, high)
    faults: list[PlannedFault] = []
    while True:
        kind = rng.choice(list(kinds))
        shortest, longest = durations_s[kind]
        drawn = rng.uniform(shortest, longest)
        pick = rng.random()
        following = at + rng.uniform(low, high)
        room = min(following, run_s) - at - gap_s
        if room < 0 or (following >= run_s and room < shortest):
            break
        # Intervals shorter than a kind's duration cut it short (never below 0).
        duration = min(drawn, room)
        faults.append(PlannedFault(len(faults), round(at, 3), kind, round(duration, 3), pick))
        at = following
    return tuple(faults)


def pick_target(candidates: Sequence[str], pick: float) -> str | None:
    """The candidate `pick` (0 <= pick < 1) chooses among the sorted candidates; None if none."""
    ordered = sorted(candidates)
    if not ordered:
        return None
    return ordered[min(int(pick * len(ordered)), len(ordered) - 1)]


BALANCERS = ("least-request", "round-robin")


def balance_order(
    names: Sequence[str], outstanding: Mapping[str, int], turn: int, balancer: str
) -> list[str]:
    """The routers one request tries, first to last (the next on a refused connection).

    `round-robin`: the rotation moved on by one each request (`turn`).
    `least-request`: the router with the fewest requests outstanding first, as
    HAProxy's `leastconn` and nginx's `least_conn` pick; equals in the
    rotation's order, so an idle fleet still alternates.
    """
    if not names:
        return []
    if balancer not in BALANCERS:
        raise ValueError(f"balancer must be one of {', '.join(BALANCERS)}, got {balancer!r}")
    first = turn % len(names)
    rotated = [*names[first:], *names[:first]]
    if balancer == "round-robin":
        return rotated
    # sorted() is stable: among equals the rotation's order stands.
    return sorted(rotated, key=lambda name: outstanding.get(name, 0))


# -- failures ----------------------------------------------------------------------------------

_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_HEXISH = re.compile(r"\b[0-9a-f]{8,}(?:-[0-9a-f]{4,})*\b", re.IGNORECASE)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def message_class(message: str) -> str:
    """A message with its names, ids and numbers replaced, so equal causes read the same."""
    text = _QUOTED.sub("<name>", message)
    text = _HEXISH.sub("<id>", text)
    text = _NUMBER.sub("<n>", text)
    text = " ".join(text.split())
    return text[:160]


def error_class(error: Any) -> str:
    """`code: message class` of an OpenAI-shaped error object; 'unparsed' when it is not one."""
    if not isinstance(error, Mapping):
        return "unparsed error body"
    code = error.get("code") or error.get("type") or "no code"
    message = error.get("message")
    text = message_class(message) if isinstance(message, str) else "no message"
    return f"{code}: {text}"


def classify_failure(
    *,
    status: int | None,
    body: Any = None,
    exception: str | None = None,
    stream_error: Any = None,
    done: bool = True,
    unfinished: bool = False,
) -> str:
    """The cause of one failed request, as a short stable string.

    `exception`: the client's exception class when no full answer came;
    `body`: the decoded JSON of a non-200 answer (None if it was not JSON);
    `stream_error`: the `error` object of an SSE error event; `done`: whether a
    stream ended with `[DONE]`; `unfinished`: a 200 answer without a finish_reason.
    """
    if exception is not None:
        return f"client {exception}"
    if status is not None and status != 200:
        error = body.get("error") if isinstance(body, Mapping) else None
        return f"http {status} {error_class(error)}"
    if stream_error is not None:
        return f"stream error {error_class(stream_error)}"
    if not done:
        return "stream incomplete (no [DONE])"
    if unfinished:
        return "answer without finish_reason"
    return "unknown"


def is_classified(cause: str) -> bool:
    """Whether a cause names what happened (an OpenAI-shaped error, a client-side event)."""
    return "unparsed" not in cause and cause != "unknown"


# -- periods -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the load generator saw it (times in s after the load began)."""

    model: str
    stream: bool
    start_s: float
    end_s: float
    ttft_s: float | None
    cause: str | None  # None: it succeeded
    # A failed request's `x-request-id` and the router it last reached, to find it in
    # the routers' request logs (None for a success, to keep the records small).
    request_id: str | None = None
    router: str | None = None

    @property
    def failed(self) -> bool:
        return self.cause is not None


@dataclass(frozen=True, slots=True)
class ReadySample:
    """Ready (passing) replicas of a model at a time; None when it could not be read."""

    at_s: float
    model: str
    ready: int | None


@dataclass(frozen=True, slots=True)
class Period:
    """The run between two faults: [start_s, end_s), opened by `fault` (None: the first)."""

    index: int
    start_s: float
    end_s: float
    fault: str | None


@dataclass(frozen=True, slots=True)
class PeriodModel:
    """One model in one period."""

    period: int
    model: str
    min_ready: int | None
    requests: int
    failures: int
    causes: Mapping[str, int] = field(default_factory=dict)

    @property
    def replicated(self) -> bool:
        """At least 2 replicas ready throughout (as far as the samples show)."""
        return self.min_ready is not None and self.min_ready >= 2


def periods(run_s: float, fault_starts: Sequence[tuple[float, str]]) -> tuple[Period, ...]:
    """The run cut at each fault's start; each fault opens the period after it."""
    bounds = [(0.0, None), *((at, kind) for at, kind in sorted(fault_starts) if 0 < at < run_s)]
    cut: list[Period] = []
    for index, (start, kind) in enumerate(bounds):
        end = bounds[index + 1][0] if index + 1 < len(bounds) else run_s
        cut.append(Period(index, start, end, kind))
    return tuple(cut)


def min_ready_in(samples: Sequence[ReadySample], start_s: float, end_s: float) -> int | None:
    """The fewest ready replicas known in [start_s, end_s), counting the last sample before it."""
    known = [s for s in samples if s.ready is not None]
    before = [s for s in known if s.at_s < start_s]
    inside = [s for s in known if start_s <= s.at_s < end_s]
    if before:
        inside.append(max(before, key=lambda s: s.at_s))
    values = [s.ready for s in inside if s.ready is not None]
    return min(values) if values else None


def period_of(cut: Sequence[Period], at_s: float) -> int:
    """The index of the period holding `at_s` (the last one for times at or past its end)."""
    for period in cut:
        if period.start_s <= at_s < period.end_s:
            return period.index
    return cut[-1].index if at_s >= cut[-1].end_s else cut[0].index


def account_periods(
    cut: Sequence[Period],
    models: Sequence[str],
    requests: Iterable[RequestRecord],
    ready: Sequence[ReadySample],
) -> tuple[PeriodModel, ...]:
    """Per period and model: fewest ready replicas, requests and failures (by when each ended).

    A request belongs to the period in which it ended: a stream cut by a fault
    fails after the fault, even if it started before.
    """
    counts: dict[tuple[int, str], int] = Counter()
    causes: dict[tuple[int, str], Counter[str]] = {}
    for record in requests:
        key = (period_of(cut, record.end_s), record.model)
        counts[key] += 1
        if record.cause is not None:
            causes.setdefault(key, Counter())[record.cause] += 1
    rows = []
    for period in cut:
        for model in models:
            samples = [s for s in ready if s.model == model]
            found = causes.get((period.index, model), Counter())
            rows.append(
                PeriodModel(
                    period=period.index,
                    model=model,
                    min_ready=min_ready_in(samples, period.start_s, period.end_s),
                    requests=counts[(period.index, model)],
                    failures=sum(found.values()),
                    causes=dict(sorted(found.items())),
                )
            )
    return tuple(rows)


# -- latency over time -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0 < q <= 100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class MinuteStats:
    minute: int
    model: str
    requests: int
    failures: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None


def minute_stats(
    requests: Iterable[RequestRecord], models: Sequence[str], run_s: float
) -> tuple[MinuteStats, ...]:
    """Per minute (by when each request ended) and model: counts, TTFT and end-to-end p50/p99.

    TTFT is of successful streams, end-to-end of every successful request.
    """
    minutes = max(1, math.ceil(run_s / 60))
    grouped: dict[tuple[int, str], list[RequestRecord]] = {}
    for record in requests:
        minute = min(int(record.end_s // 60), minutes - 1)
        grouped.setdefault((minute, record.model), []).append(record)
    rows = []
    for minute in range(minutes):
        for model in models:
            records = grouped.get((minute, model), [])
            good = [r for r in records if not r.failed]
            ttfts = [r.ttft_s for r in good if r.stream and r.ttft_s is not None]
            e2e = [r.end_s - r.start_s for r in good]
            rows.append(
                MinuteStats(
                    minute=minute,
                    model=model,
                    requests=len(records),
                    failures=sum(r.failed for r in records),
                    ttft_p50_s=percentile(ttfts, 50),
                    ttft_p99_s=percentile(ttfts, 99),
                    e2e_p50_s=percentile(e2e, 50),
                    e2e_p99_s=percentile(e2e, 99),
                )
            )
    return tuple(rows)


# -- processes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One reading of one caravan process (one incarnation: a restart starts another)."""

    at_s: float
    process: str
    incarnation: int
    rss_bytes: float | None
    fds: float | None
    tasks: float | None
    # `caravan_process_python_blocks`: objects alive, which allocator slack cannot hide.
    blocks: float | None = None


@dataclass(frozen=True, slots=True)
class Trend:
    """A series over a window: its baseline at the start and at the end, and its slope.

    A baseline is the 10th percentile of the first (or last) fifth of the
    samples: the floor the process returns to, which a leak raises. Requests
    in flight at a sampling instant (each holds a task and descriptors; a
    frozen engine piles them up for a minute) raise only the peaks, and a
    short dip (an outage closing connections) is under a tenth of a fifth
    of an hour's window. The slope is the least-squares line's, per hour.
    """

    start_s: float
    end_s: float
    samples: int
    first: float
    last: float
    per_hour: float

    @property
    def change(self) -> float:
        return self.last - self.first

    @property
    def relative(self) -> float | None:
        return self.change / self.first if self.first > 0 else None


BASELINE_PERCENTILE = 10


def trend(points: Sequence[tuple[float, float]]) -> Trend | None:
    """The levels and slope of (time, value) points; None for fewer than 3 or one instant."""
    if len(points) < 3:
        return None
    ordered = sorted(points)
    xs = [p[0] for p in ordered]
    ys = [p[1] for p in ordered]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    fifth = max(1, len(ys) // 5)
    first = percentile(ys[:fifth], BASELINE_PERCENTILE)
    last = percentile(ys[-fifth:], BASELINE_PERCENTILE)
    assert first is not None
    assert last is not None
    return Trend(xs[0], xs[-1], len(ys), first, last, slope * 3600)


# RSS may grow by less than this over the judged window (issue 26's acceptance).
RSS_GROWTH_LIMIT = 0.05
# The interpreter's allocated blocks (its objects) likewise: RSS stays at a burst's
# high water (memory the allocator keeps is reused before it grows), so a leak smaller
# than that slack shows here first.
BLOCKS_GROWTH_LIMIT = 0.05
# Descriptors and tasks are "flat" when their level rises by at most this
# much across the window: the larger of an absolute and a relative allowance
# (both move with the requests in flight at a sampling instant). A fall is no
# leak: a window that opens on a backlog (requests queued after a fault) starts
# high and ends at the floor.
FLAT_ABSOLUTE = 5.0
FLAT_RELATIVE = 0.10


@dataclass(frozen=True, slots=True)
class ProcessVerdict:
    """One incarnation of a process over its judged window (None where not judged)."""

    process: str
    incarnation: int
    window: tuple[float, float] | None
    rss: Trend | None
    fds: Trend | None
    tasks: Trend | None
    reason: str  # why not judged, or ""
    blocks: Trend | None = None

    @property
    def judged(self) -> bool:
        return self.window is not None

    @property
    def rss_ok(self) -> bool | None:
        return grew_less(self.rss, RSS_GROWTH_LIMIT)

    @property
    def blocks_ok(self) -> bool | None:
        return grew_less(self.blocks, BLOCKS_GROWTH_LIMIT)

    @property
    def fds_flat(self) -> bool | None:
        return flat(self.fds)

    @property
    def tasks_flat(self) -> bool | None:
        return flat(self.tasks)


def grew_less(line: Trend | None, limit: float) -> bool | None:
    """Whether the line's level grew by less than `limit` (a share); None when unknown."""
    if line is None or line.relative is None:
        return None
    return line.relative < limit


def flat(line: Trend | None) -> bool | None:
    if line is None:
        return None
    return line.change <= max(FLAT_ABSOLUTE, FLAT_RELATIVE * abs(line.first))


def judge_processes(
    samples: Sequence[ProcessSample], warmup_s: float, run_s: float, min_window_s: float
) -> tuple[ProcessVerdict, ...]:
    """Each incarnation's trends from the later of the run's and its own warm-up to its end.

    An incarnation whose window is shorter than `min_window_s` is listed, not judged.
    """
    grouped: dict[tuple[str, int], list[ProcessSample]] = {}
    for sample in samples:
        grouped.setdefault((sample.process, sample.incarnation), []).append(sample)
    verdicts = []
    for (process, incarnation), series in sorted(grouped.items()):
        born = min(s.at_s for s in series)
        last = max(s.at_s for s in series)
        # Incarnation 0 started before the load; a restarted one warms up from its start.
        start = warmup_s if incarnation == 0 else max(warmup_s, born + warmup_s)
        end = min(last, run_s)
        window = [s for s in series if start <= s.at_s <= end]
        if end - start < min_window_s or len(window) < 3:
            lived = max(0.0, end - start)
            verdicts.append(
                ProcessVerdict(
                    process,
                    incarnation,
                    None,
                    None,
                    None,
                    None,
                    f"{lived:.0f}s after warm-up, under the {min_window_s:.0f}s judged",
                )
            )
            continue

        def line(values: Iterable[tuple[float, float | None]]) -> Trend | None:
            return trend([(at, value) for at, value in values if value is not None])

        verdicts.append(
            ProcessVerdict(
                process,
                incarnation,
                (start, end),
                line((s.at_s, s.rss_bytes) for s in window),
                line((s.at_s, s.fds) for s in window),
                line((s.at_s, s.tasks) for s in window),
                "",
                line((s.at_s, s.blocks) for s in window),
            )
        )
    return tuple(verdicts)


# -- acceptance --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    name: str
    passed: bool | None  # None: could not be judged
    detail: str


def judge(rows: Sequence[PeriodModel], processes: Sequence[ProcessVerdict]) -> tuple[Verdict, ...]:
    """Issue 26's acceptance lines for one run."""
    replicated = [r for r in rows if r.replicated]
    failing = [r for r in replicated if r.failures]
    verdicts = [
        Verdict(
            "0 failed requests in every period where the model had >= 2 ready replicas",
            not failing,
            f"{len(replicated)} period-models with >= 2 ready, "
            + (
                "none failed"
                if not failing
                else "failures in "
                + ", ".join(f"period {r.period} {r.model} ({r.failures})" for r in failing)
            ),
        )
    ]
    rest = [r for r in rows if not r.replicated and r.failures]
    unexplained = sorted({cause for r in rest for cause in r.causes if not is_classified(cause)})
    verdicts.append(
        Verdict(
            "every failure in the other periods is explained by a cause",
            not unexplained,
            f"{sum(r.failures for r in rest)} failures in {len(rest)} period-models "
            + ("all classified" if not unexplained else f"unexplained: {unexplained}"),
        )
    )
    judged = [p for p in processes if p.judged]
    names = sorted({p.process for p in processes})
    not_judged = sorted(set(names) - {p.process for p in judged})
    suffix = f"; not judged (too short after warm-up): {not_judged}" if not_judged else ""

    def line(name: str, verdict_of: Any, describe: Any) -> Verdict:
        values = [verdict_of(p) for p in judged]
        bad = [p for p, ok in zip(judged, values, strict=True) if ok is False]
        unknown = [p for p, ok in zip(judged, values, strict=True) if ok is None]
        if not judged:
            return Verdict(name, None, "no process lived long enough after warm-up" + suffix)
        detail = ", ".join(describe(p) for p in judged)
        if unknown:
            detail += f"; no data for {[f'{p.process}#{p.incarnation}' for p in unknown]}"
        return Verdict(name, False if bad else (None if unknown else True), detail + suffix)

    verdicts.append(
        line(
            f"RSS of each caravan process grows less than {RSS_GROWTH_LIMIT:.0%} after warm-up",
            lambda p: p.rss_ok,
            lambda p: f"{p.process}#{p.incarnation} {_pct(p.rss)}",
        )
    )
    verdicts.append(
        line(
            f"Python heap blocks of each caravan process grow less than "
            f"{BLOCKS_GROWTH_LIMIT:.0%} after warm-up (added: objects kept alive, which the "
            "allocator's slack hides from RSS)",
            lambda p: p.blocks_ok,
            lambda p: f"{p.process}#{p.incarnation} {_pct(p.blocks)}",
        )
    )
    verdicts.append(
        line(
            "file descriptors flat",
            lambda p: p.fds_flat,
            lambda p: f"{p.process}#{p.incarnation} {_delta(p.fds)}",
        )
    )
    verdicts.append(
        line(
            "asyncio tasks flat",
            lambda p: p.tasks_flat,
            lambda p: f"{p.process}#{p.incarnation} {_delta(p.tasks)}",
        )
    )
    return tuple(verdicts)


def _pct(line: Trend | None) -> str:
    if line is None or line.relative is None:
        return "n/a"
    return f"{line.relative:+.1%}"


def _delta(line: Trend | None) -> str:
    if line is None:
        return "n/a"
    return f"{line.first:.0f} {line.change:+.1f}"
