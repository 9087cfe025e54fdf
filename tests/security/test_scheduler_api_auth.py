"""The scheduler's HTTP API needs a bearer token on every route but /health (issue 12, item 1)."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_stack, running_scheduler
from caravan_llm.common.contract import KVLayout
from caravan_llm.scheduler.api_auth import (
    ApiTokenError,
    AuthOutcome,
    TokenFile,
    TokenSet,
    check_authorization,
    load_token_source,
    parse_token_file,
    parse_token_list,
)
from caravan_llm.scheduler.app import api_bind_host, build_scheduler
from caravan_llm.scheduler.settings import SchedulerSettings

ROOT = Path(__file__).resolve().parents[2]
PROFILE = (ROOT / "examples" / "profiles" / "tiny-llamacpp-cpu.yaml").read_text(encoding="utf-8")
TOKEN_A = "a" * 24 + "-first-token"
TOKEN_B = "b" * 24 + "-second-token"
WRONG = "w" * 24 + "-not-a-token"
FAILURES = "caravan_scheduler_api_auth_failures_total"


# -- the decision ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, AuthOutcome.MISSING),
        ("", AuthOutcome.MISSING),
        ("   ", AuthOutcome.MISSING),
        (f"Basic {TOKEN_A}", AuthOutcome.MALFORMED),
        ("Bearer", AuthOutcome.MALFORMED),
        ("Bearer ", AuthOutcome.MALFORMED),
        (f"Bearer {TOKEN_A} extra", AuthOutcome.MALFORMED),
        (TOKEN_A, AuthOutcome.MALFORMED),
        (f"Bearer {WRONG}", AuthOutcome.INVALID),
        (f"Bearer {TOKEN_A[:-1]}", AuthOutcome.INVALID),
        (f"Bearer {TOKEN_A}", AuthOutcome.OK),
        (f"bearer {TOKEN_B}", AuthOutcome.OK),
    ],
)
def test_authorization_header_outcomes(header: str | None, expected: AuthOutcome):
    """Missing and malformed headers are told apart from a token that is not accepted."""
    assert expected == check_authorization(header, TokenSet.of([TOKEN_A, TOKEN_B]))


def test_no_token_is_accepted_by_an_empty_set():
    """An emptied token set (a removed or broken token file) accepts nothing."""
    assert AuthOutcome.INVALID == check_authorization(f"Bearer {TOKEN_A}", TokenSet())


def test_every_token_is_compared_in_constant_time_without_early_exit():
    """The check uses hmac.compare_digest and compares with every token even after a match."""
    default = inspect.signature(check_authorization).parameters["compare"].default
    assert default is hmac.compare_digest
    calls: list[tuple[bytes, bytes]] = []

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return hmac.compare_digest(a, b)

    tokens = TokenSet.of([TOKEN_A, TOKEN_B, WRONG + "x"])
    outcome = check_authorization(f"Bearer {TOKEN_A}", tokens, compare=recording)
    assert AuthOutcome.OK == outcome
    assert len(tokens.digests) == len(calls)
    # Digests of equal length, so compare_digest never leaks a token's length either.
    assert {32} == {len(a) for a, _ in calls} | {len(b) for _, b in calls}


def test_token_settings_errors_name_the_variable_and_never_the_token():
    """A short or odd token is refused naming where it is, without printing it."""
    with pytest.raises(ApiTokenError) as short:
        parse_token_list(f"{TOKEN_A},tiny")
    assert "CARAVAN_SCHEDULER_API_TOKENS: token 2" in str(short.value)
    assert "tiny" not in str(short.value)
    with pytest.raises(ApiTokenError) as odd:
        parse_token_file(f"# ops tokens\n{TOKEN_A}\n{TOKEN_B}!x\n", source="F /t")
    assert "F /t: line 3" in str(odd.value)
    assert TOKEN_B not in str(odd.value)
    with pytest.raises(ApiTokenError, match="not both"):
        load_token_source(TOKEN_A, "/some/file")
    assert load_token_source(None, None) is None
    assert load_token_source("", None) is None


def test_token_file_comments_and_blank_lines(tmp_path: Path):
    """A token file holds one token a line; comments and blank lines are ignored."""
    path = tmp_path / "tokens"
    path.write_text(f"# issued 2026-12-01\n\n{TOKEN_A}  # ci\n{TOKEN_B}\n", encoding="utf-8")
    tokens = TokenFile(path).current()
    assert TokenSet.of([TOKEN_A, TOKEN_B]) == tokens


def test_token_file_rotation_without_restart(tmp_path: Path):
    """Add the new token, move clients, remove the old one: each step applies on the next call."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN_A}\n", encoding="utf-8")
    source = TokenFile(path)

    def accepted(token: str) -> bool:
        return check_authorization(f"Bearer {token}", source.current()) is AuthOutcome.OK

    assert (True, False) == (accepted(TOKEN_A), accepted(TOKEN_B))
    path.write_text(f"{TOKEN_A}\n{TOKEN_B}\n", encoding="utf-8")
    assert (True, True) == (accepted(TOKEN_A), accepted(TOKEN_B))
    replacement = tmp_path / "tokens.new"
    replacement.write_text(f"{TOKEN_B}\n", encoding="utf-8")
    replacement.replace(path)  # the atomic rename a config tool does
    assert (False, True) == (accepted(TOKEN_A), accepted(TOKEN_B))


def test_token_file_that_breaks_or_vanishes_fails_closed(tmp_path: Path, caplog):
    """An invalid or deleted token file accepts nothing, and the log says why."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN_A}\n", encoding="utf-8")
    source = TokenFile(path)
    path.write_text(f"{TOKEN_A}\nshort\n", encoding="utf-8")
    with caplog.at_level(logging.ERROR, logger="caravan_llm.scheduler.api_auth"):
        assert TokenSet() == source.current()
        path.unlink()
        assert TokenSet() == source.current()
    messages = [record.getMessage() for record in caplog.records]
    assert ["scheduler_api_tokens_file_invalid", "scheduler_api_tokens_file_missing"] == messages
    assert all(TOKEN_A not in str(record.__dict__) for record in caplog.records)


def test_a_token_file_that_accepts_nothing_stops_the_start(tmp_path: Path):
    """A missing or empty token file at start is an error naming the variable and the file."""
    missing = tmp_path / "missing"
    with pytest.raises(ApiTokenError, match=f"CARAVAN_SCHEDULER_API_TOKENS_FILE {missing}"):
        TokenFile(missing)
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n", encoding="utf-8")
    with pytest.raises(ApiTokenError, match="holds no token"):
        TokenFile(empty)


@pytest.mark.parametrize(
    ("requested", "tokens", "expected"),
    [
        ("0.0.0.0", False, "127.0.0.1"),
        ("10.1.2.3", False, "127.0.0.1"),
        ("scheduler.example", False, "127.0.0.1"),
        ("", False, "127.0.0.1"),
        ("127.0.0.1", False, "127.0.0.1"),
        ("::1", False, "::1"),
        ("localhost", False, "localhost"),
        ("0.0.0.0", True, "0.0.0.0"),
        ("10.1.2.3", True, "10.1.2.3"),
    ],
)
def test_bind_host_is_loopback_without_tokens(requested: str, tokens: bool, expected: str):
    """Without a token the API may only listen on loopback, whatever host was asked for."""
    assert expected == api_bind_host(requested, tokens_configured=tokens)


# -- against a running scheduler -------------------------------------------------------


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[LocalStack]:
    options = StackOptions(
        cpu_nodes=1, gpu_nodes=0, prefer_real_llama_server=False, autoscale=False, work_dir=tmp_path
    )
    async with local_stack(options) as running:
        yield running


async def kv_snapshot(stack: LocalStack) -> list[tuple[str, bytes | None, int]]:
    """Every key a write route can touch, with its value and modify index."""
    layout = KVLayout()
    found = []
    for prefix in (layout.models, layout.desired, layout.draining):
        _, entries = await stack.scheduler.consul.kv_get_recurse(prefix)
        found.extend((e.key, e.value, e.modify_index) for e in entries)
    return sorted(found)


def failures(stack: LocalStack, reason: str) -> float:
    value = stack.scheduler.registry.get_sample_value(FAILURES, {"reason": reason})
    return 0.0 if value is None else value


WRITES = [
    ("PUT", "/v1/models/tiny-chat", {"data": PROFILE}),
    ("PUT", "/v1/models/beta", {"data": PROFILE.replace("tiny-chat", "beta")}),
    ("DELETE", "/v1/models/tiny-chat", {}),
    ("POST", "/v1/models/tiny-chat/scale", {"json": {"replicas": 2}}),
]
READS = [("GET", "/v1/models", {}), ("GET", "/v1/models/tiny-chat", {}), ("GET", "/metrics", {})]


async def test_unauthenticated_and_wrong_token_calls_are_refused_and_write_nothing(
    stack: LocalStack,
):
    """No, malformed or wrong credentials: 401/403 JSON on every route, counted, KV untouched."""
    assert stack.scheduler_api_token is not None
    base = stack.scheduler_url
    async with aiohttp.ClientSession() as session:
        # One model exists, so DELETE and scale would have something to change.
        async with session.put(
            f"{base}/v1/models/tiny-chat", data=PROFILE, headers=stack.scheduler_headers
        ) as response:
            assert response.status == 200
        before = await kv_snapshot(stack)
        assert any(key.endswith("models/tiny-chat") for key, _, _ in before)
        attempts: list[tuple[dict[str, str], int, str]] = [
            ({}, 401, "missing"),
            ({"Authorization": f"Basic {stack.scheduler_api_token}"}, 401, "malformed"),
            ({"Authorization": "Bearer"}, 401, "malformed"),
            ({"Authorization": f"Bearer {WRONG}"}, 403, "invalid"),
            ({"Authorization": f"Bearer {stack.scheduler_api_token}x"}, 403, "invalid"),
        ]
        for method, path, body in WRITES + READS:
            for headers, status, reason in attempts:
                counted = failures(stack, reason)
                async with session.request(
                    method, base + path, headers=headers, **body
                ) as response:
                    answer: Any = await response.json()
                    assert status == response.status, (method, path, reason)
                    assert {"message", "type"} <= set(answer["error"])
                    if status == 401:
                        assert response.headers["WWW-Authenticate"].startswith("Bearer")
                    else:
                        assert "WWW-Authenticate" not in response.headers
                assert counted + 1 == failures(stack, reason)
        assert before == await kv_snapshot(stack)
        async with session.get(f"{base}/health") as response:
            assert response.status == 200
            assert "ok" == (await response.json())["status"]
        # The right token still works, so the refusals above were about credentials.
        async with session.post(
            f"{base}/v1/models/tiny-chat/scale",
            json={"replicas": 2},
            headers=stack.scheduler_headers,
        ) as response:
            assert response.status == 200
    assert before != await kv_snapshot(stack)


async def caravan(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "caravan_llm.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_cli_through_the_scheduler_with_and_without_the_token(
    stack: LocalStack, tmp_path: Path
):
    """`--scheduler` sends CARAVAN_API_TOKEN; without it or with a wrong one: one line, exit 1."""
    profile = tmp_path / "tiny.yaml"
    profile.write_text(PROFILE, encoding="utf-8")
    with_token = dict(stack.env)
    assert with_token["CARAVAN_API_TOKEN"] == stack.scheduler_api_token
    without = {k: v for k, v in with_token.items() if k != "CARAVAN_API_TOKEN"}
    wrong = {**without, "CARAVAN_API_TOKEN": WRONG}
    base = stack.scheduler_url
    before = await kv_snapshot(stack)

    code, out, err = await caravan(without, "submit", str(profile), "--scheduler", base)
    assert (1, "") == (code, out)
    assert [f"error: the scheduler at {base} needs a token: set CARAVAN_API_TOKEN"] == (
        err.splitlines()
    )
    code, out, err = await caravan(wrong, "submit", str(profile), "--scheduler", base)
    assert (1, "") == (code, out)
    refused = f"error: the scheduler at {base} refused CARAVAN_API_TOKEN: "
    assert [refused + "it is not one of the scheduler's API tokens"] == err.splitlines()
    assert WRONG not in err
    assert before == await kv_snapshot(stack)

    # CARAVAN_SCHEDULER_ADDR is --scheduler's default.
    by_default = {**with_token, "CARAVAN_SCHEDULER_ADDR": base}
    code, out, err = await caravan(by_default, "submit", str(profile))
    assert (0, "") == (code, err)
    assert "submitted tiny-chat" in out
    code, out, _ = await caravan(with_token, "list", "--scheduler", base)
    assert code == 0
    assert "tiny-chat" in out


async def test_cli_token_with_spaces_is_one_line(stack: LocalStack):
    """A pasted token with a space or newline is refused before any request, naming the variable."""
    env = {**stack.env, "CARAVAN_API_TOKEN": "two words"}
    code, _, err = await caravan(env, "list", "--scheduler", stack.scheduler_url)
    assert 1 == code
    assert [
        "error: CARAVAN_API_TOKEN holds spaces or control characters; set it to the token alone"
    ] == err.splitlines()


async def test_without_tokens_the_api_listens_on_loopback_only_and_says_so(
    stack: LocalStack, caplog
):
    """Asked for 0.0.0.0 with no token, the API binds 127.0.0.1 and logs it; with one, 0.0.0.0."""
    open_one = build_scheduler(
        SchedulerSettings(http_host="0.0.0.0", http_port=0, api_tokens=None, api_tokens_file=None),
        config=stack.config,
        consul=stack.scheduler.consul,
        nomad=stack.scheduler.nomad,
    )
    with caplog.at_level(logging.WARNING, logger="caravan_llm.scheduler.app"):
        async with running_scheduler(open_one):
            assert "127.0.0.1" == open_one.bound_host
    warned = [r for r in caplog.records if r.getMessage() == "scheduler_api_loopback_only"]
    assert 1 == len(warned)
    assert "0.0.0.0" == warned[0].requested_host

    guarded = build_scheduler(
        SchedulerSettings(http_host="0.0.0.0", http_port=0, api_tokens=SecretStr(TOKEN_A)),
        config=stack.config,
        consul=stack.scheduler.consul,
        nomad=stack.scheduler.nomad,
    )
    async with running_scheduler(guarded):
        assert "0.0.0.0" == guarded.bound_host
        url = f"http://127.0.0.1:{guarded.bound_port}/v1/models"
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as response:
                assert 401 == response.status
            async with session.get(url, headers={"Authorization": f"Bearer {TOKEN_A}"}) as answer:
                assert 200 == answer.status
