"""`python -m caravan_llm.scheduler`: run the scheduler with settings from `CARAVAN_SCHEDULER_*`.

Nomad and Consul are found through their standard variables (`NOMAD_ADDR`,
`NOMAD_TOKEN`, `CONSUL_HTTP_ADDR`, `CONSUL_HTTP_TOKEN`, ...). `--help` lists
every setting.
"""

from __future__ import annotations

import os
import sys

from pydantic import ValidationError

from caravan_llm.common.settings_help import parse_process_args, print_settings_errors
from caravan_llm.scheduler.server import run
from caravan_llm.scheduler.settings import SchedulerSettings

DESCRIPTION = (
    "Run the caravan scheduler: keep one Nomad job per replica of every model in Consul KV, "
    "autoscale, and serve the HTTP API. Several may run; one leads. Settings come from the "
    "environment only; Nomad and Consul from NOMAD_ADDR, CONSUL_HTTP_ADDR and friends."
)


def main(argv: list[str] | None = None) -> int:
    parse_process_args(
        sys.argv[1:] if argv is None else argv,
        prog="python -m caravan_llm.scheduler",
        description=DESCRIPTION,
        settings_cls=SchedulerSettings,
    )
    try:
        settings = SchedulerSettings()
    except ValidationError as exc:
        return print_settings_errors(SchedulerSettings, exc)
    return run(settings, os.environ)


if __name__ == "__main__":
    sys.exit(main())
