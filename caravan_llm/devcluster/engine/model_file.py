"""A missing model file, as llama-server says it (pure).

The real llama-server opens its `-m/--model` file before it serves; when the
file does not exist it writes these lines to stderr and exits 1 (wording of
llama.cpp's own log: `gguf_init_from_file`, `llama_model_load`,
`common_init_`, the server's `load_model`). The simulated llama.cpp engine
does the same when `CHECK_MODEL_FILE_ENV` is on (devcluster's
`check_model_files` setting turns it on for engine tasks); off, it serves
whatever path it is given, as the tests that pass made-up paths expect.
"""

from __future__ import annotations

from collections.abc import Mapping

from caravan_llm.devcluster.engine.flags import SIM_ENV_PREFIX, EngineSettings

CHECK_MODEL_FILE_ENV = SIM_ENV_PREFIX + "CHECK_MODEL_FILE"
# The real llama-server's exit status when its model does not load.
MODEL_LOAD_EXIT_CODE = 1


def check_model_file(env: Mapping[str, str]) -> bool:
    """Whether the engine must refuse a model file that does not exist."""
    return env.get(CHECK_MODEL_FILE_ENV, "").strip().lower() in {"1", "on", "true", "yes"}


def missing_model_lines(settings: EngineSettings, *, exists: bool) -> tuple[str, ...]:
    """The stderr lines llama-server writes before exiting 1 on a missing model file;
    none when the file exists or the flavour is not llama.cpp's."""
    if exists or settings.flavor != "llamacpp":
        return ()
    path = settings.model
    return (
        f"srv    load_model: loading model '{path}'",
        f"gguf_init_from_file: failed to open GGUF file '{path}' (No such file or directory)",
        f"llama_model_load: error loading model: llama_model_loader: failed to load model from {path}",  # noqa: E501 - one line of llama.cpp's log
        "llama_model_load_from_file_impl: failed to load model",
        f"common_init_: failed to load model '{path}'",
        f"srv    load_model: failed to load model, '{path}'",
        "srv  llama_server: exiting due to model loading error",
    )
