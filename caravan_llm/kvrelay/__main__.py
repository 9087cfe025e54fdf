"""`python -m caravan_llm.kvrelay`: run a replica's KV relay, settings from `CARAVAN_KV_RELAY_*`.

The engine key comes from the engine task's own variable (`VLLM_API_KEY`,
`CARAVAN_ENGINE_API_KEY`) or `CARAVAN_KV_RELAY_ENGINE_API_KEY`; the listener
from `NOMAD_IP_kv` / `NOMAD_PORT_kv` inside an allocation (kvrelay/README.md).
"""

from __future__ import annotations

import sys

from pydantic import ValidationError

from caravan_llm.common.settings_help import parse_process_args, print_settings_errors
from caravan_llm.kvrelay.relay import run
from caravan_llm.kvrelay.settings import RelaySettings

DESCRIPTION = (
    "Run a caravan KV relay inside a replica's allocation: read the engine's KV-cache events "
    "(ipc:// or loopback only) and serve routers the block digests, never token ids, behind "
    "the engine key. Settings come from the environment only (kvrelay/README.md)."
)


def main(argv: list[str] | None = None) -> int:
    parse_process_args(
        sys.argv[1:] if argv is None else argv,
        prog="python -m caravan_llm.kvrelay",
        description=DESCRIPTION,
        settings_cls=RelaySettings,
    )
    try:
        settings = RelaySettings()
    except ValidationError as exc:
        return print_settings_errors(RelaySettings, exc)
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
