"""The HCL snippets in the deployment docs are valid and keep the fmt layout."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from hcl_documents import JOBSPECS, ROOT, TERRAFORM, labelled_blocks, parse_hcl_text
from hcl_layout import layout_problems

from caravan_llm.common.contract import ROUTER_SERVICE, KVLayout

DEPLOY_DOC = ROOT / "docs" / "deploy.md"
DOCS = [DEPLOY_DOC, JOBSPECS / "README.md", TERRAFORM / "README.md"]
# A fenced block may sit indented inside a list item; its closing fence is
# indented the same way.
_HCL_FENCE = re.compile(r"^[ \t]*```hcl\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)


def hcl_snippets(path: Path) -> list[str]:
    return [
        textwrap.dedent(block) for block in _HCL_FENCE.findall(path.read_text(encoding="utf-8"))
    ]


def snippet_cases() -> list[tuple[Path, int, str]]:
    return [(path, index, text) for path in DOCS for index, text in enumerate(hcl_snippets(path))]


@pytest.mark.parametrize(
    ("path", "index", "text"),
    snippet_cases(),
    ids=[f"{path.relative_to(ROOT)}#{index}" for path, index, _ in snippet_cases()],
)
def test_hcl_snippet_parses_and_is_formatted(path: Path, index: int, text: str):
    """Each ```hcl block of the docs parses and is laid out as the formatters write it."""
    assert isinstance(parse_hcl_text(text), dict)
    assert [] == [str(problem) for problem in layout_problems(text)]


def test_scheduler_consul_policy_covers_the_kv_prefix_and_the_lock():
    """The documented scheduler policy writes under the default KV prefix and may hold sessions."""
    policy = next(
        text for text in hcl_snippets(DEPLOY_DOC) if "caravan-scheduler.consul-policy" in text
    )
    document = parse_hcl_text(policy)
    assert "write" == labelled_blocks(document, "key_prefix")[KVLayout().prefix]["policy"]
    assert "write" == labelled_blocks(document, "session_prefix")[""]["policy"]


def test_router_consul_policy_may_write_only_the_demand_signals():
    """The documented router policy reads caravan's KV and writes only the two demand prefixes
    (cold-start demand, and the LoRA adapters' demand figures)."""
    policy = next(
        text for text in hcl_snippets(DEPLOY_DOC) if "caravan-router.consul-policy" in text
    )
    key_prefixes = labelled_blocks(parse_hcl_text(policy), "key_prefix")
    layout = KVLayout()
    expected = {layout.prefix: "read", layout.demand: "write", layout.adapter_demand: "write"}
    assert expected == {prefix: rule["policy"] for prefix, rule in key_prefixes.items()}


def test_deploy_doc_shows_how_to_check_the_deployment():
    """The doc resolves the router through Consul DNS and asks it for its models."""
    text = DEPLOY_DOC.read_text(encoding="utf-8")
    assert f"{ROUTER_SERVICE}.service.consul SRV" in text
    assert "/v1/models" in text
