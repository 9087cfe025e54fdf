"""The simulated llama.cpp engine refuses a missing -m file like llama-server, when told to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from caravan_llm.devcluster.engine.flags import parse_engine_args
from caravan_llm.devcluster.engine.model_file import (
    CHECK_MODEL_FILE_ENV,
    check_model_file,
    missing_model_lines,
)
from caravan_llm.devcluster.nomad.drivers import DriverSettings, task_process_env


def test_a_missing_file_gives_llama_servers_own_error_lines() -> None:
    """The lines name the file with llama.cpp's wording."""
    settings = parse_engine_args(["--flavor", "llamacpp", "-m", "/opt/models/none.gguf"], {})

    lines = missing_model_lines(settings, exists=False)

    assert (
        "llama_model_load: error loading model: llama_model_loader: "
        "failed to load model from /opt/models/none.gguf"
    ) in lines
    assert "srv    load_model: failed to load model, '/opt/models/none.gguf'" in lines


def test_an_existing_file_or_another_flavour_gives_no_error() -> None:
    """Only llama.cpp's flavour opens its model file at start."""
    llamacpp = parse_engine_args(["--flavor", "llamacpp", "-m", "/x.gguf"], {})
    vllm = parse_engine_args(["--flavor", "vllm", "--model", "/x"], {})

    assert () == missing_model_lines(llamacpp, exists=True)
    assert () == missing_model_lines(vllm, exists=False)


def test_the_check_is_off_unless_the_environment_turns_it_on() -> None:
    """Today's behaviour (any path serves) stays the default."""
    assert (False, True) == (check_model_file({}), check_model_file({CHECK_MODEL_FILE_ENV: "1"}))


def test_the_engine_exits_1_with_the_error_on_stderr(tmp_path: Path) -> None:
    """The process ends as llama-server does, without serving."""
    missing = tmp_path / "none.gguf"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "caravan_llm.devcluster.engine",
            "--flavor",
            "llamacpp",
            "-m",
            str(missing),
        ],
        env={CHECK_MODEL_FILE_ENV: "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert 1 == done.returncode
    assert f"failed to open GGUF file '{missing}' (No such file or directory)" in done.stderr


def test_devcluster_sets_the_switch_in_task_environments_when_asked() -> None:
    """`check_model_files` puts the variable in every task's environment; off, it is absent."""
    on = task_process_env({}, DriverSettings(host_env={}, check_model_files=True))
    off = task_process_env({}, DriverSettings(host_env={}))

    assert ("1", None) == (on.get(CHECK_MODEL_FILE_ENV), off.get(CHECK_MODEL_FILE_ENV))
