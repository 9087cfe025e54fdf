"""`python -m caravan_llm.devcluster.engine --flavor vllm|llamacpp|sglang [the real engine's
flags]`.

Runs one simulated engine instance until SIGTERM or SIGINT. Exit status 2 on
a command line the engine cannot run (like argparse and the real engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from caravan_llm.devcluster.engine.flags import EngineSettings, FlagError, parse_engine_args
from caravan_llm.devcluster.engine.lora import LoraModuleError
from caravan_llm.devcluster.engine.model_file import (
    MODEL_LOAD_EXIT_CODE,
    check_model_file,
    missing_model_lines,
)
from caravan_llm.devcluster.engine.server import run_engine

log = logging.getLogger("caravan_llm.devcluster.engine")
# How long a SIGTERM waits for aborted requests to write their last chunks.
DRAIN_SECONDS = 2.0

_USAGE = (
    "usage: python -m caravan_llm.devcluster.engine --flavor {vllm,llamacpp,sglang} "
    "[engine flags]\n"
    "  --flavor vllm      flags of `vllm serve` (try --flavor vllm --help)\n"
    "  --flavor llamacpp  flags of `llama-server` (try --flavor llamacpp --help)\n"
    "  --flavor sglang    flags of `python -m sglang.launch_server` (try --flavor sglang --help)\n"
)


async def _serve(settings: EngineSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with run_engine(settings) as running:
        log.info(
            "simulated %s engine bound to %s (model %s, loading %.1f s)",
            settings.flavor,
            running.base_url,
            settings.model_name,
            settings.sim.load_seconds,
        )
        await running.engine.ready.wait()
        # The line llama-server prints when it is ready, for anyone tailing the log.
        log.info("server is listening on %s - starting the main loop", running.base_url)
        await stop.wait()
        log.info("shutting down")
        if settings.flavor == "vllm":
            # vLLM aborts what is in flight: streams end with finish_reason "abort" and [DONE].
            running.engine.abort_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(running.engine.drained(), DRAIN_SECONDS)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args in (["-h"], ["--help"]):
        print(_USAGE, end="")  # noqa: T201
        return 0 if args else 2
    try:
        settings = parse_engine_args(args, os.environ)
    except FlagError as exc:
        print(f"error: {exc}\n{_USAGE}", end="", file=sys.stderr)  # noqa: T201
        return 2
    if check_model_file(os.environ):
        missing = missing_model_lines(settings, exists=Path(settings.model).is_file())
        if missing:
            print("\n".join(missing), file=sys.stderr)  # noqa: T201
            return MODEL_LOAD_EXIT_CODE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(_serve(settings))
    except LoraModuleError as exc:
        # vLLM stops at start when a --lora-modules adapter does not load.
        log.error("ValueError: %s", exc)  # noqa: TRY400 - the engine's one line, no traceback
        return 1
    except OSError as exc:
        # A taken port ends the real engines at once too.
        log.error("cannot serve on %s:%s: %s", settings.host, settings.port, exc)  # noqa: TRY400
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
