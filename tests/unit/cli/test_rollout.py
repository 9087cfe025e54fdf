"""`submit --wait` judges the submitted revision, never the previous one."""

from __future__ import annotations

from typing import Any

import pytest
from test_model_formatting import model, replica

from caravan_llm.cli.model_commands import wait_for_rollouts
from caravan_llm.cli.rollout import Outcome, judge_rollout

OLD_FAILURE = {"reason": "replica 0: the engine failed (old spec)", "since": 1.0}


def test_a_stale_failure_of_the_previous_revision_is_not_this_ones():
    """Right after a fix is submitted, the old replicas' failure keeps the wait going."""
    document = model(
        desired=1,
        ready=0,
        status="failed",
        failure=OLD_FAILURE,
        replicas=[replica(0, state="failed", current=False, failed="exit 1 (old spec)")],
    )
    assert Outcome.WAITING == judge_rollout(document, 1).outcome


def test_a_new_version_registered_before_the_record_is_cleared_still_waits():
    """The new job version is current and starting; the old record does not end the wait."""
    document = model(
        desired=1,
        ready=0,
        status="failed",
        failure=OLD_FAILURE,
        replicas=[replica(0, state="starting", health=None)],
    )
    assert Outcome.WAITING == judge_rollout(document, 1).outcome


def test_ready_means_the_current_replicas_with_none_of_the_previous_left():
    """A rolling update is done when the new replicas are ready and the old ones gone."""
    updating = model(
        desired=1,
        replicas=[replica(0, current=False), replica(1, state="ready")],
    )
    done = model(desired=1, replicas=[replica(1, state="ready")])
    assert (Outcome.WAITING, Outcome.READY) == (
        judge_rollout(updating).outcome,
        judge_rollout(done).outcome,
    )


def test_a_current_replica_that_failed_for_good_fails_the_wait_with_its_reason():
    """A broken update fails at once, naming the replica and why, while the old one serves."""
    document = model(
        desired=1,
        replicas=[
            replica(0, current=False),
            replica(1, state="failed", failed="Nomad stopped restarting it"),
        ],
    )
    rollout = judge_rollout(document, 3)
    assert (Outcome.FAILED, ("replica 1: Nomad stopped restarting it",)) == (
        rollout.outcome,
        rollout.reasons,
    )


def test_a_later_submission_ends_the_wait_saying_so():
    """When the model shows another version than the one submitted, the wait fails."""
    rollout = judge_rollout(model(version=4, replicas=[replica(0)]), 3)
    assert (Outcome.FAILED, ("version 3 was replaced by version 4 before it was ready",)) == (
        rollout.outcome,
        rollout.reasons,
    )


def test_what_a_model_waits_for_is_said_replica_by_replica():
    """The reasons a timed-out wait prints: each replica's state and last event, the old ones."""
    document = model(
        desired=2,
        replicas=[
            replica(0, current=False),
            replica(1, state="starting", last_event="Restarting: exit 1"),
        ],
    )
    assert (
        "replica 1: starting (Restarting: exit 1)",
        "1 replica(s) of this version not registered yet",
        "1 replica(s) still run the previous version",
    ) == judge_rollout(document).reasons


class Sequenced:
    """describe() answers from a list of documents, one per call (the last one repeats)."""

    def __init__(self, documents: list[dict[str, Any]]) -> None:
        self.documents = documents
        self.calls = 0

    async def describe(self, name: str) -> dict[str, Any]:
        document = self.documents[min(self.calls, len(self.documents) - 1)]
        self.calls += 1
        return document


async def test_wait_goes_on_past_the_old_failure_until_the_fix_is_ready(
    capsys: pytest.CaptureFixture[str],
):
    """The finding: a fixed profile after a failed one exits 0 once ready, not 1 at once."""
    models = Sequenced(
        [
            model(
                name="m",
                desired=1,
                status="failed",
                failure=OLD_FAILURE,
                replicas=[replica(0, state="failed", current=False, failed="old")],
            ),
            model(
                name="m",
                desired=1,
                status="failed",
                failure=OLD_FAILURE,
                replicas=[replica(0, state="starting", health=None)],
            ),
            model(name="m", desired=1, status="ready", replicas=[replica(0, state="ready")]),
        ]
    )
    code, rollouts = await wait_for_rollouts(models, {"m": 1}, 60, interval_s=0)  # type: ignore[arg-type]
    assert (0, Outcome.READY) == (code, rollouts[0].outcome)
    assert "failed" not in capsys.readouterr().err


async def test_a_timed_out_wait_says_what_each_model_waits_for(
    capsys: pytest.CaptureFixture[str],
):
    """Never silence after `waiting for replicas:`: every unready replica gets a line."""
    models = Sequenced(
        [model(name="m", desired=1, replicas=[replica(0, state="starting", health=None)])]
    )
    code, _ = await wait_for_rollouts(models, ["m"], 0, interval_s=0)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert 1 == code
    assert "timed out after 0s waiting for replicas:\n  m: replica 0: starting" in err


def test_a_failed_replica_reason_ends_with_its_engines_own_last_lines():
    """`submit --wait` prints the engine's stderr tail under the failure."""
    document = model(
        desired=1,
        ready=0,
        replicas=[
            replica(
                0,
                state="failed",
                failed="the engine failed and Nomad stopped restarting it",
                engine_stderr=["srv    load_model: failed to load model, '/opt/x.gguf'"],
            )
        ],
    )

    rollout = judge_rollout(document, 1)

    assert Outcome.FAILED == rollout.outcome
    expected = (
        "replica 0: the engine failed and Nomad stopped restarting it\n"
        "    engine stderr (last lines):\n"
        "      srv    load_model: failed to load model, '/opt/x.gguf'"
    )
    assert (expected,) == rollout.reasons


def test_a_waiting_replica_says_why_its_engine_log_is_unavailable():
    """A token without read-logs is named in the reasons a timed-out wait prints."""
    document = model(
        desired=1,
        ready=0,
        replicas=[
            replica(
                0,
                state="pending",
                last_event="Terminated: Exit Code: 1",
                engine_stderr_unavailable="the scheduler's Nomad token lacks read-logs (HTTP 403)",
            )
        ],
    )

    rollout = judge_rollout(document, 1)

    assert Outcome.WAITING == rollout.outcome
    assert (
        "replica 0: pending (Terminated: Exit Code: 1)\n"
        "    engine stderr unavailable: the scheduler's Nomad token lacks read-logs (HTTP 403)"
    ) == rollout.reasons[0]
