"""Requests and model cards for LoRA adapters (pure; issue 25).

- `for_engine`: the request as the adapter's engine takes it. vLLM takes the
  adapter's own name in `model` (the bytes go unchanged); an engine whose
  `request_model` is another form (SGLang's `<served>:<adapter>`) gets the
  body with `model` rewritten, everything else as parsed;
- `adapter_cards`: the `/v1/models` entries of the declared adapters of the
  listed models, each with `parent` (the base model's served name) and
  `root` (its source), as vLLM lists a loaded adapter.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from caravan_llm.router.core.adapters import AdapterRoute, AdapterTable, engine_model_name

if TYPE_CHECKING:
    from collections.abc import Collection

    from caravan_llm.router.edge.parsed_request import ParsedRequest


def for_engine(parsed: ParsedRequest, route: AdapterRoute, template: str) -> ParsedRequest:
    """The request with `model` as the engine names the adapter (the same object when equal)."""
    name = engine_model_name(template, route)
    if name == parsed.model:
        return parsed
    payload = {**parsed.payload, "model": name}
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return replace(parsed, body=body, payload=payload)


def adapter_cards(
    table: AdapterTable, listed: Collection[str], created: int
) -> list[dict[str, Any]]:
    """Model cards of the adapters whose base model's served name is in `listed`, by name."""
    return [
        {
            "id": route.name,
            "object": "model",
            "created": created,
            "owned_by": "caravan",
            "root": route.source or route.name,
            "parent": route.served,
        }
        for name, route in sorted(table.routes.items())
        if route.served in listed and name not in listed
    ]
