"""docs/deploy.md says what the code does about engine images and node pools (issue 14)."""

from __future__ import annotations

import re

import yaml
from hcl_documents import ROOT, parse_hcl_text
from test_deploy_docs import DEPLOY_DOC, hcl_snippets

from caravan_llm.cli.local_stack import StackOptions
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.engines.base import SHM_BYTES_MIN, SHM_BYTES_PER_RANK
from caravan_llm.scheduler.placement_explain import ReplicaAsk, explain_failed_placement
from caravan_llm.scheduler.profiles import ModelProfile
from caravan_llm.scheduler.render import render

GIB = 1024**3
_YAML_FENCE = re.compile(r"^```yaml\n(.*?)^```", re.DOTALL | re.MULTILINE)


def doc_text() -> str:
    return DEPLOY_DOC.read_text(encoding="utf-8")


def flat(text: str) -> str:
    """The text with line breaks and runs of spaces folded, as prose is wrapped."""
    return " ".join(text.split())


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_image_table_names_the_pinned_defaults_by_key():
    """Each default image appears in the doc's table beside its cluster config key."""
    config = ClusterConfig()
    text = doc_text()
    for key, value in (
        ("vllm.image", config.vllm.image),
        ("llamacpp.image", config.llamacpp.image),
        ("llamacpp.cuda_image", config.llamacpp.cuda_image),
        ("llamacpp.binary", config.llamacpp.binary),
    ):
        row = next((row for row in table_rows(text) if f"`{key}`" in row), "")
        assert f"`{value}`" in row, f"{key}: the doc's row {row!r} does not name {value}"


def test_shared_memory_sizes_match_the_adapter():
    """The doc's /dev/shm sizes are the vLLM adapter's."""
    text = flat(doc_text())
    assert f"{SHM_BYTES_PER_RANK // GIB} GiB per tensor-parallel rank" in text
    assert f"at least {SHM_BYTES_MIN // GIB} GiB" in text
    assert "`shm_size`" in text


def test_node_pool_table_names_the_defaults_by_key():
    """The doc's node pool defaults are the cluster config's."""
    pools = ClusterConfig().node_pools
    text = doc_text()
    for key, value in (("node_pools.cpu", pools.cpu), ("node_pools.gpu", pools.gpu)):
        row = next((row for row in table_rows(text) if f"`{key}`" in row), "")
        assert f"`{value}`" in row, f"{key}: the doc's row {row!r} does not name {value}"


def test_cluster_config_snippet_is_valid_and_uses_the_pool_the_clients_join():
    """The doc's `node_pools` snippet validates and names the pool its client snippet joins."""
    snippet = next(block for block in _YAML_FENCE.findall(doc_text()) if "node_pools" in block)
    config = ClusterConfig.model_validate(yaml.safe_load(snippet))
    client = next(parse_hcl_text(text) for text in hcl_snippets(DEPLOY_DOC) if "node_pool" in text)
    (block,) = client["client"]
    assert config.node_pools.gpu == block["node_pool"]
    # The demo and the component tests put their GPU nodes in the same pool.
    assert StackOptions().gpu_node_pool == block["node_pool"]


def test_waiting_example_is_what_status_says():
    """The doc's example of a waiting CPU replica is the explanation caravan gives."""
    profile = ModelProfile.model_validate(
        {"name": "m", "model": "/m.gguf", "engine": "llamacpp", "resources": {"cpu_mhz": 4000}}
    )
    ask = ReplicaAsk.from_job(render(profile, 0)["Job"])
    metric = {"NodesEvaluated": 2, "NodesInPool": 2, "DimensionExhausted": {"cpu": 2}}
    assert flat(explain_failed_placement(metric, ask)) in flat(doc_text())


def test_readme_profile_table_has_node_pool():
    """The README's profile reference lists `node_pool`."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert any(line.startswith("| `node_pool` |") for line in readme.splitlines())
