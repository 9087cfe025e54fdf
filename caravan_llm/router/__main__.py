"""`python -m caravan_llm.router`: run the router with settings from `CARAVAN_ROUTER_*` and
`CONSUL_*`."""

from __future__ import annotations

import os
import sys

from pydantic import ValidationError

from caravan_llm.common.settings_help import parse_process_args
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.entry import run

DESCRIPTION = (
    "Run a caravan router: route OpenAI requests to the model replicas Consul reports ready. "
    "Settings come from the environment only (router/README.md); Consul from "
    "CONSUL_HTTP_ADDR, CONSUL_HTTP_TOKEN and friends."
)


def main(argv: list[str] | None = None) -> int:
    parse_process_args(
        sys.argv[1:] if argv is None else argv,
        prog="python -m caravan_llm.router",
        description=DESCRIPTION,
        settings_cls=RouterSettings,
    )
    try:
        settings = RouterSettings()
    except ValidationError as exc:
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"]) or "settings"
            print(f"error: CARAVAN_ROUTER_{field.upper()}: {error['msg']}", file=sys.stderr)  # noqa: T201
        return 2
    return run(settings, os.environ)


if __name__ == "__main__":
    sys.exit(main())
