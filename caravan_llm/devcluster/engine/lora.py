"""LoRA adapters of the simulated vLLM, as vLLM 0.32 serves them.

vLLM (`vllm/entrypoints/openai/models/serving.py`, `serve/lora/api_router.py`):

- `--enable-lora --max-loras N --max-lora-rank R [--max-cpu-loras M]`, and
  `--lora-modules name=path` (or JSON `{"name", "path", "base_model_name"}`)
  loaded at start: one that does not load stops the server;
- with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (`1` or `true`), `POST
  /v1/load_lora_adapter {"lora_name", "lora_path"}` answers 200 with the text
  `Success: LoRA adapter '<name>' added successfully.`; a second load of a name
  400 InvalidUserInput; a path with no adapter 404 NotFoundError (`Loading
  lora <name> failed: No adapter found for <path>`, with the path itself
  masked as every vLLM error message masks paths: `sanitize_message`); a
  missing field 400 `Bad Request` with FastAPI's validation message; a rank
  above `--max-lora-rank` 500 from the worker. The success body has no
  content type (the client sees application/octet-stream).
  `POST /v1/unload_lora_adapter {"lora_name"}` answers 200 `Success: LoRA
  adapter '<name>' removed successfully.`, or 404 NotFoundError for a name not
  loaded. Without the variable neither route exists (404 `{"detail": "Not Found"}`);
- loads beyond `--max-loras` succeed (vLLM keeps them in its CPU cache and
  swaps them in per batch), so the simulator accepts them too;
- a loaded adapter is a model: `/v1/models` lists it with `parent` set to the
  base model and `root` its path; a request whose `model` is its name is
  served (here: text of its own, deterministic, different from the base's).

An adapter exists when its folder holds `adapter_config.json` (what peft
writes and vLLM reads); a rank (`r`) above `--max-lora-rank` is refused with
vLLM's message. A Hugging Face id is looked up in the hub cache (`HF_HOME`),
as vLLM does offline. Node paths (`/opt/loras/x`) are read under devcluster's
node folder when the driver says where it is (`CARAVAN_SIM_NODE_ROOT`).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from caravan_llm.devcluster.engine.openai_requests import ApiError

# vLLM's `MaxLoRARanks` (vllm/config/lora.py): the values --max-lora-rank takes.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_CONFIG = "adapter_config.json"
# Set by devcluster's driver: the folder that holds the nodes' files (`<root>/opt/...`).
NODE_ROOT_ENV = "CARAVAN_SIM_NODE_ROOT"
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def sanitize_message(message: str) -> str:
    """vLLM's `sanitize_message` (entrypoints/serve/exception_handling/utils.py), applied to
    every error message it answers: memory addresses, traceback lines and file paths go."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def missing_fields(body: Mapping[str, object], fields: tuple[str, ...]) -> ApiError | None:
    """FastAPI's 400 for required string fields absent from a JSON body, as vLLM words it
    (serve/exception_handling/handlers/validation.py); None when all are there."""
    errors = [
        {
            "type": "missing",
            "loc": f"body.{name}",
            "msg": "Field required",
            "input": f"<dict of {len(body)} items>",
        }
        for name in fields
        if name not in body
    ]
    if not errors:
        return None
    plural = "s" if len(errors) > 1 else ""
    lines = "".join(f"\n  {error}" for error in errors)
    return ApiError(
        400,
        f"{len(errors)} validation error{plural}:{lines}",
        param=str(errors[0]["loc"]),
        error_type="Bad Request",
    )


class LoraModuleError(ValueError):
    """A `--lora-modules` value vLLM's parser refuses."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry: an adapter loaded at start."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """vLLM's LoRA flags, as the simulator honours them."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[LoraModule, ...] = ()


def runtime_updating(env: Mapping[str, str]) -> bool:
    """vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: on for `1` or `true`, any case."""
    return env.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in {"1", "true"}


def parse_lora_module(value: str) -> LoraModule:
    """`name=path`, or JSON with `name` and `path` (vLLM's LoRAParserAction)."""
    text = value.strip()
    if text.startswith("{"):
        try:
            document = json.loads(text)
        except ValueError:
            raise LoraModuleError(f"Invalid JSON format for --lora-modules: {value}") from None
        name, path = document.get("name"), document.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise LoraModuleError(f"Invalid fields for --lora-modules: {value}")
        return LoraModule(name, path)
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise LoraModuleError(f"Invalid format for --lora-modules: {value} (expected name=path)")
    return LoraModule(name, path)


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    name: str
    # The path it was loaded from, as given (reported as `root`).
    path: str
    lora_int_id: int

    @property
    def seed_salt(self) -> int:
        """What makes its text its own: a stable number from its name."""
        return zlib.crc32(self.name.encode()) & 0x7FFFFFFF


def _resolve(path: str, env: Mapping[str, str]) -> Path | None:
    """The local folder an adapter path or hub id names, or None when there is none."""
    if path.startswith("/"):
        root = env.get(NODE_ROOT_ENV)
        if root:
            on_node = Path(root) / path.lstrip("/")
            if on_node.exists():
                return on_node
        return Path(path)
    home = env.get("HF_HOME")
    if not home:
        return None
    snapshots = Path(home) / "hub" / f"models--{path.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob(f"*/{ADAPTER_CONFIG}")) if snapshots.is_dir() else []
    return found[0].parent if found else None


def _rank_of(folder: Path) -> int | None:
    try:
        document = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rank = document.get("r") if isinstance(document, dict) else None
    return rank if isinstance(rank, int) else None


@dataclass(slots=True)
class LoraRegistry:
    """The adapters one simulated vLLM holds (its `lora_requests`)."""

    config: LoraConfig
    env: Mapping[str, str] = field(default_factory=dict)
    loaded: dict[str, LoadedAdapter] = field(default_factory=dict)
    _next_id: int = 0

    def load(self, name: object, path: object) -> str:
        """Load an adapter; the success text, or ApiError with vLLM's status and message."""
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ApiError(
                400,
                "Both 'lora_name' and 'lora_path' must be provided.",
                error_type="InvalidUserInput",
            )
        if name in self.loaded:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.",
                error_type="InvalidUserInput",
            )
        folder = _resolve(path, self.env)
        if folder is None or not (folder / ADAPTER_CONFIG).is_file():
            raise ApiError(
                404,
                sanitize_message(f"Loading lora {name} failed: No adapter found for {path}"),
                error_type="NotFoundError",
            )
        rank = _rank_of(folder)
        if rank is not None and rank > self.config.max_lora_rank:
            raise ApiError(
                500,
                "Call to add_lora method failed: Worker failed with error 'LoRA rank "
                f"{rank} is greater than max_lora_rank {self.config.max_lora_rank}.', "
                "please check the stack trace above for the root cause",
                error_type="InternalServerError",
            )
        self._next_id += 1
        self.loaded[name] = LoadedAdapter(name=name, path=path, lora_int_id=self._next_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: object) -> str:
        """Unload an adapter; the success text, or ApiError as vLLM answers."""
        if not isinstance(name, str) or not name:
            raise ApiError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                error_type="InvalidUserInput",
            )
        if name not in self.loaded:
            raise ApiError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                error_type="NotFoundError",
            )
        del self.loaded[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def load_static(self) -> None:
        """The `--lora-modules` at start; raises LoraModuleError (vLLM stops) on the first
        that does not load."""
        for module in self.config.modules:
            try:
                self.load(module.name, module.path)
            except ApiError as exc:
                raise LoraModuleError(exc.message) from None
