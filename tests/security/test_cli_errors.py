"""TLS and token misconfiguration: one line naming the variable and the file, exit 1 (item 8)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tls_material import TlsMaterial

from caravan_llm.cli.main import main
from caravan_llm.devcluster.consul.server import ConsulConfig, ConsulServer

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "examples" / "profiles" / "tiny-llamacpp-cpu.yaml"
MISSING = "/nonexistent/ca.pem"
# Nothing listens there: a command that got past its settings would fail differently.
NOWHERE = {"CONSUL_HTTP_ADDR": "127.0.0.1:9", "NOMAD_ADDR": "http://127.0.0.1:9"}


def cases(tls: TlsMaterial) -> list[tuple[dict[str, str], str]]:
    """(environment, the one error line expected) for each misconfiguration."""
    cert, key, other, encrypted, junk = (
        str(tls.cert),
        str(tls.key),
        str(tls.other_key),
        str(tls.encrypted_key),
        str(tls.junk),
    )
    return [
        ({"CONSUL_CACERT": MISSING}, f"CONSUL_CACERT: file {MISSING}: does not exist"),
        ({"CONSUL_CACERT": junk}, f"CONSUL_CACERT: file {junk}: holds no PEM certificate"),
        ({"CONSUL_CAPATH": "/nonexistent"}, "CONSUL_CAPATH: directory /nonexistent does not exist"),
        (
            {"CONSUL_CLIENT_CERT": junk, "CONSUL_CLIENT_KEY": key},
            f"CONSUL_CLIENT_CERT: file {junk}: is not a PEM certificate",
        ),
        (
            {"CONSUL_CLIENT_CERT": cert, "CONSUL_CLIENT_KEY": other},
            f"CONSUL_CLIENT_KEY: file {other}: is not the private key of CONSUL_CLIENT_CERT",
        ),
        (
            {"CONSUL_CLIENT_CERT": cert, "CONSUL_CLIENT_KEY": junk},
            f"CONSUL_CLIENT_KEY: file {junk}: is not a PEM private key",
        ),
        (
            {"CONSUL_CLIENT_CERT": cert, "CONSUL_CLIENT_KEY": encrypted},
            f"CONSUL_CLIENT_KEY: file {encrypted}: is encrypted; give an unencrypted PEM key",
        ),
        (
            {"CONSUL_CLIENT_CERT": cert, "CONSUL_CLIENT_KEY": MISSING},
            f"CONSUL_CLIENT_KEY: file {MISSING}: does not exist",
        ),
        (
            {"CONSUL_HTTP_TOKEN_FILE": MISSING},
            f"CONSUL_HTTP_TOKEN_FILE: file {MISSING} cannot be read: No such file or directory",
        ),
        ({"NOMAD_CACERT": MISSING}, f"NOMAD_CACERT: file {MISSING}: does not exist"),
        ({"NOMAD_CACERT": junk}, f"NOMAD_CACERT: file {junk}: holds no PEM certificate"),
        (
            {"NOMAD_CLIENT_CERT": junk, "NOMAD_CLIENT_KEY": key},
            f"NOMAD_CLIENT_CERT: file {junk}: is not a PEM certificate",
        ),
        (
            {"NOMAD_CLIENT_CERT": cert, "NOMAD_CLIENT_KEY": other},
            f"NOMAD_CLIENT_KEY: file {other}: is not the private key of NOMAD_CLIENT_CERT",
        ),
        (
            {"NOMAD_CLIENT_CERT": cert, "NOMAD_CLIENT_KEY": encrypted},
            f"NOMAD_CLIENT_KEY: file {encrypted}: is encrypted; give an unencrypted PEM key",
        ),
    ]


def clean_environ() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CONSUL_", "NOMAD_", "CARAVAN_SCHEDULER", "CARAVAN_API_TOKEN"))
    }


MODEL_COMMANDS = [
    ["list"],
    ["status", "m"],
    ["delete", "m"],
    ["scale", "m", "1"],
    ["submit", str(PROFILE)],
]


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: c[0])
def test_every_tls_misconfiguration_is_one_line_for_the_model_commands(
    command: list[str], tls_material: TlsMaterial, capsys, monkeypatch
):
    """Each bad TLS variable gives exactly `error: VARIABLE: file PATH: problem` and exit 1."""
    for name in list(os.environ):
        if name.startswith(("CONSUL_", "NOMAD_", "CARAVAN_SCHEDULER_ADDR")):
            monkeypatch.delenv(name)
    for environ, expected in cases(tls_material):
        with monkeypatch.context() as scoped:
            for name, value in {**NOWHERE, **environ}.items():
                scoped.setenv(name, value)
            code = main(command)
        captured = capsys.readouterr()
        assert (1, "", [f"error: {expected}"]) == (code, captured.out, captured.err.splitlines())


def run_caravan(environ: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "caravan_llm.cli", *args],
        env={**clean_environ(), **NOWHERE, **environ},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


SUBCOMMANDS = [
    ["list"],
    ["status", "m"],
    ["delete", "m"],
    ["scale", "m", "1"],
    ["submit", str(PROFILE)],
    ["scheduler", "--http-port", "0"],
    ["router", "--port", "0"],
    ["demo", "--real", "--once"],
]


@pytest.mark.slow
@pytest.mark.parametrize("command", SUBCOMMANDS, ids=lambda c: c[0])
def test_every_subcommand_reports_a_bad_tls_file_in_one_line_without_traceback(
    command: list[str], tls_material: TlsMaterial
):
    """A real process per subcommand: one stderr line naming the variable and file, exit 1."""
    checks = [({"CONSUL_CACERT": MISSING}, f"CONSUL_CACERT: file {MISSING}: does not exist")]
    if command[0] != "router":  # the router never talks to Nomad
        other = str(tls_material.other_key)
        checks.append(
            (
                {"NOMAD_CLIENT_CERT": str(tls_material.cert), "NOMAD_CLIENT_KEY": other},
                f"NOMAD_CLIENT_KEY: file {other}: is not the private key of NOMAD_CLIENT_CERT",
            )
        )
    for environ, expected in checks:
        done = run_caravan(environ, *command)
        assert (1, [f"error: {expected}"]) == (done.returncode, done.stderr.splitlines())


def test_the_issue_reproduction_caravan_list_with_a_missing_ca(tls_material: TlsMaterial):
    """`CONSUL_CACERT=/nonexistent.pem caravan list` names the file instead of a traceback."""
    done = run_caravan({"CONSUL_CACERT": "/nonexistent.pem"}, "list")
    assert "Traceback" not in done.stderr
    assert (1, "error: CONSUL_CACERT: file /nonexistent.pem: does not exist\n") == (
        done.returncode,
        done.stderr,
    )


def test_a_bad_scheduler_token_file_stops_the_scheduler_in_one_line(tmp_path: Path):
    """An API token file that accepts nothing names its variable and file; nothing starts."""
    empty = tmp_path / "tokens"
    empty.write_text("# no token yet\n", encoding="utf-8")
    done = run_caravan({"CARAVAN_SCHEDULER_API_TOKENS_FILE": str(empty)}, "scheduler")
    assert (1, [f"error: CARAVAN_SCHEDULER_API_TOKENS_FILE {empty}: the file holds no token"]) == (
        done.returncode,
        done.stderr.splitlines(),
    )
    done = run_caravan({"CARAVAN_SCHEDULER_API_TOKENS": "short"}, "scheduler")
    assert 1 == done.returncode
    assert ["CARAVAN_SCHEDULER_API_TOKENS: token 1"] == [
        line.split(": the token")[0].removeprefix("error: ") for line in done.stderr.splitlines()
    ]
    assert "short" not in done.stderr


async def test_a_wrong_consul_token_is_one_line_naming_the_variable():
    """Consul refusing CONSUL_HTTP_TOKEN gives one line that says which token to check."""
    async with ConsulServer(ConsulConfig(management_token="m" * 32)) as server:
        environ = {
            "CONSUL_HTTP_ADDR": server.http_addr,
            "CONSUL_HTTP_TOKEN": "not-the-management-token",
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "caravan_llm.cli",
            "list",
            env={**clean_environ(), **NOWHERE, **environ},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(process.communicate(), 60)
    lines = err.decode().splitlines()
    assert 1 == process.returncode
    assert 1 == len(lines), lines
    assert lines[0].startswith("error: consul ")
    assert "permission denied" in lines[0]
    assert lines[0].endswith("(check CONSUL_HTTP_TOKEN and NOMAD_TOKEN)")
    assert "not-the-management-token" not in lines[0]
