"""What a profile may put in `env`, `engine_args` and `image`, bounded by the cluster config.

A profile's `env` and `engine_args` reach a process on a client node (under
raw_exec, as the Nomad client's user). Whoever may submit a profile must not
thereby choose what code that process loads, where it listens, or what it
reads and writes on the node. So, by default:

- environment variables that change how a process loads code (the dynamic
  linker's `LD_*`/`DYLD_*`, interpreters' module paths and startup hooks,
  shells' startup files, OpenSSL engine loading, glibc tunables), that
  override the task's identity or GPUs (`NOMAD_*`, `NVIDIA_*`,
  `CUDA_VISIBLE_DEVICES`), or that set engine flags through the environment
  (llama-server reads every flag from `LLAMA_ARG_*`) are refused;
- engine flags that load code (`--trust-remote-code`, `--worker-cls`,
  `--middleware`, ...), change the listener (`--host`, `--port`, `--uds`,
  `--api-key`) or give the engine's clients the node's file system
  (`--allowed-local-media-path`, llama.cpp `--path`, `--slot-save-path`) are
  refused;
- an `image` other than the cluster's configured engine images is refused,
  for the engine and for a `weights.prefetch`;
- a `weights.prefetch` with its own `command` (or the `exec` driver) is
  refused: only the default `hf download <model>` runs.

An operator allows more with the cluster config's `profile_policy`
(`allow_env`, `allow_engine_args`, `allowed_images`, `allow_prefetch_commands`)
and refuses more with
`deny_env`/`deny_engine_args`. Names ending in `*` are prefixes.

`policy_problems` is pure: one line per refusal, each naming the field and
the value, so submit can report them all and write nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict

from caravan_llm.scheduler.engines.registry import Engine, adapter_for, all_adapters
from caravan_llm.scheduler.profiles import ModelProfile

_FROZEN = ConfigDict(frozen=True, extra="forbid")

# Names ending in "*" are prefixes. Each engine adds its own (`denied_env` of its adapter).
_GENERIC_DENIED_ENV: tuple[str, ...] = (
    # The dynamic linker: preload/audit libraries, library search paths (glibc, musl, macOS).
    "LD_*",
    "DYLD_*",
    "GLIBC_TUNABLES",
    "GCONV_PATH",
    "LOCPATH",
    "NLSPATH",
    "HOSTALIASES",
    "MALLOC_*",
    # Which executables run (vLLM and Triton spawn compilers and helpers by name).
    "PATH",
    # Python: module search paths, startup hooks, imports named in variables.
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONPLATLIBDIR",
    "PYTHONEXECUTABLE",
    "PYTHONBREAKPOINT",
    "PYTHONWARNINGS",
    "PYTHONINSPECT",
    "PYTHONPYCACHEPREFIX",
    # Shells: startup files and prompt/trace hooks that run commands.
    "BASH_ENV",
    "ENV",
    "SHELLOPTS",
    "BASHOPTS",
    "PS4",
    "PROMPT_COMMAND",
    "IFS",
    # Other interpreters' module paths and option hooks.
    "NODE_OPTIONS",
    "NODE_PATH",
    "PERL5LIB",
    "PERLLIB",
    "PERL5OPT",
    "RUBYLIB",
    "RUBYOPT",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "CLASSPATH",
    "GIT_*",
    # OpenSSL loads engine and provider shared objects named in its config.
    "OPENSSL_CONF",
    "OPENSSL_ENGINES",
    "OPENSSL_MODULES",
    # The task's identity, ports and devices, as Nomad and the GPU runtime set them.
    "NOMAD_*",
    "NVIDIA_*",
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)
DENIED_ENV: tuple[str, ...] = (
    *_GENERIC_DENIED_ENV,
    *chain.from_iterable(adapter.facts.denied_env for adapter in all_adapters()),
)

# The flags each engine's adapter refuses by default.
DENIED_FLAGS: Mapping[Engine, tuple[str, ...]] = MappingProxyType(
    {engine: adapter_for(engine).facts.denied_flags for engine in Engine}
)


class ProfilePolicy(BaseModel):
    """The cluster config's `profile_policy`: what profiles may set beyond the defaults."""

    model_config = _FROZEN

    # Environment variable names (or `PREFIX*`) a profile may set although denied by default.
    allow_env: tuple[str, ...] = ()
    # Engine flags a profile may pass although denied by default (e.g. "--trust-remote-code").
    allow_engine_args: tuple[str, ...] = ()
    # Images a profile may name in `image`, besides the cluster's own; "*" allows any.
    allowed_images: tuple[str, ...] = ()
    # More names (or `PREFIX*`) to refuse, on top of the defaults.
    deny_env: tuple[str, ...] = ()
    deny_engine_args: tuple[str, ...] = ()
    # Whether a profile's weights.prefetch may run its own command (or the exec
    # driver): code of the submitter's choosing, with the profile's secrets and
    # write access to the weights volume. The default `hf download` may always run.
    allow_prefetch_commands: bool = False


def _matches(name: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        if pattern.endswith("*"):
            if name.startswith(pattern[:-1]):
                return True
        elif name == pattern:
            return True
    return False


def env_problems(env: Iterable[str], policy: ProfilePolicy, *, field: str = "env") -> list[str]:
    """One line per environment variable the policy refuses (`field` names where it was set)."""
    denied = (*DENIED_ENV, *policy.deny_env)
    return [
        f"{field}: {name} is refused by the cluster's profile policy (it can change "
        "what code the engine process loads or where it runs); an operator may allow "
        "it with profile_policy.allow_env in the cluster config"
        for name in sorted(env)
        if _matches(name, denied) and not _matches(name, policy.allow_env)
    ]


def flag_name(engine: Engine, arg: str) -> str | None:
    """The flag an engine argument sets, normalised as the engine parses it; None for values."""
    if not arg.startswith("-") or arg == "-" or _is_number(arg):
        return None
    return adapter_for(engine).normalise_flag(arg.split("=", 1)[0])


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _denied_flag(engine: Engine, flag: str, denied: tuple[str, ...]) -> str | None:
    for name in denied:
        if flag == name:
            return name
        # An argparse parser accepts an unambiguous prefix of a long flag.
        abbreviates = flag.startswith("--") and len(flag) > len("--x") and name.startswith(flag)
        if adapter_for(engine).facts.abbreviates_flags and abbreviates:
            return name
    return None


def engine_arg_problems(
    engine: Engine, engine_args: Iterable[str], policy: ProfilePolicy
) -> list[str]:
    """One line per engine flag the policy refuses."""
    denied = (*DENIED_FLAGS[engine], *policy.deny_engine_args)
    problems = []
    seen: set[str] = set()
    for arg in engine_args:
        flag = flag_name(engine, arg)
        if flag is None or flag in seen:
            continue
        seen.add(flag)
        name = _denied_flag(engine, flag, denied)
        if name is None or name in policy.allow_engine_args or flag in policy.allow_engine_args:
            continue
        shown = flag if flag == name else f"{flag} (read by {engine.value} as {name})"
        problems.append(
            f"engine_args: {shown} is refused by the cluster's profile policy (it changes the "
            "engine's code, listener or file access); an operator may allow it with "
            "profile_policy.allow_engine_args in the cluster config"
        )
    return problems


def image_problems(
    image: str | None, policy: ProfilePolicy, cluster_images: Iterable[str]
) -> list[str]:
    if image is None or image in cluster_images:
        return []
    if "*" in policy.allowed_images or image in policy.allowed_images:
        return []
    message = (
        f"image: {image} is not one of the cluster's engine images and the profile policy "
        "does not allow it; an operator may allow it with profile_policy.allowed_images "
        "in the cluster config"
    )
    return [message]


def prefetch_problems(
    profile: ModelProfile, policy: ProfilePolicy, cluster_images: Iterable[str]
) -> list[str]:
    """A prefetch's image is an image like the engine's; its own command needs the policy."""
    weights = profile.weights
    if weights is None or weights.prefetch is None:
        return []
    prefetch = weights.prefetch
    problems = [
        f"weights.prefetch.{line}"
        for line in image_problems(prefetch.image, policy, cluster_images)
    ]
    if (prefetch.command or prefetch.driver == "exec") and not policy.allow_prefetch_commands:
        problems.append(
            "weights.prefetch.command: a prefetch that runs its own command (or the exec "
            "driver) runs code of the profile's choosing with its secrets and write access to "
            "the weights volume; an operator may allow it with "
            "profile_policy.allow_prefetch_commands in the cluster config"
        )
    return problems


def document_policy_problems(
    document: Mapping[str, object], policy: ProfilePolicy, *, cluster_images: Iterable[str] = ()
) -> list[str]:
    """What the policy refuses in a profile document that failed its schema, as far as readable.

    So that one run names every problem: the schema's and, beside them, the
    policy's on the fields that could be read (`env`, `secrets`,
    `engine_args` of a known `engine`, `image`). Fields of the wrong type are
    the schema's problem and are skipped here.
    """

    def names(value: object) -> list[str]:
        return [key for key in value if isinstance(key, str)] if isinstance(value, Mapping) else []

    found = [
        *env_problems(names(document.get("env")), policy),
        *env_problems(names(document.get("secrets")), policy, field="secrets"),
    ]
    engine = document.get("engine")
    args = document.get("engine_args")
    # `engine` may be any JSON value here (a list or object is unhashable).
    if isinstance(engine, str) and engine in set(Engine) and isinstance(args, list):
        found += engine_arg_problems(
            Engine(str(engine)), [arg for arg in args if isinstance(arg, str)], policy
        )
    image = document.get("image")
    if isinstance(image, str):
        found += image_problems(image, policy, cluster_images)
    return found


def policy_problems(
    profile: ModelProfile, policy: ProfilePolicy, *, cluster_images: Iterable[str] = ()
) -> list[str]:
    """Everything in `profile` the policy refuses (empty when it may run), one line each."""
    return [
        *env_problems(profile.env, policy),
        # A secret becomes an environment variable of the task just the same.
        *env_problems(profile.secrets, policy, field="secrets"),
        *engine_arg_problems(profile.engine, profile.engine_args, policy),
        *image_problems(profile.image, policy, cluster_images),
        *prefetch_problems(profile, policy, cluster_images),
    ]
