"""A whole caravan on one machine: devcluster, a scheduler and (optionally) a router.

Used by `caravan demo` and by the component tests, so both exercise the same
wiring a user runs. Everything runs in-process on one event loop, except the
engines, which devcluster's Nomad starts as real processes on its simulated
nodes:

- vLLM replicas (docker driver) map to the simulated vLLM engine, or with
  `vllm_engine="real"` to the real vLLM (CPU build, `make vllm`), started with
  the job's own arguments (devcluster/vllm_real.py lists what it maps);
- llama.cpp replicas (raw_exec) run the real `llama-server` with the tiny
  GGUF model when `scripts/build-llama-server.sh` has built them, else the
  simulated llama.cpp engine through a small wrapper script.

The nodes have the model files the example profiles name, as a real node
would (`/opt/models/tiny-llama.gguf` and the other GGUF paths): devcluster's
`node_root` (`<work dir>/node-root`) holds them, each the stack's tiny GGUF
(an empty stand-in for the simulated engine, which reads no file). So an
example profile copied from `examples/profiles/` runs as it is.

Secure by default, as a user's stack must be: the stack generates a router
API key and a scheduler API token (`LocalStack.router.api_key`,
`LocalStack.scheduler_api_token`, with ready-made `headers`), and `env` carries
`CARAVAN_API_TOKEN` so CLI subprocesses reach the scheduler's API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import stat
import sys
import tempfile
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from caravan_llm.cli.example_profiles import example_profiles_dir
from caravan_llm.common.consul_api import ConsulClient, ConsulSettings
from caravan_llm.common.errors import HashiError
from caravan_llm.common.nomad_api import NomadClient, NomadSettings
from caravan_llm.devcluster.cluster import ClusterConfig as DevClusterConfig
from caravan_llm.devcluster.cluster import DevCluster
from caravan_llm.devcluster.consul.server import ConsulConfig
from caravan_llm.devcluster.llama_server_build import find_llama_server
from caravan_llm.devcluster.nomad.settings import NomadServerSettings, default_nodes
from caravan_llm.devcluster.tiny_lora import TinyLora, write_adapter
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.tokens.registry import Tokenizers
from caravan_llm.router.wiring.app import RUNTIME, app_runner, create_app
from caravan_llm.scheduler.app import SchedulerProcess, build_scheduler
from caravan_llm.scheduler.cluster_config import (
    ClusterConfig,
    LlamaCppSettings,
    with_nomad_namespace,
)
from caravan_llm.scheduler.profile_policy import ProfilePolicy
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.settings import SchedulerSettings

# The Nomad Variables the example profiles' `secrets` name, with placeholder
# values, written as an operator would (`nomad var put`) so the examples start
# on devcluster. Nothing reads them but the replicas' templates.
EXAMPLE_VARIABLES: Mapping[str, Mapping[str, str]] = {
    "caravan/secrets/hf": {"HF_TOKEN": "hf_devcluster_placeholder_not_a_token"},
}

# Under the stack's work dir: the files every devcluster node has (`node-root/opt/x`).
NODE_ROOT_DIR = "node-root"


@dataclass(frozen=True, slots=True)
class StackOptions:
    cpu_nodes: int = 3
    gpu_nodes: int = 2
    gpus_per_node: int = 8
    gpu_model: str = "NVIDIA H100 80GB HBM3"
    # GPU nodes in their own Nomad node pool, as docs/deploy.md asks of a real
    # cluster, so CPU replicas (pool `default`) never land on them.
    gpu_node_pool: str = "gpu"
    # Failure detection as on a real cluster (Nomad's heartbeat_grace and
    # min_heartbeat_ttl: a dead node is down 10-30 s later; Consul's serf keeps
    # memberlist's defaults). Tests about something else may shorten them.
    heartbeat_grace_s: float = 10.0
    min_heartbeat_ttl_s: float = 10.0
    # Short timings so the other failures show up in seconds, not minutes.
    leader_ttl_s: float = 10.0
    resync_s: float = 5.0
    replace_lost_after_s: float = 20.0
    orphan_confirm_s: float = 3.0
    prefer_real_llama_server: bool = True
    # What vLLM replicas run: devcluster's simulated vLLM or the real one (`make vllm`).
    vllm_engine: Literal["simulated", "real"] = "simulated"
    autoscale: bool = True
    autoscale_tick_s: float = 2.0
    # Seconds the autoscaler gives each engine scrape (the scheduler's default: 2).
    autoscale_scrape_timeout_s: float = 2.0
    # False: start devcluster only (tests that run schedulers as processes).
    run_scheduler: bool = True
    # Router settings for an in-process router; None runs no router.
    router: RouterSettings | None = None
    # Receives the router's canonical line of each request (tests).
    request_log: Callable[[dict[str, Any]], None] | None = None
    work_dir: Path | None = None
    # Generate a router API key (unless `router` sets its own) and a scheduler API token.
    secure: bool = True
    # Nomad Variables written before the scheduler starts (path -> items).
    variables: Mapping[str, Mapping[str, str]] = field(default_factory=lambda: EXAMPLE_VARIABLES)
    # Consul ACLs on, each component with a token of its own policy (None: ACLs off).
    consul_acl: ConsulAcl | None = None

    # The cluster config's profile policy; None keeps the default.
    profile_policy: ProfilePolicy | None = None
    # Seconds between Nomad's restarts of a crashed engine (cluster config
    # `restart_delay_s`); None keeps Nomad's 15 s.
    restart_delay_s: int | None = None
    # Nomad ACLs on, the scheduler and router each with a token of its own policy
    # (None: devcluster's Nomad without ACLs).
    nomad_acl: NomadAcl | None = None
    # The Nomad namespace caravan runs in, as on a real cluster (docs/deploy.md
    # creates `caravan`): created first, and NOMAD_NAMESPACE of every component
    # and of `env`. `default` (Nomad's own) needs no creating.
    nomad_namespace: str = "default"


@dataclass(frozen=True, slots=True)
class ConsulAcl:
    """Run devcluster's Consul with ACLs (default deny) and each component on its own token.

    Each `*_rules` is a Consul policy's rules (HCL); the stack creates a
    policy and a token with exactly that policy for the component. The
    operator's token is what CLI subprocesses get (`env`'s CONSUL_HTTP_TOKEN).
    devcluster's Nomad registers services with the management token.
    """

    management_token: str = field(repr=False)
    scheduler_rules: str
    router_rules: str
    operator_rules: str


@dataclass(frozen=True, slots=True)
class NomadAcl:
    """Run devcluster's Nomad with ACLs and the scheduler and router each on its own token.

    Each `*_rules` is a Nomad ACL policy (HCL); the stack creates the policy
    `caravan-<component>` and a client token carrying exactly it. The operator
    (CLI subprocesses, `env`'s NOMAD_TOKEN, the example Variables) keeps the
    management token.
    """

    management_token: str = field(repr=False)
    scheduler_rules: str
    router_rules: str


def new_secret() -> str:
    """A fresh API key or token: 256 random bits, URL-safe (a valid bearer token)."""
    return secrets.token_urlsafe(32)


def bearer(secret: str | None) -> dict[str, str]:
    """The Authorization header presenting `secret` (none for None)."""
    return {} if secret is None else {"Authorization": f"Bearer {secret}"}


def with_api_key(settings: RouterSettings, key: str) -> RouterSettings:
    """Router settings that require `key`, unless they already name keys of their own."""
    if settings.api_keys:
        return settings
    return settings.model_copy(update={"api_keys": (SecretStr(key),)})


@dataclass(frozen=True, slots=True)
class LlamaCppEngine:
    """Which llama.cpp engine the stack runs, and the model path it is given."""

    binary: Path
    model: Path
    real: bool

    @property
    def description(self) -> str:
        if self.real:
            return f"the real llama-server ({self.binary}) with the tiny GGUF model"
        return "the simulated llama.cpp engine (run `make llama-server` for the real one)"


def _simulated_llama_server(folder: Path) -> Path:
    """A `llama-server` stand-in: the simulated engine with the same flags."""
    script = folder / "llama-server"
    script.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -m caravan_llm.devcluster.engine '
        '--flavor llamacpp "$@"\n',
        encoding="utf-8",
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def choose_llamacpp_engine(folder: Path, *, prefer_real: bool) -> LlamaCppEngine:
    build = find_llama_server() if prefer_real else None
    if build is not None:
        return LlamaCppEngine(binary=build.binary, model=build.model, real=True)
    # The simulated engine reads nothing from it, but checks that it exists (check_model_files).
    model = folder / "tiny-llama.gguf"
    model.touch()
    return LlamaCppEngine(binary=_simulated_llama_server(folder), model=model, real=False)


def provide_example_adapters(node_root: Path, document: Mapping[str, Any]) -> list[str]:
    """A tiny LoRA adapter (devcluster/tiny_lora.py: peft's files, the declared rank, weights
    seeded by the adapter's name) at every absolute adapter path the example profile names,
    under `node_root`; the paths provided. The simulated vLLM reads its adapter_config.json,
    the real vLLM (CPU build) loads it onto the tiny model."""
    provided = []
    for adapter in document.get("adapters") or []:
        source = adapter.get("source") if isinstance(adapter, dict) else None
        if not isinstance(source, str) or not source.startswith("/"):
            continue
        spec = TinyLora(seed=zlib.crc32(source.encode()), rank=adapter.get("rank") or 8)
        write_adapter(node_root / source.lstrip("/"), spec)
        provided.append(source)
    return provided


def provide_example_models(node_root: Path, engine: LlamaCppEngine) -> list[str]:
    """Put a model file at every absolute path an example llama.cpp profile names, and an
    adapter folder at every adapter path, under `node_root` (devcluster's stand-in for each
    node's file system); the paths provided."""
    provided = []
    for path in sorted(example_profiles_dir().glob("*.yaml")):
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        if isinstance(document, dict):
            provided += provide_example_adapters(node_root, document)
        if not isinstance(document, dict) or document.get("engine") != "llamacpp":
            continue
        model = document.get("model")
        if not isinstance(model, str) or not model.startswith("/"):
            continue
        target = node_root / model.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        if engine.real:
            target.symlink_to(engine.model)
        else:
            target.write_bytes(b"")
        provided.append(model)
    return provided


def cluster_config_for(engine: LlamaCppEngine) -> ClusterConfig:
    """Rendering settings for the local stack: its llama-server, fast checks and reschedules."""
    return ClusterConfig(
        datacenters=("dc1",),
        llamacpp=LlamaCppSettings(binary=str(engine.binary)),
        reschedule_delay_s=5,
        check_interval_s=1,
        check_timeout_s=1,
    )


def local_profile(profile: ModelProfile, engine: LlamaCppEngine) -> ModelProfile:
    """A CPU llama.cpp profile pointed at the stack's model file."""
    if profile.engine.value == "llamacpp" and not profile.uses_gpu:
        return profile.model_copy(update={"model": str(engine.model)})
    return profile


@dataclass(frozen=True, slots=True)
class RouterHandle:
    """A router served in-process by the stack."""

    port: int
    registry: CollectorRegistry
    # The first of the router's API keys; None when the router is open.
    api_key: str | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What a client sends to be let in."""
        return bearer(self.api_key)


@contextlib.asynccontextmanager
async def running_router(
    settings: RouterSettings,
    consul: ConsulClient,
    request_log: Callable[[dict[str, Any]], None] | None = None,
    nomad: NomadClient | None = None,
) -> AsyncIterator[RouterHandle]:
    """Serve a router on the running loop, registered in Consul as `caravan-router`;
    with `nomad` it reads the engines' API keys from Nomad Variables. With KV events on it
    has its tokenizers, as the router process has (exact prefix routing)."""
    registry = CollectorRegistry()
    tokenizers = Tokenizers() if settings.kv_events else None
    app = create_app(
        settings,
        consul=consul,
        registry=registry,
        request_log=request_log,
        nomad=nomad,
        prompt_tokens=tokenizers,
    )
    runtime = app[RUNTIME]
    runner = app_runner(app, settings)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        port = int(runner.addresses[0][1])
        if settings.register_service:
            await runtime.register(port)
        try:
            key = settings.api_keys[0].get_secret_value() if settings.api_keys else None
            yield RouterHandle(port=port, registry=registry, api_key=key)
        finally:
            with contextlib.suppress(HashiError):
                await runtime.deregister()
    finally:
        await runner.cleanup()
        if tokenizers is not None:
            tokenizers.close()


@dataclass(slots=True)
class LocalStack:
    """A running devcluster + scheduler; `env` points clients at it."""

    cluster: DevCluster
    scheduler: SchedulerProcess
    engine: LlamaCppEngine
    config: ClusterConfig
    work_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    router: RouterHandle | None = None
    # The scheduler API's bearer token; None when the stack is not secure.
    scheduler_api_token: str | None = field(default=None, repr=False)
    # With StackOptions.consul_acl: component ("scheduler", "router", "operator") ->
    # its Consul token as Consul returned it (AccessorID, SecretID, Policies).
    consul_tokens: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, repr=False)
    # With StackOptions.nomad_acl: component ("scheduler", "router") -> its Nomad token
    # as Nomad returned it (AccessorID, SecretID, Policies).
    nomad_tokens: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def nomad_addr(self) -> str:
        return self.cluster.nomad.address

    @property
    def node_root(self) -> Path:
        """devcluster's stand-in for the nodes' files: `<node_root>/opt/x` is the nodes' /opt/x."""
        return self.work_dir / NODE_ROOT_DIR

    @property
    def scheduler_url(self) -> str:
        return f"http://127.0.0.1:{self.scheduler.bound_port}"

    @property
    def scheduler_headers(self) -> dict[str, str]:
        """What a client of the scheduler's API sends to be let in."""
        return bearer(self.scheduler_api_token)

    @property
    def consul_addr(self) -> str:
        return self.cluster.consul.http_addr


def _client_env(cluster: DevCluster) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NOMAD_", "CONSUL_")) or k.startswith("CONSUL_HTTP_SSL")
    }
    env.pop("CONSUL_HTTP_SSL", None)
    # Clients of this stack reach this stack's scheduler, with this stack's token or none.
    env.pop("CARAVAN_SCHEDULER_ADDR", None)
    env.pop("CARAVAN_API_TOKEN", None)
    env["NOMAD_ADDR"] = cluster.nomad.address
    env["CONSUL_HTTP_ADDR"] = cluster.consul.http_addr
    return env


@contextlib.asynccontextmanager
async def local_stack(options: StackOptions | None = None) -> AsyncIterator[LocalStack]:
    """Start devcluster and a scheduler; stop both (and every engine process) on exit."""
    options = options or StackOptions()
    with contextlib.ExitStack() as cleanup:
        work_dir = options.work_dir or Path(
            cleanup.enter_context(tempfile.TemporaryDirectory(prefix="caravan-"))
        )
        engine = choose_llamacpp_engine(work_dir, prefer_real=options.prefer_real_llama_server)
        node_root = work_dir / NODE_ROOT_DIR
        provide_example_models(node_root, engine)
        config = cluster_config_for(engine)
        acl = options.consul_acl
        if options.profile_policy is not None:
            config = config.model_copy(update={"profile_policy": options.profile_policy})
        if options.restart_delay_s is not None:
            config = config.model_copy(update={"restart_delay_s": options.restart_delay_s})
        dev_config = DevClusterConfig(
            consul=ConsulConfig(
                session_ttl_min_s=1.0,
                management_token=acl.management_token if acl is not None else None,
            ),
            nomad=NomadServerSettings(
                nodes=default_nodes(
                    cpu_nodes=options.cpu_nodes,
                    gpu_nodes=options.gpu_nodes,
                    gpus_per_node=options.gpus_per_node,
                    gpu_model=options.gpu_model,
                    gpu_node_pool=options.gpu_node_pool,
                ),
                heartbeat_grace_s=options.heartbeat_grace_s,
                min_heartbeat_ttl_s=options.min_heartbeat_ttl_s,
                data_dir=work_dir / "nomad",
                token=None if options.nomad_acl is None else options.nomad_acl.management_token,
                vllm_engine=options.vllm_engine,
                node_root=node_root,
                # A profile naming a model the nodes lack fails as on a real node.
                check_model_files=True,
            ),
        )
        token = new_secret() if options.secure else None
        async with DevCluster(dev_config) as cluster:
            env = _client_env(cluster)
            if options.nomad_namespace != "default":
                await _create_nomad_namespace(cluster, options)
                env["NOMAD_NAMESPACE"] = options.nomad_namespace
                config = with_nomad_namespace(config, options.nomad_namespace)
            if token is not None:
                env["CARAVAN_API_TOKEN"] = token
            consul_tokens = {} if acl is None else await _create_consul_tokens(cluster, acl)
            scheduler_env, router_env = dict(env), dict(env)
            if consul_tokens:
                scheduler_env["CONSUL_HTTP_TOKEN"] = consul_tokens["scheduler"]["SecretID"]
                router_env["CONSUL_HTTP_TOKEN"] = consul_tokens["router"]["SecretID"]
                env["CONSUL_HTTP_TOKEN"] = consul_tokens["operator"]["SecretID"]
            nomad_tokens: dict[str, Mapping[str, Any]] = {}
            if options.nomad_acl is not None:
                env["NOMAD_TOKEN"] = options.nomad_acl.management_token
                nomad_tokens = await _create_nomad_tokens(cluster, options.nomad_acl)
                scheduler_env["NOMAD_TOKEN"] = str(nomad_tokens["scheduler"]["SecretID"])
                router_env["NOMAD_TOKEN"] = str(nomad_tokens["router"]["SecretID"])
            async with (
                ConsulClient(ConsulSettings.from_env(scheduler_env)) as consul,
                ConsulClient(ConsulSettings.from_env(router_env)) as router_consul,
                NomadClient(NomadSettings.from_env(env)) as nomad,
                contextlib.AsyncExitStack() as clients,
            ):
                scheduler_nomad, router_nomad = nomad, nomad
                if nomad_tokens:
                    scheduler_nomad = await clients.enter_async_context(
                        NomadClient(NomadSettings.from_env(scheduler_env))
                    )
                    router_nomad = await clients.enter_async_context(
                        NomadClient(NomadSettings.from_env(router_env))
                    )
                for path, items in options.variables.items():
                    await nomad.put_variable(path, items)
                scheduler = build_scheduler(
                    SchedulerSettings(
                        http_port=0,
                        kv_prefix="caravan/",
                        leader_ttl_s=options.leader_ttl_s,
                        leader_lock_delay_s=1.0,
                        autoscale=options.autoscale,
                        autoscale_tick_s=options.autoscale_tick_s,
                        autoscale_scrape_timeout_s=options.autoscale_scrape_timeout_s,
                        resync_s=options.resync_s,
                        replace_lost_after_s=options.replace_lost_after_s,
                        orphan_confirm_s=options.orphan_confirm_s,
                        requeue_s=1.0,
                        api_tokens=None if token is None else SecretStr(token),
                        api_tokens_file=None,
                    ),
                    config=config,
                    consul=consul,
                    nomad=scheduler_nomad,
                )
                async with contextlib.AsyncExitStack() as parts:
                    await parts.enter_async_context(
                        running_scheduler(scheduler, enabled=options.run_scheduler)
                    )
                    router = None
                    if options.router is not None:
                        settings = options.router
                        if options.secure:
                            settings = with_api_key(settings, new_secret())
                        router = await parts.enter_async_context(
                            running_router(
                                settings, router_consul, options.request_log, nomad=router_nomad
                            )
                        )
                    yield LocalStack(
                        cluster=cluster,
                        scheduler=scheduler,
                        engine=engine,
                        config=config,
                        work_dir=work_dir,
                        env=env,
                        router=router,
                        scheduler_api_token=token,
                        consul_tokens=consul_tokens,
                        nomad_tokens=nomad_tokens,
                    )


async def _create_consul_tokens(
    cluster: DevCluster, acl: ConsulAcl
) -> dict[str, Mapping[str, Any]]:
    """A policy and a token per component, through Consul's ACL API (management token)."""
    headers = {"X-Consul-Token": acl.management_token}
    base = f"http://{cluster.consul.http_addr}/v1/acl"
    tokens: dict[str, Mapping[str, Any]] = {}
    async with aiohttp.ClientSession(headers=headers) as session:
        for component, rules in (
            ("scheduler", acl.scheduler_rules),
            ("router", acl.router_rules),
            ("operator", acl.operator_rules),
        ):
            name = f"caravan-{component}"
            await _acl_write(
                session, "PUT", f"{base}/policy", {"Name": name, "Rules": rules},
                f"Consul refused policy {name}",
            )  # fmt: skip
            tokens[component] = await _acl_write(
                session, "PUT", f"{base}/token",
                {"Description": name, "Policies": [{"Name": name}]},
                f"Consul refused the token of {name}",
            )  # fmt: skip
    return tokens


async def _acl_write(
    session: aiohttp.ClientSession, method: str, url: str, body: Mapping[str, Any], refused: str
) -> Mapping[str, Any]:
    """One ACL API write (Consul's or Nomad's); its JSON answer, {} when it has none."""
    async with session.request(method, url, json=body) as response:
        text = await response.text()
        if response.status != 200:
            msg = f"{refused}: {text}"
            raise RuntimeError(msg)
    answer: Mapping[str, Any] = json.loads(text) if text.strip() else {}
    return answer


async def _create_nomad_namespace(cluster: DevCluster, options: StackOptions) -> None:
    """`nomad namespace apply NAME` (with the management token when ACLs are on)."""
    acl = options.nomad_acl
    headers = {} if acl is None else {"X-Nomad-Token": acl.management_token}
    name = options.nomad_namespace
    async with aiohttp.ClientSession(headers=headers) as session:
        await _acl_write(
            session, "PUT", f"{cluster.nomad.address}/v1/namespace/{name}",
            {"Name": name, "Description": "caravan"}, f"Nomad refused namespace {name}",
        )  # fmt: skip


async def _create_nomad_tokens(cluster: DevCluster, acl: NomadAcl) -> dict[str, Mapping[str, Any]]:
    """A policy and a client token per component, through Nomad's ACL API (management token)."""
    headers = {"X-Nomad-Token": acl.management_token}
    base = f"{cluster.nomad.address}/v1/acl"
    tokens: dict[str, Mapping[str, Any]] = {}
    async with aiohttp.ClientSession(headers=headers) as session:
        for component, rules in (("scheduler", acl.scheduler_rules), ("router", acl.router_rules)):
            name = f"caravan-{component}"
            await _acl_write(
                session, "POST", f"{base}/policy/{name}",
                {"Name": name, "Description": name, "Rules": rules},
                f"Nomad refused policy {name}",
            )  # fmt: skip
            tokens[component] = await _acl_write(
                session, "POST", f"{base}/token",
                {"Name": name, "Type": "client", "Policies": [name]},
                f"Nomad refused the token of {name}",
            )  # fmt: skip
    return tokens


@contextlib.asynccontextmanager
async def running_scheduler(
    scheduler: SchedulerProcess, *, enabled: bool = True
) -> AsyncIterator[None]:
    """Run a scheduler on this loop until the block ends; fails fast if it cannot start."""
    if not enabled:
        yield
        return
    task = asyncio.create_task(scheduler.run())
    ready = asyncio.create_task(scheduler.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
