"""Task drivers: how a task's `Config` becomes a local process.

* `raw_exec` and `exec` run `command` with `args` (no chroot or cgroups here).
* `docker` has no engine on these machines, so images map to local commands
  through a table (built-in defaults, or a YAML/JSON file): vLLM images run the
  simulated vLLM engine, or with `real_vllm` set the real vLLM with the task's
  own arguments (devcluster/vllm_real.py), `lmsysorg/sglang` images the simulated SGLang server
  (the image's `entrypoint`, `python3 -m sglang.launch_server`, is replaced by
  the simulator; `args` pass through), llama.cpp server images run the real
  `llama-server` when one was built (else the simulated one), and caravan's own
  image (`caravan-llm:*`) its entrypoint `caravan` (`python -m caravan_llm.cli`
  with this interpreter; a replica's KV relay). The container port given as
  `--port <To>` becomes the host port, and `--host` the node's address, as
  Docker's port mapping would make it look from outside. An image with no
  mapping fails the task with a `Driver Failure`.

Every process gets its own session (process group), so a node kill or a stop
reaches the whole tree; stdout and stderr go to `alloc/logs/<task>.stdout.0`
and `.stderr.0` like Nomad's log collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from caravan_llm.devcluster import vllm_real
from caravan_llm.devcluster.engine.lora import NODE_ROOT_ENV
from caravan_llm.devcluster.engine.model_file import CHECK_MODEL_FILE_ENV
from caravan_llm.devcluster.llama_server_build import find_llama_server
from caravan_llm.devcluster.nomad.model import AllocatedPort

ENGINE_MODULE = "caravan_llm.devcluster.engine"
# Host variables Nomad keeps from tasks by default (`env.denylist`).
ENV_DENYLIST = frozenset(
    {
        "CONSUL_TOKEN",
        "CONSUL_HTTP_TOKEN",
        "CONSUL_LICENSE",
        "NOMAD_TOKEN",
        "NOMAD_LICENSE",
        "VAULT_TOKEN",
        "VAULT_LICENSE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "GOOGLE_APPLICATION_CREDENTIALS",
    }
)
SUPPORTED_DRIVERS = ("raw_exec", "exec", "docker")


class DriverError(Exception):
    """The driver could not start the task; the text becomes the `Driver Failure` event."""

    def __init__(self, message: str, *, recoverable: bool = True) -> None:
        super().__init__(message)
        self.recoverable = recoverable


@dataclass(frozen=True, slots=True)
class ImageMapping:
    """Which local program stands in for a container image (glob on the image name)."""

    image: str
    # "vllm", "llamacpp" or "sglang": the simulated or real engine; "caravan":
    # caravan's own image, whose entrypoint is the `caravan` command
    engine: str | None = None
    command: tuple[str, ...] = ()  # or an explicit command line

    def matches(self, image: str) -> bool:
        return fnmatch.fnmatchcase(image, self.image)


DEFAULT_IMAGE_MAPPINGS = (
    ImageMapping(image="vllm/vllm-openai:*", engine="vllm"),
    ImageMapping(image="vllm/vllm-openai", engine="vllm"),
    ImageMapping(image="ghcr.io/ggml-org/llama.cpp:server*", engine="llamacpp"),
    ImageMapping(image="lmsysorg/sglang:*", engine="sglang"),
    # caravan's image (`make image`; a replica's KV relay runs `caravan kv-relay` in it).
    ImageMapping(image="caravan-llm:*", engine="caravan"),
    ImageMapping(image="*/caravan-llm:*", engine="caravan"),
)
ENGINE_KINDS = frozenset({"vllm", "llamacpp", "sglang", "caravan"})
# What stands in for caravan's image: its entrypoint, `caravan`, as this interpreter runs it.
CARAVAN_MODULE = "caravan_llm.cli"


def load_image_mappings(path: Path | None) -> tuple[ImageMapping, ...]:
    """The mapping table: entries of `path` (YAML or JSON list) before the defaults."""
    if path is None:
        return DEFAULT_IMAGE_MAPPINGS
    document = yaml.safe_load(path.read_text())
    if not isinstance(document, list):
        message = f"{path}: image mappings must be a list of {{image, engine|command}}"
        raise ValueError(message)  # noqa: TRY004 - a bad file is a bad value
    mappings: list[ImageMapping] = []
    for position, entry in enumerate(document):
        if not isinstance(entry, dict) or not isinstance(entry.get("image"), str):
            message = f"{path}: entry {position} needs an 'image' glob"
            raise ValueError(message)  # noqa: TRY004 - a bad file is a bad value
        engine = entry.get("engine")
        command = entry.get("command") or []
        if engine is not None and engine not in ENGINE_KINDS:
            raise ValueError(
                f"{path}: entry {position}: engine must be vllm, llamacpp, sglang or caravan, "
                f"not {engine!r}"
            )
        if engine is None and not command:
            raise ValueError(f"{path}: entry {position} needs 'engine' or 'command'")
        mappings.append(
            ImageMapping(image=entry["image"], engine=engine, command=tuple(map(str, command)))
        )
    return (*mappings, *DEFAULT_IMAGE_MAPPINGS)


def _no_core() -> int | None:
    return None


@dataclass(frozen=True, slots=True)
class DriverSettings:
    image_mappings: tuple[ImageMapping, ...] = DEFAULT_IMAGE_MAPPINGS
    python: str = sys.executable
    host_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    # Set: vLLM images run the real vLLM (devcluster/vllm_real.py), else the simulator.
    real_vllm: vllm_real.RealVllmOptions | None = None
    # The core the next real vLLM replica binds its OpenMP threads to (None: vLLM's default).
    next_core: Callable[[], int | None] = _no_core
    # A folder that holds the files every node has at the same absolute path
    # (`<node_root>/opt/models/x.gguf` is the nodes' `/opt/models/x.gguf`);
    # None: tasks see only the host's own files.
    node_root: Path | None = None
    # On: the simulated llama.cpp engine exits 1 with llama-server's own error
    # lines when its -m file does not exist (a real node's behaviour); off, it
    # serves any path (tests that pass made-up model paths).
    check_model_files: bool = False


MAX_NICE = 19


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    # Lines written at the top of the task's stderr log before it starts.
    preamble: tuple[str, ...] = ()
    # A folder of the task's that is removed once its process has exited.
    scratch: Path | None = None
    # Scheduling niceness of the task's process (0: the agent's own).
    nice: int = 0


def _string_list(value: Any, field_name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise DriverError(f"failed to decode driver config: {field_name} must be a list of strings")
    return [str(item) for item in value]


def _flag_value_index(args: Sequence[str], flag: str) -> tuple[int, bool] | None:
    """(position, inline) of `flag value` or `flag=value` in args."""
    for position, arg in enumerate(args):
        if arg == flag and position + 1 < len(args):
            return position + 1, False
        if arg.startswith(f"{flag}="):
            return position, True
    return None


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    found = _flag_value_index(args, flag)
    if found is None:
        return [*args, flag, value]
    position, inline = found
    updated = list(args)
    updated[position] = f"{flag}={value}" if inline else value
    return updated


def translate_container_args(
    args: Sequence[str], ports: Sequence[AllocatedPort], mapped_labels: Sequence[str], host_ip: str
) -> list[str]:
    """Rewrite `--port <To>` to the host port and `--host` to the node address."""
    updated = list(args)
    found = _flag_value_index(updated, "--port")
    if found is not None:
        position, inline = found
        current = updated[position].split("=", 1)[1] if inline else updated[position]
        for port in ports:
            if mapped_labels and port.label not in mapped_labels:
                continue
            if str(port.to) == current or (port.to == 0 and str(port.value) == current):
                updated = _set_flag(updated, "--port", str(port.value))
                break
    return _set_flag(updated, "--host", host_ip)


def _engine_command(engine: str, settings: DriverSettings) -> tuple[str, ...]:
    if engine == "caravan":
        return (settings.python, "-m", CARAVAN_MODULE)
    if engine == "llamacpp":
        build = find_llama_server(settings.host_env)
        if build is not None:
            return (str(build.binary),)
    return (settings.python, "-m", ENGINE_MODULE, "--flavor", engine)


def _resolve_command(command: str, task_dir: Path, env: Mapping[str, str]) -> str:
    if os.sep in command:
        candidate = Path(command) if Path(command).is_absolute() else task_dir / command
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
        raise DriverError(
            "failed to launch command with executor: rpc error: code = Unknown desc = "
            f"fork/exec {command}: no such file or directory"
        )
    found = shutil.which(command, path=env.get("PATH"))
    if found is None:
        raise DriverError(
            "failed to launch command with executor: rpc error: code = Unknown desc = "
            f'exec: "{command}": executable file not found in $PATH'
        )
    return found


def node_files(args: Sequence[str], node_root: Path | None) -> tuple[list[str], tuple[str, ...]]:
    """Arguments naming a node's file (`/opt/models/x.gguf`, `--model=/...`) pointed at its
    copy under `node_root`, as a node that has the file there would open it; with the
    lines that say so at the top of the task's stderr."""
    if node_root is None:
        return list(args), ()
    mapped: list[str] = []
    notes: list[str] = []
    for arg in args:
        flag, equals, value = arg.rpartition("=") if arg.startswith("-") else ("", "", arg)
        local = node_root / value.lstrip("/") if value.startswith("/") else None
        if local is not None and (local.exists() or local.is_symlink()):
            mapped.append(f"{flag}{equals}{local}")
            notes.append(f"devcluster: node file {value} is {local}")
        else:
            mapped.append(arg)
    return mapped, tuple(notes)


def task_process_env(task_env: Mapping[str, str], settings: DriverSettings) -> dict[str, str]:
    """The host environment (minus Nomad's denylist) overlaid with the task's."""
    env = {k: v for k, v in settings.host_env.items() if k not in ENV_DENYLIST}
    if settings.check_model_files:
        env[CHECK_MODEL_FILE_ENV] = "1"
    if settings.node_root is not None:
        # The simulated vLLM reads adapter folders named at run time under it.
        env[NODE_ROOT_ENV] = str(settings.node_root)
    env.update(task_env)
    return env


def resolve_launch(
    driver: str,
    config: Mapping[str, Any],
    *,
    env: Mapping[str, str],
    ports: Sequence[AllocatedPort],
    host_ip: str,
    task_dir: Path,
    settings: DriverSettings,
) -> LaunchSpec:
    """The command line a task's driver config runs as, or a `DriverError`."""
    process_env = task_process_env(env, settings)
    if driver in {"raw_exec", "exec"}:
        command = config.get("command")
        if not isinstance(command, str) or not command:
            raise DriverError(
                "failed to decode driver config: command is required", recoverable=False
            )
        args, notes = node_files(_string_list(config.get("args"), "args"), settings.node_root)
        argv = (_resolve_command(command, task_dir, process_env), *args)
        return LaunchSpec(argv, process_env, notes)
    if driver == "docker":
        image = config.get("image")
        if not isinstance(image, str) or not image:
            raise DriverError(
                "failed to decode driver config: image is required", recoverable=False
            )
        mapping = next((m for m in settings.image_mappings if m.matches(image)), None)
        if mapping is None:
            raise DriverError(
                f'Failed to create container configuration for image "{image}": '
                f"no devcluster image mapping exists for image {image!r} "
                "(add one with --image-map)",
                recoverable=False,
            )
        args = _string_list(config.get("args"), "args")
        labels = _string_list(config.get("ports"), "ports")
        args = translate_container_args(args, ports, labels, host_ip)
        if mapping.engine == "vllm" and not mapping.command and settings.real_vllm is not None:
            # vLLM puts its ZMQ ipc sockets in TMPDIR, and a socket path has at most
            # 107 bytes, so the task's own tmp/ (deep in the data dir) is too long.
            scratch = Path(tempfile.mkdtemp(prefix="cvl-"))
            real = vllm_real.launch(
                args,
                process_env,
                settings.real_vllm,
                task_dir=task_dir,
                alloc_dir=task_dir.parent,
                core=settings.next_core(),
                tmp_dir=scratch,
            )
            preamble = tuple(
                f"devcluster: real vLLM: {change.describe()}" for change in real.substitutions
            )
            return LaunchSpec(real.argv, real.env, preamble, scratch, nice=real.nice)
        command = mapping.command or _engine_command(mapping.engine or "", settings)
        args, notes = node_files(args, settings.node_root)
        return LaunchSpec((*command, *args), process_env, notes)
    raise DriverError(f"driver {driver!r} is not supported by devcluster", recoverable=False)


@dataclass(frozen=True, slots=True)
class ExitResult:
    exit_code: int
    signal: int

    @property
    def successful(self) -> bool:
        return self.exit_code == 0 and self.signal == 0


class TaskProcess:
    """A started task: its own process group, waited on asynchronously."""

    def __init__(self, process: asyncio.subprocess.Process, scratch: Path | None = None) -> None:
        self.process = process
        self.pid = process.pid
        self._scratch = scratch

    async def wait(self) -> ExitResult:
        code = await self.process.wait()
        if self._scratch is not None:
            # The rest of the group goes with its leader; wait until none is left
            # holding files in the scratch folder, then remove it.
            self.kill_group()
            shutil.rmtree(self._scratch, ignore_errors=True)
        if code < 0:
            return ExitResult(exit_code=-1, signal=-code)
        return ExitResult(exit_code=code, signal=0)

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def kill_group(self) -> None:
        self.signal_group(signal.SIGKILL)


async def start_process(spec: LaunchSpec, *, cwd: Path, stdout: Path, stderr: Path) -> TaskProcess:
    stdout.parent.mkdir(parents=True, exist_ok=True)
    with stdout.open("ab") as out, stderr.open("ab") as err:
        for line in spec.preamble:
            err.write(f"{line}\n".encode())
        err.flush()
        try:
            process = await asyncio.create_subprocess_exec(
                *spec.argv,
                cwd=str(cwd),
                env=dict(spec.env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        except OSError as exc:
            raise DriverError(
                f"failed to launch command with executor: rpc error: code = Unknown desc = {exc}"
            ) from None
    if spec.nice > 0:
        _lower_priority(process.pid, spec.nice)
    return TaskProcess(process, spec.scratch)


def _lower_priority(pid: int, nice: int) -> None:
    """The started program at `nice` below the agent (at most the lowest priority).

    Set before the program has started any thread or child (both inherit it).
    With the kernel's autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`),
    CPU time is first shared between sessions, and the task runs in a session of its
    own (`start_new_session`): its niceness alone would not lower it against the
    agent's session, so its session's autogroup gets the same niceness.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        own = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, pid, min(own + nice, MAX_NICE))
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{min(nice, MAX_NICE)}\n", encoding="ascii")


def parse_signal(name: str) -> int:
    """`SIGTERM`, `SIGINT`, ... to its number (Nomad's `kill_signal`)."""
    if not name:
        return signal.SIGTERM
    try:
        return int(
            signal.Signals[name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"]
        )
    except KeyError:
        raise DriverError(f"invalid kill_signal {json.dumps(name)}", recoverable=False) from None
