"""The routing-quality bench's own arithmetic: history metric, cell length, repeats, ratios."""

from __future__ import annotations

import math

import pytest
from bench_scripts import load_bench

routing_quality = load_bench("routing_quality")

Cell = routing_quality.Cell
Fleet = routing_quality.Fleet
TraceRequest = routing_quality.TraceRequest
_prompt_tokens = routing_quality._prompt_tokens
cell_trace = routing_quality.cell_trace
parse_repeats = routing_quality.parse_repeats
print_acceptance = routing_quality.print_acceptance
shareable_history = routing_quality.shareable_history

BLOCK = 16


def turn(*messages: tuple[str, str], number: int = 0) -> TraceRequest:
    return TraceRequest(at=0.0, messages=messages, system=0, conversation=0, turn=number)


def padded_first_turn(multiple_of: int) -> TraceRequest:
    """A first turn whose prompt is exactly a whole number of blocks long."""
    words = 10
    while True:
        first = turn(("system", "rules"), ("user", " ".join(["word"] * words)))
        if len(_prompt_tokens(first)) % multiple_of == 0:
            return first
        words += 1


class TestShareableHistory:
    def test_a_prompt_ending_on_a_block_boundary_cannot_share_its_last_block(self) -> None:
        first = padded_first_turn(BLOCK)
        length = len(_prompt_tokens(first))
        second = turn(*first.messages, ("assistant", "reply words"), ("user", "more"), number=1)
        assert shareable_history(first, second, BLOCK) == length - BLOCK

    def test_otherwise_every_full_block_of_the_previous_prompt_is_shareable(self) -> None:
        first = turn(("system", "rules"), ("user", "a question of some words"))
        length = len(_prompt_tokens(first))
        if length % BLOCK == 0:
            first = turn(("system", "rules"), ("user", "a question of some more words"))
            length = len(_prompt_tokens(first))
        assert length % BLOCK != 0
        second = turn(*first.messages, ("assistant", "reply"), ("user", "next"), number=1)
        assert shareable_history(first, second, BLOCK) == length // BLOCK * BLOCK


def test_a_light_cell_runs_until_it_holds_the_minimum_of_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One request a second, without the (slow) calibration probe.
    monkeypatch.setattr(routing_quality, "load_scale", lambda *_: 1.0)
    fleet = Fleet()
    short, short_s = cell_trace("unique", "light", 1, 5.0, min_requests=0, fleet=fleet)
    long, long_s = cell_trace("unique", "light", 1, 5.0, min_requests=60, fleet=fleet)
    assert short_s == 5.0
    assert len(long) >= 60 > len(short)
    assert long_s > short_s
    # The same arrivals, continued: a longer cell keeps the rate of the shorter one.
    assert [r.at for r in long[: len(short)]] == [r.at for r in short]


def test_repeats_name_known_cells_only() -> None:
    assert parse_repeats("unique/light, mixed/over") == {("unique", "light"), ("mixed", "over")}
    assert parse_repeats("") == set()
    with pytest.raises(ValueError, match="'unique/heavy'"):
        parse_repeats("unique/heavy")


def cell(target: str, p50: float, p99: float, **fields: float) -> Cell:
    made = Cell("shared", "near", target, 0, ttft_ms={"p50": p50, "p90": math.nan, "p99": p99})
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def test_acceptance_ratios_are_against_the_best_of_each_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cells = [
        cell("rr", 400, 1000, prefix_missed=0.2),
        cell("lor", 200, 1200, errors=1),
        cell("caravan-predicted_ttft", 100, 600, prefix_missed=0.05, history_cached=0.93),
        cell("vllm-router-cache_aware", 300, 800),
        cell("vllm-router-power_of_two", 250, 900),
    ]
    print_acceptance(cells, "caravan-predicted_ttft")
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row == (
        "| shared | near | 0 | 0.25 | 0.60 | 0.50 | 0.60 | 0.40 | 0.75 | 0.25 | 0.93 | 1 | 0 |"
    )


def test_the_offline_replay_answers_every_request_at_the_engines_speed() -> None:
    """One prompt on an idle fleet: its TTFT is its prefill in full chunks, exactly."""
    fleet = Fleet()
    words = " ".join(["word"] * 1000)
    trace = [
        TraceRequest(at=0.0, messages=(("user", words),), system=None, conversation=None, turn=0)
    ]
    tokens = len(_prompt_tokens(trace[0]))
    chunks = math.ceil(tokens / fleet.chunk_tokens)
    expected = chunks * fleet.step_s + tokens * fleet.prefill_s_per_token
    for target in ("rr", "caravan-predicted_ttft"):
        replayed = Cell("unique", "light", target, 0)
        routing_quality.offline_cell(replayed, trace, fleet, [])
        assert replayed.errors == 0
        assert replayed.ttft_ms["p50"] == pytest.approx(1e3 * expected)


def test_the_wall_time_estimate_counts_every_target_and_repetition() -> None:
    trace = [
        TraceRequest(at=t, messages=(("user", "hi"),), system=None, conversation=None, turn=0)
        for t in (0.0, 20.0)
    ]
    plan = [routing_quality.PlannedCells("unique", "light", trace, 20.0, reps=2)]
    targets = ["rr", "caravan-predicted_ttft", "vllm-router-cache_aware"]
    startup = sum(routing_quality.STARTUP_S[family] for family in ("rr", "caravan", "vllm-router"))
    drain = 3 * routing_quality.DRAIN_S["light"]
    expected = 2 * (startup + 3 * 20.0 + drain)
    assert routing_quality.estimated_wall_s(plan, targets) == pytest.approx(expected)
