"""The scheduler API's OpenAPI document says what the app serves, and is served behind the token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import pytest
import schemathesis
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from caravan_llm.scheduler.api import ApiAuth, create_api
from caravan_llm.scheduler.api_auth import StaticTokens, TokenSet
from caravan_llm.scheduler.metrics import SchedulerMetrics
from caravan_llm.scheduler.model_service import ModelService
from caravan_llm.scheduler.openapi import EXAMPLE_PROFILE, api_document
from caravan_llm.scheduler.profiles import ModelProfile

TOKEN = "t" * 24 + "-openapi-token"
METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


def app_with(*, tokens: bool) -> web.Application:
    """The API app; its routes and middlewares only (no request here reaches the service)."""
    registry = CollectorRegistry()
    auth = None
    if tokens:
        failures = SchedulerMetrics.create(registry).api_auth_failures
        auth = ApiAuth(StaticTokens(TokenSet.of([TOKEN])), failures)
    return create_api(cast("ModelService", object()), registry, lambda: True, auth=auth)


def routes_of(app: web.Application) -> dict[str, set[str]]:
    routes: dict[str, set[str]] = {}
    for resource in app.router.resources():
        info = resource.get_info()
        path = info.get("formatter", info.get("path"))
        assert isinstance(path, str)
        routes.setdefault(path, set()).update(route.method.lower() for route in resource)
    return routes


def documented_routes(document: dict[str, Any]) -> dict[str, set[str]]:
    return {path: set(item) & METHODS for path, item in document["paths"].items()}


@pytest.mark.parametrize("tokens", [True, False])
def test_document_lists_exactly_the_apps_routes_and_methods(tokens: bool):
    """Every route of the app is in the document with the same methods, and nothing else is."""
    assert routes_of(app_with(tokens=tokens)) == documented_routes(api_document())


def test_document_is_an_openapi_document_schemathesis_can_load():
    """The document is OpenAPI 3.1 and every operation in it loads without an error."""
    document = api_document()
    schema = schemathesis.openapi.from_dict(document)
    labels = [result.ok().label for result in schema.get_all_operations()]
    expected = sorted(
        f"{method.upper()} {path}"
        for path, methods in documented_routes(document).items()
        for method in methods
    )
    assert expected == sorted(labels)
    assert "3.1.0" == document["openapi"]


def test_every_secured_operation_documents_its_refusals():
    """Every operation but /health documents 401 and 403; /health needs no token."""
    document = api_document()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            codes = set(operation["responses"])
            if path == "/health":
                assert [] == operation["security"]
                assert not {"401", "403"} & codes
            else:
                assert "security" not in operation, (method, path)
                assert {"401", "403"} <= codes, (method, path)
    assert [{"bearer": []}] == document["security"]


def test_profile_body_is_model_profiles_own_schema():
    """PUT /v1/models/{name} takes ModelProfile's schema, so a new profile field cannot drift."""
    document = api_document()
    body = document["paths"]["/v1/models/{name}"]["put"]["requestBody"]["content"]
    assert {"$ref": "#/components/schemas/ModelProfile"} == body["application/json"]["schema"]
    profile = document["components"]["schemas"]["ModelProfile"]
    assert set(ModelProfile.model_json_schema()["properties"]) == set(profile["properties"])
    ModelProfile.model_validate(EXAMPLE_PROFILE)


@pytest.fixture
async def guarded() -> AsyncIterator[str]:
    server = TestServer(app_with(tokens=True), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url(""))
    finally:
        await server.close()


async def test_served_document_needs_the_token(guarded: str):
    """/openapi.json answers 401 without a token, 403 with a wrong one, the document with it."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{guarded}/openapi.json") as response:
            assert 401 == response.status
            assert "unauthorized" == (await response.json())["error"]["type"]
        wrong = {"Authorization": "Bearer " + "w" * 30}
        async with session.get(f"{guarded}/openapi.json", headers=wrong) as response:
            assert 403 == response.status
        right = {"Authorization": f"Bearer {TOKEN}"}
        async with session.get(f"{guarded}/openapi.json", headers=right) as response:
            assert 200 == response.status
            assert api_document() == await response.json()
