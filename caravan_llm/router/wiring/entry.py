"""The router process's entry point (`python -m caravan_llm.router`, `caravan router`).

One router serves by itself (`caravan_llm.router.wiring.server.run`); with `settings.workers`
above 1 the process becomes the supervisor of that many workers
(`caravan_llm.router.wiring.workers.supervise`), each of which serves through
`caravan_llm.router.wiring.server`.
Kept apart from both so that they import one way: workers -> server.
"""

from __future__ import annotations

from collections.abc import Mapping

from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.server import run as serve_one
from caravan_llm.router.wiring.server import start_up
from caravan_llm.router.wiring.workers import supervise


def run(settings: RouterSettings, environ: Mapping[str, str]) -> int:
    """Run the router the settings describe until it is stopped; the process exit code."""
    if settings.workers <= 1:
        return serve_one(settings, environ)
    startup = start_up(settings, environ)
    if isinstance(startup, int):
        return startup
    return supervise(settings, startup.consul_settings, startup.log_handler, startup.loop_factory)
