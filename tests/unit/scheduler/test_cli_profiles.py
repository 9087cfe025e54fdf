"""`caravan validate` and `caravan render` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from caravan_llm.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted(str(p) for p in (ROOT / "examples" / "profiles").glob("*.yaml"))


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_validate_examples_exits_zero(capsys: pytest.CaptureFixture[str]):
    """`caravan validate examples/profiles/*` exits 0."""
    assert main(["validate", *EXAMPLES]) == 0
    assert capsys.readouterr().err == ""


def test_validate_reports_one_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Invalid files exit 1 with FILE: FIELD: MESSAGE lines on stderr and no traceback."""
    bad = write(
        tmp_path, "bad.yaml", "name: X\nmodel: m\nengine: vllm\nreplicas: {min: 2, max: 1}\n"
    )
    assert main(["validate", bad]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"{bad}: name: 'X' is not DNS-safe")
    assert lines[1] == f"{bad}: replicas.min (2) must be <= replicas.max (1)"
    assert len(lines) == 2


def test_validate_yaml_error_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """A YAML syntax error names the file and the line."""
    bad = write(tmp_path, "broken.yaml", "name: x\nmodel: [unclosed\nengine: vllm\n")
    assert main(["validate", bad]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}: YAML syntax error at line ")
    assert "Traceback" not in err


def test_validate_catches_render_time_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """An unknown GPU class is caught by validate, listing the known classes."""
    bad = write(tmp_path, "g.yaml", "name: x\nmodel: m\nengine: vllm\ngpu: {class: h900}\n")
    assert main(["validate", bad]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: gpu.class: unknown GPU class 'h900'; known classes: " in err


def test_validate_refuses_duplicate_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Two files with one model name are a problem naming both."""
    text = "name: x\nmodel: m\nengine: llamacpp\n"
    first, second = write(tmp_path, "a.yaml", text), write(tmp_path, "b.yaml", text)
    assert main(["validate", first, second]) == 1
    assert f"{second}: name: 'x' is already used by {first}" in capsys.readouterr().err


def test_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A missing file is a one-line error, not a traceback."""
    missing = str(tmp_path / "nope.yaml")
    assert main(["validate", missing]) == 1
    assert capsys.readouterr().err.startswith(f"{missing}: cannot read file")


@pytest.mark.parametrize("path", EXAMPLES)
def test_render_prints_the_job_body(path: str, capsys: pytest.CaptureFixture[str]):
    """`caravan render FILE --replica N` prints the PUT /v1/jobs body for that replica."""
    assert main(["render", path, "--replica", "2"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["Job"]["ID"].endswith("-2")


def test_render_error_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Rendering a multi-node vLLM profile fails with a message about `nodes`."""
    path = write(
        tmp_path, "mn.yaml", "name: x\nmodel: m\nengine: vllm\ngpu: {class: h100}\nnodes: 2\n"
    )
    assert main(["render", path]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{path}: nodes: multi-node" in captured.err


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ("env: {LD_PRELOAD: /tmp/x.so}\n", "LD_PRELOAD"),
        ("engine_args: ['--trust-remote-code']\n", "--trust-remote-code"),
    ],
    ids=["ld-preload", "trust-remote-code"],
)
def test_validate_refuses_what_submit_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, problem: str
):
    """Issue 23, finding 6: validate runs the scheduler's validation, profile policy included."""
    bad = write(tmp_path, "p.yaml", "name: x\nmodel: m\nengine: vllm\ngpu: {class: h100}\n" + extra)
    assert main(["validate", bad]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}: ")
    assert problem in err


def test_validate_reports_policy_and_render_problems_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """A file with a policy problem and a render problem gets both lines at once."""
    bad = write(
        tmp_path,
        "p.yaml",
        "name: x\nmodel: m\nengine: vllm\ngpu: {class: h900}\nenv: {LD_PRELOAD: /x.so}\n",
    )
    assert main(["validate", bad]) == 1
    err = capsys.readouterr().err
    assert "LD_PRELOAD" in err
    assert "unknown GPU class 'h900'" in err


def test_validate_reports_schema_and_policy_problems_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """A file that fails its schema still gets the policy's lines on the fields it could read."""
    bad = write(
        tmp_path,
        "p.yaml",
        "name: x\nmodel: m\nengine: vllm\ngpu: {class: h100}\nmax_concurrency: -1\n"
        "env: {LD_PRELOAD: /x.so}\nengine_args: ['--trust-remote-code']\n",
    )
    assert main(["validate", bad]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert 3 == len(lines)
    assert lines[0].startswith(f"{bad}: max_concurrency: ")
    assert "LD_PRELOAD" in lines[1]
    assert "--trust-remote-code" in lines[2]


@pytest.mark.parametrize("command", ["validate", "render"])
def test_non_utf8_profile_is_a_problem_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
):
    """Issue 23, finding 7: bytes that are not UTF-8 name the file and the offset."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: x\nmodel: caf\xe9\nengine: vllm\n")
    assert main([command, str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: not UTF-8 text (byte 0xe9 at offset 18)\n" == err


def test_validate_refuses_a_served_name_two_files_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Two files serving one name are refused as submit would refuse them."""
    first = write(tmp_path, "a.yaml", "name: a\nmodel: m\nengine: llamacpp\nserved_model_name: s\n")
    second = write(
        tmp_path, "b.yaml", "name: b\nmodel: m\nengine: llamacpp\nserved_model_name: s\n"
    )
    assert main(["validate", first, second]) == 1
    assert "served_model_name: 's' is also served by model 'a'" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_cli_without_a_traceback():
    """Issue 23, finding 7: `caravan ... | head` exits like a process ended by SIGPIPE, quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "caravan_llm.cli", "render", EXAMPLES[0]],
            stdout=write_end,
            stderr=subprocess.PIPE,
            check=False,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (141, b"") == (done.returncode, done.stderr)


def test_submit_refuses_non_utf8_bytes_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Issue 23, finding 7: submit names the file and the offset before sending anything."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: x\nmodel: caf\xe9\nengine: vllm\n")
    assert 1 == main(["submit", str(bad), "--scheduler", "http://127.0.0.1:9"])
    assert f"error: {bad}: not UTF-8 text (byte 0xe9 at offset 18)\n" == capsys.readouterr().err
