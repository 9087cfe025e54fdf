"""Running a vLLM replica's rendered command line on the real vLLM (CPU build).

The replica job caravan renders runs `vllm/vllm-openai` with caravan's
arguments, environment and ports. With `vllm_engine="real"` devcluster starts
`python -m vllm.entrypoints.openai.api_server` from the built venv with those
same arguments, so the real argument parser judges caravan's command line.
What cannot mean the same thing on this machine is mapped explicitly, and
each mapping is a `Substitution` that the demo prints and devcluster writes at
the top of the task's stderr log (devcluster/README.md lists them):

- `--model <hub id>`: the tiny model built offline (nothing is fetched);
- `--tensor-parallel-size N` / `--pipeline-parallel-size N` above 1: 1 (one
  CPU worker; parallelism needs N GPUs);
- `--gpu-memory-utilization`: dropped (the CPU backend sizes its KV cache
  from `VLLM_CPU_KVCACHE_SPACE` and `--num-gpu-blocks-override`);
- `--max-model-len` above the tiny model's 2048 positions: 2048;
- added `--enforce-eager` (ready in ~30-45 s instead of 40-140 s compiled)
  and `--num-gpu-blocks-override` (a small KV cache, ~1.9 GiB per replica)
  unless the job sets it.

Environment, as the vLLM image and a CPU node would give it: offline Hugging
Face (`HF_HUB_OFFLINE`), no usage stats, `VLLM_CPU_KVCACHE_SPACE`, the
replica's own core (`VLLM_CPU_OMP_THREADS_BIND`, so two replicas do not share
core 0), and a `TMPDIR` of the task's own that devcluster removes when the
process exits, so vLLM's `vllm_dist_*` files and ipc sockets go with it.
Paths under the container's `/alloc`, `/local` and `/secrets` point into the
task's folders, as Docker's mounts make them.

The process (and its session's autogroup, drivers.py) runs at niceness `nice`
(10 by default): on a real cluster an engine
has a host of its own, here its spinning OpenMP threads share two cores with
the stand-in agents and caravan's processes, which must not be starved (a
saturated pair of replicas once made the scheduler lose its Consul session).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from caravan_llm.devcluster.vllm_build import API_SERVER_MODULE, MAX_MODEL_LEN, VllmBuild

DEFAULT_KV_BLOCKS = 64
DEFAULT_NICE = 10
# Environment every real replica gets unless its job sets it.
BASE_ENV: Mapping[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # GiB; with --num-gpu-blocks-override the cache is smaller still.
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
_PARALLEL_FLAGS = (
    ("--tensor-parallel-size", "-tp"),
    ("--pipeline-parallel-size", "-pp"),
)
_DROPPED_FLAGS = {
    "--gpu-memory-utilization": (
        "the CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE and "
        "--num-gpu-blocks-override, not from a GPU's memory"
    ),
}
_CONTAINER_ROOTS = ("/alloc", "/local", "/secrets")


@dataclass(frozen=True, slots=True)
class Substitution:
    """One place where the real replica runs with something other than the rendered job."""

    flag: str
    rendered: str | None  # what the job says (None: absent)
    used: str | None  # what the real vLLM gets (None: dropped)
    reason: str

    def describe(self) -> str:
        rendered = "(absent)" if self.rendered is None else self.rendered
        used = "(dropped)" if self.used is None else self.used
        return f"{self.flag}: {rendered} -> {used} ({self.reason})"


@dataclass(frozen=True, slots=True)
class RealVllmLaunch:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    substitutions: tuple[Substitution, ...]
    nice: int


@dataclass(frozen=True, slots=True)
class RealVllmOptions:
    """devcluster's settings for real vLLM replicas."""

    build: VllmBuild
    kv_blocks: int = DEFAULT_KV_BLOCKS
    enforce_eager: bool = True
    # The replica's scheduling niceness (0-19). On a real cluster an engine has a
    # host of its own; here it shares this machine's cores with the stand-in
    # agents and caravan's processes, and its OpenMP threads spin on their core.
    nice: int = DEFAULT_NICE


def _split(arg: str) -> tuple[str, str | None]:
    if arg.startswith("--") and "=" in arg:
        flag, value = arg.split("=", 1)
        return flag, value
    return arg, None


def _parse(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """The arguments as (flag or positional, value or None), values joined to their flag."""
    items: list[tuple[str, str | None]] = []
    position = 0
    while position < len(args):
        flag, value = _split(args[position])
        position += 1
        takes_value = (
            flag.startswith("-")
            and value is None
            and position < len(args)
            and not args[position].startswith("-")
        )
        if takes_value:
            value = args[position]
            position += 1
        items.append((flag, value))
    return items


def substitutions_for(args: Sequence[str], options: RealVllmOptions) -> tuple[Substitution, ...]:
    """What `launch` changes in these rendered arguments, in order."""
    return _map(args, options)[1]


def _map_one(
    flag: str, value: str | None, options: RealVllmOptions
) -> tuple[list[str], Substitution | None]:
    if flag == "--model":
        model = str(options.build.model)
        if value == model:
            return [flag, model], None
        reason = "a hub id this offline machine cannot fetch; the tiny model built by make vllm"
        return [flag, model], Substitution(flag, value, model, reason)
    for names in _PARALLEL_FLAGS:
        if flag in names and value is not None and value != "1":
            reason = f"{value} workers need {value} GPUs; the CPU backend runs one worker"
            return [flag, "1"], Substitution(flag, value, "1", reason)
    if flag in _DROPPED_FLAGS:
        return [], Substitution(flag, value, None, _DROPPED_FLAGS[flag])
    too_long = value is not None and value.isdigit() and int(value) > MAX_MODEL_LEN
    if flag == "--max-model-len" and too_long:
        reason = f"the tiny model has {MAX_MODEL_LEN} positions"
        return [flag, str(MAX_MODEL_LEN)], Substitution(flag, value, str(MAX_MODEL_LEN), reason)
    return [flag] if value is None else [flag, value], None


def _map(
    args: Sequence[str], options: RealVllmOptions
) -> tuple[list[str], tuple[Substitution, ...]]:
    mapped: list[str] = []
    changes: list[Substitution] = []
    seen: set[str] = set()
    for flag, value in _parse(args):
        seen.add(flag)
        out, change = _map_one(flag, value, options)
        mapped.extend(out)
        if change is not None:
            changes.append(change)
    if "--model" not in seen:
        model = str(options.build.model)
        mapped.extend(["--model", model])
        changes.append(Substitution("--model", None, model, "the tiny model built by make vllm"))
    if options.enforce_eager and "--enforce-eager" not in seen:
        mapped.append("--enforce-eager")
        reason = "no torch.compile: ready in ~30-45 s instead of 40-140 s on 2 cores"
        changes.append(Substitution("--enforce-eager", None, "(switch)", reason))
    if "--num-gpu-blocks-override" not in seen:
        blocks = str(options.kv_blocks)
        mapped.extend(["--num-gpu-blocks-override", blocks])
        reason = "a small CPU KV cache (blocks of 128 tokens), about 1.9 GiB per replica"
        changes.append(Substitution("--num-gpu-blocks-override", None, blocks, reason))
    return mapped, tuple(changes)


def _container_path(value: str, alloc_dir: Path, task_dir: Path) -> str:
    for root in _CONTAINER_ROOTS:
        if value == root or value.startswith(f"{root}/"):
            base = alloc_dir / "alloc" if root == "/alloc" else task_dir / root.lstrip("/")
            rest = value[len(root) :].lstrip("/")
            return str(base / rest) if rest else str(base)
    return value


def launch(
    args: Sequence[str],
    env: Mapping[str, str],
    options: RealVllmOptions,
    *,
    task_dir: Path,
    alloc_dir: Path,
    core: int | None,
    tmp_dir: Path,
) -> RealVllmLaunch:
    """The real vLLM's command line and environment for a replica's rendered arguments."""
    mapped, changes = _map(args, options)
    process_env = {key: _container_path(value, alloc_dir, task_dir) for key, value in env.items()}
    for key, value in BASE_ENV.items():
        process_env.setdefault(key, value)
    if core is not None:
        process_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
    process_env["TMPDIR"] = str(tmp_dir)
    argv = (
        str(options.build.python),
        "-W",
        "ignore::DeprecationWarning",
        "-m",
        API_SERVER_MODULE,
        *mapped,
    )
    return RealVllmLaunch(argv=argv, env=process_env, substitutions=changes, nice=options.nice)
