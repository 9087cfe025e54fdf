"""The `nomad` and `consul` CLI commands the deployment docs use, as the HTTP API calls they make.

Neither CLI can be installed here, so the executable-docs test puts this file
on PATH as `nomad` and `consul` (small shims) and bash runs the documented
commands literally. Each documented command form is one row of `TABLE`; a
form without a row exits 2 ("no translation"), so a doc that grows a new
command fails the test until the table knows it. `translate` is pure and
unit-tested (test_deploy_doc_commands.py); `main` sends the request.

One row is not an HTTP call: `nomad job run` of caravan's own jobspecs starts
the process the jobspec's task runs (`caravan scheduler` / `caravan router`
with the jobspec's args and env, and the tokens its template renders from
the job's Nomad Variable), because devcluster has no Docker to run the
image in. It reads the variable with the caller's token, as Nomad's template
runner reads it for the task.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOMAD_ADDR = "http://127.0.0.1:4646"
CONSUL_ADDR = "http://127.0.0.1:8500"


class NoTranslation(Exception):
    """A documented command the table has no row for."""


@dataclass(frozen=True)
class Request:
    """One HTTP API call: the agent ("nomad" or "consul"), method, path, JSON or raw body."""

    agent: str
    method: str
    path: str
    body: Any = None
    raw: bytes | None = None
    # How the CLI prints the answer: "json" (-json / -format=json) or "quiet".
    output: str = "quiet"


@dataclass(frozen=True)
class Launch:
    """`nomad job run` of a caravan jobspec: the process its task runs."""

    component: str  # "scheduler" or "router"
    variables: Mapping[str, str] = field(default_factory=dict)
    # The -namespace flag; without it the job's own (`-var namespace=`), as Nomad decides.
    namespace: str = ""

    @property
    def job_namespace(self) -> str:
        return self.namespace or self.variables.get("namespace") or "default"


def parse_flags(
    args: Sequence[str], with_value: set[str], boolean: set[str]
) -> tuple[dict[str, list[str]], list[str]]:
    """Go's flag package: `-name value`, `-name=value` or `--name`, flags before the arguments."""
    flags: dict[str, list[str]] = {}
    rest = list(args)
    while rest and rest[0].startswith("-") and rest[0] != "-":
        token = rest.pop(0).lstrip("-")
        name, eq, value = token.partition("=")
        if name in boolean:
            flags.setdefault(name, []).append(value if eq else "true")
        elif name in with_value:
            if not eq:
                if not rest:
                    raise NoTranslation(f"flag -{name} needs a value")
                value = rest.pop(0)
            flags.setdefault(name, []).append(value)
        else:
            raise NoTranslation(f"unknown flag -{name}")
    return flags, rest


def _file_or_text(value: str, cwd: Path) -> str:
    """The CLIs' `@file` convention: the file's text, else the value itself."""
    return (cwd / value[1:]).read_text(encoding="utf-8") if value.startswith("@") else value


def _one(flags: Mapping[str, list[str]], name: str, default: str = "") -> str:
    return flags.get(name, [default])[-1]


def nomad_acl_policy_apply(args: Sequence[str], cwd: Path) -> Request:
    flags, rest = parse_flags(args, {"description", "namespace", "job", "group", "task"}, set())
    name, file = rest
    body: dict[str, Any] = {
        "Name": name,
        "Description": _one(flags, "description"),
        "Rules": (cwd / file).read_text(encoding="utf-8"),
    }
    if "job" in flags:
        body["JobACL"] = {
            "Namespace": _one(flags, "namespace", "default"),
            "JobID": _one(flags, "job"),
            "Group": _one(flags, "group"),
            "Task": _one(flags, "task"),
        }
    return Request("nomad", "POST", f"/v1/acl/policy/{name}", body)


def nomad_acl_token_create(args: Sequence[str], cwd: Path) -> Request:
    flags, rest = parse_flags(args, {"name", "type", "policy"}, {"json", "global"})
    if rest:
        raise NoTranslation(f"unexpected arguments {rest}")
    body = {
        "Name": _one(flags, "name"),
        "Type": _one(flags, "type", "client"),
        "Policies": flags.get("policy", []),
        "Global": "global" in flags,
    }
    return Request("nomad", "POST", "/v1/acl/token", body, output="json" if "json" in flags else "")


def _query(params: Mapping[str, str]) -> str:
    given = "&".join(f"{k}={urllib.parse.quote(v)}" for k, v in params.items() if v)
    return f"?{given}" if given else ""


def nomad_var_put(args: Sequence[str], cwd: Path) -> Request:
    flags, rest = parse_flags(args, {"namespace"}, {"force"})
    path, *pairs = rest
    items = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise NoTranslation(f"item {pair!r} is not key=value")
        items[key] = _file_or_text(value, cwd)
    namespace = _one(flags, "namespace", "default")
    # Without -force the CLI writes only a variable that does not exist yet; the
    # -namespace flag is the request's namespace too (the API client's query).
    query = _query({"cas": "" if "force" in flags else "0", "namespace": _one(flags, "namespace")})
    body = {"Namespace": namespace, "Path": path, "Items": items}
    return Request("nomad", "PUT", f"/v1/var/{path}{query}", body)


def nomad_namespace_apply(args: Sequence[str], cwd: Path) -> Request:
    """`nomad namespace apply [-description D] NAME`: a new namespace (the CLI reads an
    existing one first and changes only what is given; the docs create it)."""
    flags, rest = parse_flags(args, {"description"}, set())
    if len(rest) != 1 or (cwd / rest[0]).is_file():
        raise NoTranslation("namespace apply takes one NAME (specification files have no row)")
    body = {"Name": rest[0], "Description": _one(flags, "description")}
    return Request("nomad", "PUT", "/v1/namespace", body)


def nomad_job_run(args: Sequence[str], cwd: Path) -> Launch:
    flags, rest = parse_flags(args, {"var", "namespace"}, set())
    (jobspec,) = rest
    component = {
        "caravan-scheduler.nomad.hcl": "scheduler",
        "caravan-router.nomad.hcl": "router",
    }.get(Path(jobspec).name)
    if component is None:
        raise NoTranslation(f"no process for jobspec {jobspec}")
    variables = dict(v.partition("=")[::2] for v in flags.get("var", []))
    return Launch(component, variables, namespace=_one(flags, "namespace"))


def consul_acl_policy_create(args: Sequence[str], cwd: Path) -> Request:
    flags, rest = parse_flags(args, {"name", "rules", "description"}, set())
    if rest:
        raise NoTranslation(f"unexpected arguments {rest}")
    body = {
        "Name": _one(flags, "name"),
        "Description": _one(flags, "description"),
        "Rules": _file_or_text(_one(flags, "rules"), cwd),
    }
    return Request("consul", "PUT", "/v1/acl/policy", body)


def consul_acl_token_create(args: Sequence[str], cwd: Path) -> Request:
    flags, rest = parse_flags(args, {"description", "policy-name", "format"}, set())
    if rest:
        raise NoTranslation(f"unexpected arguments {rest}")
    body = {
        "Description": _one(flags, "description"),
        "Policies": [{"Name": name} for name in flags.get("policy-name", [])],
    }
    output = "json" if _one(flags, "format") == "json" else ""
    return Request("consul", "PUT", "/v1/acl/token", body, output=output)


def consul_kv_put(args: Sequence[str], cwd: Path) -> Request:
    _, rest = parse_flags(args, set(), set())
    key, value = rest
    raw = (cwd / value[1:]).read_bytes() if value.startswith("@") else value.encode()
    return Request("consul", "PUT", f"/v1/kv/{key}", raw=raw)


Row = Callable[[Sequence[str], Path], "Request | Launch"]
TABLE: Mapping[tuple[str, ...], Row] = {
    ("nomad", "acl", "policy", "apply"): nomad_acl_policy_apply,
    ("nomad", "acl", "token", "create"): nomad_acl_token_create,
    ("nomad", "var", "put"): nomad_var_put,
    ("nomad", "namespace", "apply"): nomad_namespace_apply,
    ("nomad", "job", "run"): nomad_job_run,
    ("consul", "acl", "policy", "create"): consul_acl_policy_create,
    ("consul", "acl", "token", "create"): consul_acl_token_create,
    ("consul", "kv", "put"): consul_kv_put,
}


def translate(argv: Sequence[str], cwd: Path) -> Request | Launch:
    """The API call (or process) of one documented CLI command (pure but for reading files)."""
    for size in (4, 3):
        row = TABLE.get(tuple(argv[:size]))
        if row is not None:
            return row(argv[size:], cwd)
    raise NoTranslation(" ".join(argv[:4]))


# -- sending ---------------------------------------------------------------------------


def _send(request: Request, env: Mapping[str, str]) -> bytes:
    if request.agent == "nomad":
        base, header, token = env.get("NOMAD_ADDR", NOMAD_ADDR), "X-Nomad-Token", "NOMAD_TOKEN"
    else:
        base = env.get("CONSUL_HTTP_ADDR", CONSUL_ADDR)
        base = base if "://" in base else f"http://{base}"
        header, token = "X-Consul-Token", "CONSUL_HTTP_TOKEN"
    data = request.raw if request.raw is not None else json.dumps(request.body).encode()
    path = request.path
    if request.agent == "nomad" and env.get("NOMAD_NAMESPACE") and "namespace=" not in path:
        # The Nomad API client sends NOMAD_NAMESPACE with every request.
        path += ("&" if "?" in path else "?") + f"namespace={env['NOMAD_NAMESPACE']}"
    call = urllib.request.Request(f"{base}{path}", data=data, method=request.method)
    if env.get(token):
        call.add_header(header, env[token])
    try:
        with urllib.request.urlopen(call, timeout=30) as answer:
            return bytes(answer.read())
    except urllib.error.HTTPError as exc:
        sys.stderr.write(f"Error: Unexpected response code: {exc.code} ({exc.read().decode()})\n")
        raise SystemExit(1) from None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _launch(launch: Launch, env: Mapping[str, str]) -> None:
    """Start the jobspec's task as a process; its pid and port go to $DOCS_LAUNCH_DIR."""
    job = f"caravan-{launch.component}"
    namespace = launch.job_namespace
    answer = _send(Request("nomad", "GET", f"/v1/var/nomad/jobs/{job}?namespace={namespace}"), env)
    items: Mapping[str, str] = json.loads(answer)["Items"]
    folder = Path(env["DOCS_LAUNCH_DIR"])
    secrets = folder / f"{job}-secrets"
    secrets.mkdir(parents=True, exist_ok=True)
    task_env = {k: v for k, v in env.items() if not k.startswith(("NOMAD_", "CONSUL_"))}
    task_env.update(NOMAD_ADDR=env["NOMAD_ADDR"], CONSUL_HTTP_ADDR=env["CONSUL_HTTP_ADDR"])
    # Nomad gives every task its job's namespace (the jobspecs leave it to Nomad).
    task_env["NOMAD_NAMESPACE"] = namespace
    port = _free_port()
    prefix = launch.variables.get("kv_prefix", "caravan/")
    # The jobspec's template: each key of the variable, as the task's env.
    if items.get("nomad_token"):
        task_env["NOMAD_TOKEN"] = items["nomad_token"]
    if items.get("consul_token"):
        task_env["CONSUL_HTTP_TOKEN"] = items["consul_token"]
    if launch.component == "scheduler":
        (secrets / "cluster.yaml").write_text(launch.variables.get("cluster_config", "{}"))
        if items.get("api_tokens"):
            (secrets / "api-tokens").write_text(items["api_tokens"])
            task_env["CARAVAN_SCHEDULER_API_TOKENS_FILE"] = str(secrets / "api-tokens")
        args = ["scheduler", "--http-host", "127.0.0.1", "--http-port", str(port)]
        args += ["--kv-prefix", prefix, "--cluster-config", str(secrets / "cluster.yaml")]
    else:
        task_env["CARAVAN_ROUTER_REGISTER_SERVICE"] = "false"
        if items.get("api_keys"):
            task_env["CARAVAN_ROUTER_API_KEYS"] = items["api_keys"]
        args = ["router", "--host", "127.0.0.1", "--port", str(port), "--kv-prefix", prefix]
    log = (folder / f"{job}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "caravan_llm.cli", *args],
        env=task_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    record = {"pid": process.pid, "port": port, "namespace": namespace}
    (folder / f"{job}.json").write_text(json.dumps(record))
    sys.stdout.write(f"==> started {job} (pid {process.pid})\n")


def main(argv: Sequence[str]) -> int:
    env = os.environ
    try:
        action = translate(argv, Path.cwd())
    except NoTranslation as exc:
        sys.stderr.write(f"doc_commands: no translation for `{' '.join(argv)}` ({exc})\n")
        return 2
    if isinstance(action, Launch):
        _launch(action, env)
        return 0
    answer = _send(action, env)
    if action.output == "json":
        sys.stdout.write(answer.decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
