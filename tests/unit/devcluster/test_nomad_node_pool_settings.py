"""devcluster's simulated nodes declare Nomad node pools (issue 14 item 4)."""

from __future__ import annotations

import argparse

import pytest

from caravan_llm.devcluster.nomad.node_pools import built_in_pools, name_problem, nodes_in_pool
from caravan_llm.devcluster.nomad.settings import NodeSpec, add_nomad_arguments, settings_from_args


def test_gpu_node_pool_flag_puts_only_the_gpu_nodes_in_it():
    """`--gpu-node-pool gpu` puts the GPU nodes in `gpu`; CPU nodes stay in `default`."""
    parser = argparse.ArgumentParser()
    add_nomad_arguments(parser)
    args = parser.parse_args(["--nodes", "2", "--gpu-nodes", "1", "--gpu-node-pool", "gpu"])
    nodes = settings_from_args(args).nodes
    assert [("default", 0), ("default", 0), ("gpu", 8)] == [(n.node_pool, n.gpus) for n in nodes]


@pytest.mark.parametrize("pool", ["", "has space", "a/b", "x" * 129])
def test_invalid_pool_names_are_refused_with_nomads_rule(pool: str):
    """A node pool name outside Nomad's rule is refused, quoting the rule."""
    with pytest.raises(ValueError, match=r"must match regex"):
        NodeSpec(node_pool=pool)
    assert name_problem(pool) is not None


def test_pool_all_holds_every_node_and_default_only_its_own():
    """`all` lists every node; a named pool only the nodes that joined it."""
    pools = {"n1": "default", "n2": "gpu", "n3": "default"}
    assert ["n1", "n2", "n3"] == sorted(nodes_in_pool("all", pools))
    assert ["n1", "n3"] == sorted(nodes_in_pool("default", pools))
    assert ["n2"] == nodes_in_pool("gpu", pools)
    assert {"all", "default"} == set(built_in_pools())
