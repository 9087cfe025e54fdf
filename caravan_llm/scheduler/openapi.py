"""The OpenAPI 3.1 document of the scheduler's HTTP API (`scheduler/api.py`), at `/openapi.json`.

Every body and answer that is a pydantic model or a dataclass in the code
takes its schema from that type: a profile is `ModelProfile`'s own JSON
schema, one model's status is `ModelStatus`'s, its history
`ModelHistoryView`'s; a field added to one of them changes the document.
The small envelopes the handlers write inline (`{"name", "deleted"}`, the
error shape) are written out here. Answers are closed
(`additionalProperties: false`), so a field the document does not know
fails the conformance checks.

tests/unit/scheduler/test_openapi.py holds the document's paths and methods
equal to the app's routes; tests/security/test_scheduler_api_schemathesis.py
runs Schemathesis against a scheduler on a devcluster, with and without a
token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter
from pydantic.json_schema import JsonSchemaMode

from caravan_llm.common.contract import MODEL_NAME_MAX_LEN, MODEL_NAME_PATTERN
from caravan_llm.scheduler.dry_run import Change
from caravan_llm.scheduler.engines.registry import Engine
from caravan_llm.scheduler.model_service import ModelHistoryView
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.status import ModelStatus

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{model}"
JSON = "application/json"
# prometheus_client's CONTENT_TYPE_LATEST, without its parameters.
METRICS_MEDIA_TYPE = "text/plain"

# A profile that validates on a cluster with CPU nodes: the request examples,
# which Schemathesis sends first.
EXAMPLE_NAME = "tiny-chat"
EXAMPLE_PROFILE: Mapping[str, Any] = {
    "name": EXAMPLE_NAME,
    "model": "/opt/models/tiny-llama.gguf",
    "engine": Engine.LLAMACPP.value,
    "replicas": {"min": 1, "max": 2, "initial": 1},
    "resources": {"cores": 1, "memory_mb": 512},
}
_EXAMPLE_YAML = (
    f"name: {EXAMPLE_NAME}\nmodel: /opt/models/tiny-llama.gguf\nengine: {Engine.LLAMACPP.value}\n"
    "replicas: {min: 1, max: 2, initial: 1}\nresources: {cores: 1, memory_mb: 512}\n"
)


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (pure)."""
    if isinstance(schema, dict):
        closed = {key: _closed(value) for key, value in schema.items()}
        if "properties" in closed:
            closed.setdefault("additionalProperties", False)
        return closed
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


def _type_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """`{name: $ref}` of the typed bodies and answers, and the component schemas they use."""
    entries: list[tuple[str, JsonSchemaMode, TypeAdapter[Any]]] = [
        ("ModelProfile", "validation", TypeAdapter(ModelProfile)),
        ("ModelStatus", "serialization", TypeAdapter(ModelStatus)),
        ("ModelHistoryView", "serialization", TypeAdapter(ModelHistoryView)),
    ]
    refs, definitions = TypeAdapter.json_schemas(entries, ref_template=_REF)
    by_name = {name: refs[(name, mode)] for name, mode, _ in entries}
    components = definitions.get("$defs", {})
    # The answers are closed; ModelProfile closes itself (extra="forbid").
    return by_name, {name: _closed(schema) for name, schema in components.items()}


def _object(required: Mapping[str, Any], optional: Mapping[str, Any] | None = None) -> Any:
    properties = {**required, **(optional or {})}
    return {
        "type": "object",
        "required": list(required),
        "properties": properties,
        "additionalProperties": False,
    }


_STRING = {"type": "string"}
_STRINGS = {"type": "array", "items": _STRING}
_INTEGER = {"type": "integer"}
_VERSION = {"type": "integer", "minimum": 0}
_NUMBER_OR_NULL = {"type": ["number", "null"]}
_TRUE = {"const": True}


def _error_schema(kinds: tuple[str, ...]) -> Any:
    return _object(
        {
            "error": _object(
                {"message": _STRING, "type": {"type": "string", "enum": list(kinds)}},
                {"problems": _STRINGS},
            )
        }
    )


# A JSON body may also come as text/plain (read as JSON all the same).
_AS_TEXT = {"text/plain": {"schema": {"type": "string", "description": "The same JSON, as text."}}}


def _json(schema: Any, description: str, **extra: Any) -> Any:
    return {"description": description, "content": {JSON: {"schema": schema}}, **extra}


def _error(description: str, *kinds: str, **extra: Any) -> Any:
    return _json(_error_schema(kinds), description, **extra)


_AUTH_ERRORS = {
    "401": _error(
        "No `Authorization` header, or not `Bearer <token>` (only when tokens are configured).",
        "unauthorized",
        headers={
            "WWW-Authenticate": {
                "description": 'Always `Bearer realm="caravan-scheduler"`.',
                "schema": _STRING,
            }
        },
    ),
    "403": _error("The bearer token is not one of the scheduler's.", "forbidden"),
}
_BACKEND_ERRORS = {
    "502": _error("Consul or Nomad refused the scheduler's call (not retryable).", "backend_error"),
    "503": _error("Consul or Nomad did not answer (retryable).", "backend_unavailable"),
}
_NOT_FOUND = {"404": _error("No model (or kept version) by that name.", "not_found")}
_TOO_LARGE = {"413": _error("The body is larger than 1 MiB.", "too_large")}
_UNSUPPORTED = {
    "415": _error("The body's Content-Type is not one the route reads.", "unsupported_media_type")
}
_CONFLICT = _error(
    "Another writer won the race 4 times, or the stored profile does not validate; "
    "nothing was written.",
    "conflict",
    "invalid_stored_profile",
)

_NAME_PARAMETER = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "The model's name (its profile's `name`).",
    "schema": {
        "type": "string",
        "pattern": MODEL_NAME_PATTERN.pattern,
        "maxLength": MODEL_NAME_MAX_LEN,
    },
    "example": EXAMPLE_NAME,
}

_DOCUMENTS_BODY = {
    "required": True,
    "content": {
        JSON: {
            "schema": _object(
                {
                    "documents": {
                        "type": "array",
                        "minItems": 1,
                        "items": _object(
                            {"text": {"type": "string", "description": "A profile, YAML or JSON."}},
                            {"source": {"type": "string", "description": "Named in problems."}},
                        ),
                    }
                }
            ),
            "example": {"documents": [{"source": "tiny.yaml", "text": _EXAMPLE_YAML}]},
        },
        **_AS_TEXT,
    },
}


def _field_change() -> Any:
    return _object(
        {
            "path": _STRING,
            "mark": {"type": "string", "enum": ["+", "-", "+/-"]},
            "old": {},
            "new": {},
        }
    )


def _plan_schema() -> Any:
    change = {"type": "string", "enum": [c.value for c in Change]}
    nullable_hash = {"type": ["string", "null"]}
    job = _object(
        {
            "job_id": _STRING,
            "replica": _INTEGER,
            "change": change,
            "old_spec_hash": nullable_hash,
            "new_spec_hash": nullable_hash,
            "fields": {"type": "array", "items": _field_change()},
        }
    )
    model = _object(
        {
            "name": _STRING,
            "change": change,
            "desired": _INTEGER,
            "jobs": {"type": "array", "items": job},
        }
    )
    return _object({"changes": {"type": "boolean"}, "models": {"type": "array", "items": model}})


def _operation(
    summary: str,
    responses: Mapping[str, Any],
    *,
    body: Mapping[str, Any] | None = None,
    named: bool = False,
    secured: bool = True,
) -> Any:
    operation: dict[str, Any] = {"summary": summary}
    if named:
        operation["parameters"] = [_NAME_PARAMETER]
    if body is not None:
        operation["requestBody"] = body
    operation["responses"] = {**responses, **(_AUTH_ERRORS if secured else {})}
    if not secured:
        operation["security"] = []
    return operation


def _paths(types: Mapping[str, Any]) -> dict[str, Any]:
    status = types["ModelStatus"]
    invalid_profile = _error(
        "A profile does not validate (each problem named); nothing was written.",
        "invalid_request",
        "invalid_profile",
    )
    submitted = _object(
        {"submitted": _STRINGS, "versions": {"type": "object", "additionalProperties": _VERSION}}
    )
    scaled = {
        "oneOf": [
            _object(
                {"name": _STRING, "replicas": _INTEGER, "hold_s": {"type": ["number", "null"]}}
            ),
            _object({"name": _STRING, "auto": {"const": True}}),
        ]
    }
    scale_body = {
        "required": True,
        "content": {
            JSON: {
                "schema": {
                    "oneOf": [
                        _object(
                            {"replicas": {"type": "integer", "minimum": 0}},
                            {"hold_s": {"type": ["number", "null"], "exclusiveMinimum": 0}},
                        ),
                        _object({"auto": {"const": True}}),
                    ]
                },
                "example": {"replicas": 2},
            },
            **_AS_TEXT,
        },
    }
    profile_body = {
        "required": True,
        "description": "The profile, as JSON or YAML; its `name` must be the path's.",
        "content": {
            JSON: {"schema": types["ModelProfile"], "example": dict(EXAMPLE_PROFILE)},
            # The same document as YAML (Schemathesis writes the generated object as YAML).
            "application/yaml": {"schema": types["ModelProfile"], "example": dict(EXAMPLE_PROFILE)},
            "text/plain": {"schema": _STRING, "example": _EXAMPLE_YAML},
        },
    }
    revert_body = {
        "required": True,
        "content": {
            JSON: {"schema": _object({"version": _VERSION}), "example": {"version": 0}},
            **_AS_TEXT,
        },
    }
    return {
        "/v1/models": {
            "get": _operation(
                "Every model with its desired and ready counts and status.",
                {
                    "200": _json(
                        _object({"models": {"type": "array", "items": status}}), "The models."
                    ),
                    **_BACKEND_ERRORS,
                },
            ),
            "post": _operation(
                "Submit several profiles at once, all or none.",
                {
                    "200": _json(submitted, "Every profile was written, each as a new version."),
                    "400": invalid_profile,
                    "409": _CONFLICT,
                    **_TOO_LARGE,
                    **_UNSUPPORTED,
                    **_BACKEND_ERRORS,
                },
                body=_DOCUMENTS_BODY,
            ),
        },
        "/v1/models/{name}": {
            "get": _operation(
                "One model, replica by replica.",
                {
                    "200": _json(status, "The model's status."),
                    **_NOT_FOUND,
                    "409": _error(
                        "The stored profile does not validate.", "invalid_stored_profile"
                    ),
                    **_BACKEND_ERRORS,
                },
                named=True,
            ),
            "put": _operation(
                "Submit one profile.",
                {
                    "200": _json(
                        _object(
                            {"name": _STRING, "submitted": {"const": True}, "version": _VERSION}
                        ),
                        "The profile was written as a new version.",
                    ),
                    "400": invalid_profile,
                    "409": _CONFLICT,
                    **_TOO_LARGE,
                    **_UNSUPPORTED,
                    **_BACKEND_ERRORS,
                },
                body=profile_body,
                named=True,
            ),
            "delete": _operation(
                "Remove a model: its replicas drain and stop.",
                {
                    "200": _json(
                        _object({"name": _STRING, "deleted": {"const": True}}), "It was removed."
                    ),
                    **_NOT_FOUND,
                    "409": _CONFLICT,
                    **_BACKEND_ERRORS,
                },
                named=True,
            ),
        },
        "/v1/models/{name}/scale": {
            "post": _operation(
                "Set the desired count (held against the autoscaler for `hold_s` seconds, "
                "default 3600, on an autoscaled model), or with `auto` end the hold.",
                {
                    "200": _json(scaled, "The count was set, or the hold ended."),
                    "400": _error(
                        "The body is not the shape shown, or the count is outside "
                        "replicas.min..max, or the model has no autoscaling to hold against.",
                        "invalid_request",
                        "out_of_bounds",
                    ),
                    **_UNSUPPORTED,
                    **_NOT_FOUND,
                    "409": _CONFLICT,
                    **_BACKEND_ERRORS,
                },
                body=scale_body,
                named=True,
            ),
        },
        "/v1/models/{name}/history": {
            "get": _operation(
                "The kept versions of the model's profile, newest first.",
                {
                    "200": _json(types["ModelHistoryView"], "The history."),
                    **_NOT_FOUND,
                    **_BACKEND_ERRORS,
                },
                named=True,
            ),
        },
        "/v1/models/{name}/revert": {
            "post": _operation(
                "Submit a kept version again, as a new version (validated as a submission).",
                {
                    "200": _json(
                        _object({"name": _STRING, "reverted_to": _VERSION, "version": _VERSION}),
                        "The version was submitted again.",
                    ),
                    "400": invalid_profile,
                    **_NOT_FOUND,
                    **_UNSUPPORTED,
                    "409": _error(
                        "That version is the current profile, another writer won the race, "
                        "or the stored profile does not validate.",
                        "nothing_to_revert",
                        "conflict",
                        "invalid_stored_profile",
                    ),
                    **_BACKEND_ERRORS,
                },
                body=revert_body,
                named=True,
            ),
        },
        "/v1/plan": {
            "post": _operation(
                "What a submission would change, job by job; nothing is written.",
                {
                    "200": _json(_plan_schema(), "The plan."),
                    "400": invalid_profile,
                    "409": _error("A stored profile does not validate.", "invalid_stored_profile"),
                    **_TOO_LARGE,
                    **_UNSUPPORTED,
                    **_BACKEND_ERRORS,
                },
                body=_DOCUMENTS_BODY,
            ),
        },
        "/health": {
            "get": _operation(
                "Whether the process runs and leads; open without a token.",
                {
                    "200": _json(
                        _object({"status": {"const": "ok"}, "leader": {"type": "boolean"}}),
                        "It runs.",
                    ),
                    "503": _json(
                        _object(
                            {
                                "status": {"const": "misconfigured"},
                                "leader": {"type": "boolean"},
                                "missing": _STRINGS,
                            }
                        ),
                        "Its Consul or Nomad token lacks the grants named.",
                    ),
                },
                secured=False,
            ),
        },
        "/metrics": {
            "get": _operation(
                "Prometheus exposition.",
                {
                    "200": {
                        "description": "The metrics.",
                        "content": {METRICS_MEDIA_TYPE: {"schema": _STRING}},
                    }
                },
            ),
        },
        "/openapi.json": {
            "get": _operation(
                "This document.",
                {"200": _json({"type": "object"}, "The OpenAPI document.")},
            ),
        },
    }


def api_document() -> dict[str, Any]:
    """The OpenAPI document of the scheduler's API (pure; built once per app)."""
    types, components = _type_schemas()
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "caravan scheduler API",
            "version": "1",
            "description": (
                "Models for the CLI and operators. Every route but `/health` needs "
                "`Authorization: Bearer <token>` when the scheduler has tokens; without "
                "tokens the API is open and listens on loopback only. Errors are "
                '`{"error": {"message", "type", "problems"}}`.'
            ),
        },
        "security": [{"bearer": []}],
        "paths": _paths(types),
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
