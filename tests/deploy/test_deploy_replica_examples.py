"""jobspecs/examples/: the reference replica jobs are what `caravan render` prints today."""

from __future__ import annotations

import json

import pytest
from hcl_documents import JOBSPECS, ROOT

from caravan_llm.cli.main import main

EXAMPLES = JOBSPECS / "examples"
PROFILES = ROOT / "examples" / "profiles"

# Reference file -> (profile, replica) it is rendered from: one per engine.
RENDERED_FROM = {
    "vllm-replica.json": ("qwen-vllm-h100.yaml", 0),
    "llamacpp-replica.json": ("tiny-llamacpp-cpu.yaml", 0),
    "sglang-replica.json": ("qwen3-sglang-h100.yaml", 0),
}


@pytest.mark.parametrize(("name", "source"), sorted(RENDERED_FROM.items()))
def test_example_is_the_render_output(
    name: str, source: tuple[str, int], capsys: pytest.CaptureFixture[str], update_golden: bool
):
    """Each reference job is byte for byte what `caravan render PROFILE --replica N` prints."""
    profile, replica = source
    code = main(["render", str(PROFILES / profile), "--replica", str(replica)])
    rendered = capsys.readouterr().out
    assert code == 0
    path = EXAMPLES / name
    if update_golden:
        path.write_text(rendered, encoding="utf-8")
    assert path.read_text(encoding="utf-8") == rendered


def test_examples_cover_each_engine_once():
    """The reference jobs are exactly the listed files, one replica per engine."""
    assert sorted(RENDERED_FROM) == sorted(path.name for path in EXAMPLES.iterdir())
    engines = [
        json.loads((EXAMPLES / name).read_text(encoding="utf-8"))["Job"]["Meta"]["caravan_engine"]
        for name in sorted(RENDERED_FROM)
    ]
    assert ["llamacpp", "sglang", "vllm"] == engines


def test_examples_are_documented():
    """jobspecs/README.md names each reference job and the command that made it."""
    readme = (JOBSPECS / "README.md").read_text(encoding="utf-8")
    for name, (profile, replica) in RENDERED_FROM.items():
        assert f"examples/{name}" in readme
        assert f"caravan render examples/profiles/{profile} --replica {replica}" in readme
