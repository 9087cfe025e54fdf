"""Golden files: the rendered jobs of the example profiles (`make golden` rewrites them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nomad_facts import nomad_fact_violations

from caravan_llm.scheduler.profiles import load_profile
from caravan_llm.scheduler.render import render

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples" / "profiles").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden"


def test_there_are_examples_for_each_kind():
    """The examples include vLLM and SGLang TP-2 profiles, a CPU and a GPU llama.cpp one."""
    profiles = [load_profile(path) for path in EXAMPLES]
    assert any(p.engine == "vllm" and p.tensor_parallel == 2 for p in profiles)
    assert any(p.engine == "llamacpp" and not p.uses_gpu for p in profiles)
    assert any(p.engine == "llamacpp" and p.uses_gpu for p in profiles)
    assert any(p.engine == "sglang" and p.tensor_parallel == 2 for p in profiles)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_renders_to_its_golden_file(path: Path, update_golden: bool):
    """Each example profile renders (replica 0) exactly to its golden JSON."""
    body = render(load_profile(path), 0)
    assert nomad_fact_violations(body) == []
    golden = GOLDEN / f"{path.stem}.job.json"
    text = json.dumps(body, indent=2, sort_keys=True) + "\n"
    if update_golden:
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), f"missing {golden}; run `make golden`"
    assert golden.read_text(encoding="utf-8") == text
