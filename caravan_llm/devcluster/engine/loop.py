"""The one asyncio task per engine instance that drives the batch core.

Each step it asks the core for work, sleeps for the step's duration once for
the whole batch, applies the step and wakes the requests that got tokens. No
request sleeps per token: a handler waits on its own event and, when woken,
sends every token that is ready (several if it fell behind).

Work the engine core does between two steps (vLLM's utility calls, such as
`add_lora` for a runtime adapter load) is queued with `between_steps`: the
loop runs it before its next step and sleeps for the seconds it reports, so
no step runs meanwhile, as in vLLM's engine-core busy loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from caravan_llm.devcluster.engine.batch import (
    BatchCore,
    Finished,
    FirstToken,
    SequenceSpec,
    StepOutcome,
)

Clock = Callable[[], float]
StepObserver = Callable[[StepOutcome], None]
# Work between two steps: does it and returns the seconds it takes.
Utility = Callable[[], float]


@dataclass(slots=True, eq=False)
class RequestHandle:
    """What a request handler watches: tokens ready so far and whether it is done."""

    request_id: str
    ready: int = 0
    finished: bool = False
    first_token: FirstToken | None = None
    finish: Finished | None = None
    # Ended by the server (SIGTERM) before its last token: finish_reason "abort".
    aborted: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self) -> None:
        """Wait until more tokens are ready or the request finished."""
        await self.event.wait()
        self.event.clear()


class EngineLoop:
    """Runs the batch core in real time on the event loop."""

    def __init__(
        self,
        core: BatchCore,
        *,
        clock: Clock = time.monotonic,
        observers: Sequence[StepObserver] = (),
    ) -> None:
        self.core = core
        self._clock = clock
        self._observers = tuple(observers)
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._utilities: list[tuple[Utility, asyncio.Future[None]]] = []
        self.steps = 0

    async def between_steps(self, work: Utility) -> None:
        """Run `work` on the engine between two steps; returns once its seconds have passed."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._utilities.append((work, done))
        self._wake.set()
        await done

    def submit(self, spec: SequenceSpec) -> RequestHandle:
        """Queue a request; raises RequestTooLargeError when it can never fit."""
        self.core.submit(spec, self._clock())
        handle = RequestHandle(request_id=spec.request_id)
        self._handles[spec.request_id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        """Forget a request whose client went away (no-op when it already finished)."""
        self._handles.pop(request_id, None)
        self.core.abort(request_id)

    async def run(self) -> None:
        """Step forever; cancel the task to stop."""
        while True:
            if self._utilities:
                await self._run_utilities()
                continue
            plan = self.core.schedule(self._clock())
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Sleep to the step's end, counting the time this loop itself took.
            remaining = plan.started_at + plan.duration - self._clock()
            await asyncio.sleep(max(remaining, 0.0))
            outcome = self.core.complete(plan, self._clock())
            self.steps += 1
            self._dispatch(outcome)
            for observe in self._observers:
                observe(outcome)

    async def _run_utilities(self) -> None:
        pending, self._utilities = self._utilities, []
        for work, done in pending:
            started = self._clock()
            try:
                seconds = work()
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
                continue
            await asyncio.sleep(max(started + seconds - self._clock(), 0.0))
            if not done.done():
                done.set_result(None)

    def _dispatch(self, outcome: StepOutcome) -> None:
        for request_id in outcome.emitted:
            handle = self._handles.get(request_id)
            if handle is not None:
                handle.ready += 1
                handle.event.set()
        for first in outcome.first_tokens:
            handle = self._handles.get(first.request_id)
            if handle is not None:
                handle.first_token = first
        for finished in outcome.finished:
            handle = self._handles.pop(finished.request_id, None)
            if handle is not None:
                handle.finished = True
                handle.finish = finished
                handle.event.set()
