"""The `nomadVar` template subset and the workload's implicit variable paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from caravan_llm.devcluster.nomad.templates import (
    MissingVariable,
    TemplateError,
    parse_env_file,
    render,
    render_task_templates,
)
from caravan_llm.devcluster.nomad.variables import validate_path, workload_may_read

VARS = {"nomad/jobs/j": {"api_key": "K", "b": "B"}}


def test_with_and_field_render_the_item() -> None:
    """`{{ with nomadVar }}{{ .item }}{{ end }}` renders the item, trims with `-`."""
    source = '{{ with nomadVar "nomad/jobs/j" }}\nKEY={{ .api_key }}\n{{- end }}\n'
    assert "\nKEY=K\n" == render(source, VARS.get)


def test_range_tuples_is_sorted_by_key() -> None:
    """`range .Tuples` walks the items in key order with `.K` and `.V`."""
    source = (
        '{{ with nomadVar "nomad/jobs/j" }}{{ range .Tuples }}{{ .K }}={{ .V }};{{ end }}{{ end }}'
    )
    assert "api_key=K;b=B;" == render(source, VARS.get)


def test_missing_variable_blocks_and_missing_key_is_no_value() -> None:
    """An absent variable raises MissingVariable; an absent item is empty unless strict
    (consul-template's items are a map of structs: a missing key is the zero item)."""
    with pytest.raises(MissingVariable) as missing:
        render('{{ with nomadVar "nomad/jobs/other" }}x{{ end }}', VARS.get)
    assert "nomad/jobs/other" == missing.value.path
    source = '{{ with nomadVar "nomad/jobs/j" }}{{ .nope }}{{ end }}'
    assert "" == render(source, VARS.get)
    with pytest.raises(TemplateError, match='no entry for key "nope"'):
        render(source, VARS.get, err_missing_key=True)


@pytest.mark.parametrize(
    "source",
    [
        '{{ with nomadVar "nomad/jobs/j" }}{{ .api_key | toUpper }}{{ end }}',
        '{{ key "consul/kv" }}',
        '{{ with nomadVar "nomad/jobs/j" }}unterminated',
        "{{ end }}",
        "{{ .api_key }}",
    ],
)
def test_unsupported_or_broken_templates_are_errors(source: str) -> None:
    """Anything outside the subset is a TemplateError, never a silent empty render."""
    with pytest.raises(TemplateError):
        render(source, VARS.get)


def test_env_file_parsing() -> None:
    """Comments, blank lines, `export` and quotes as in an env file."""
    text = "# c\n\nA=1\nexport B=\"two words\"\nC='x=y'\n"
    assert {"A": "1", "B": "two words", "C": "x=y"} == parse_env_file(text)


def test_render_task_templates_writes_files_and_refuses_escapes(tmp_path: Path) -> None:
    """Files land under the task dir with their perms; `../` destinations are refused."""
    templates = [
        {
            "EmbeddedTmpl": '{{ with nomadVar "nomad/jobs/j" }}K={{ .api_key }}{{ end }}',
            "DestPath": "secrets/k.env",
            "Envvars": True,
            "Perms": "0600",
        }
    ]
    assert {"K": "K"} == render_task_templates(templates, tmp_path, VARS.get)
    assert 0o600 == (tmp_path / "secrets" / "k.env").stat().st_mode & 0o777
    escaping = [{**templates[0], "DestPath": "../out.env"}]
    with pytest.raises(TemplateError, match="escapes"):
        render_task_templates(escaping, tmp_path / "task", VARS.get)


def test_workload_reads_only_its_own_job_paths() -> None:
    """Nomad's implicit workload access: exactly nomad/jobs, the job, group and task paths."""
    allowed = ["nomad/jobs", "nomad/jobs/j", "nomad/jobs/j/g", "nomad/jobs/j/g/t"]
    denied = ["nomad/jobs/j2", "nomad/jobs/j/g/t/x", "caravan/keys/m", "nomad/jobs/j/other"]
    assert all(workload_may_read(p, job_id="j", group="g", task="t") for p in allowed)
    assert not any(workload_may_read(p, job_id="j", group="g", task="t") for p in denied)


def test_variable_path_rules() -> None:
    """Nomad's path rules: charset and length, the reserved `nomad/` tree."""
    assert validate_path("caravan/engine-keys/m_1~x") is None
    assert validate_path("nomad/jobs/anything/below") is None
    assert validate_path("nomad/job-templates/t") is None
    assert validate_path("x" * 129) is not None
    assert validate_path("nomad/job-templates") is not None
    assert validate_path("nomad/other") is not None
