"""`python -m router`: run the router with settings from `CARAVAN_ROUTER_*` and `CONSUL_*`."""

from __future__ import annotations

import os
import sys

from pydantic import ValidationError

from router.server import run
from router.settings import RouterSettings


def main() -> int:
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
