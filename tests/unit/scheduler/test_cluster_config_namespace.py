"""The scheduler works in one Nomad namespace: the cluster config's, else NOMAD_NAMESPACE."""

from __future__ import annotations

from pathlib import Path

import pytest
from profile_builders import make_llamacpp

from caravan_llm.scheduler.cluster_config import (
    ClusterConfig,
    ClusterConfigError,
    with_nomad_namespace,
)
from caravan_llm.scheduler.render import render
from caravan_llm.scheduler.server import run
from caravan_llm.scheduler.settings import SchedulerSettings


def test_a_config_without_a_namespace_takes_nomad_namespace():
    """NOMAD_NAMESPACE names the replica jobs' namespace when the config names none."""
    assert "caravan" == with_nomad_namespace(ClusterConfig(), "caravan").namespace


def test_a_config_namespace_stays_without_nomad_namespace():
    """Without NOMAD_NAMESPACE the config's namespace (or `default`) is kept."""
    assert "caravan" == with_nomad_namespace(ClusterConfig(namespace="caravan"), None).namespace
    assert "default" == with_nomad_namespace(ClusterConfig(), None).namespace


def test_equal_namespaces_agree():
    """The same namespace in both places is accepted."""
    config = ClusterConfig(namespace="caravan")
    assert config == with_nomad_namespace(config, "caravan")


def test_different_namespaces_are_refused_naming_both():
    """A config namespace other than NOMAD_NAMESPACE is an error that names both."""
    with pytest.raises(ClusterConfigError) as raised:
        with_nomad_namespace(ClusterConfig(namespace="default"), "caravan")
    assert "'default'" in str(raised.value)
    assert "'caravan'" in str(raised.value)


def test_rendered_jobs_go_to_the_resolved_namespace():
    """A replica job rendered with the resolved config names NOMAD_NAMESPACE's namespace."""
    config = with_nomad_namespace(ClusterConfig(), "caravan")
    body = render(make_llamacpp(), 0, config=config)
    assert "caravan" == body["Job"]["Namespace"]


def test_scheduler_exits_2_when_the_namespaces_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """`caravan scheduler` refuses to start, saying why, when the two namespaces differ."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("namespace: other\n", encoding="utf-8")
    settings = SchedulerSettings(cluster_config=str(cluster), api_tokens=None, api_tokens_file=None)
    assert 2 == run(settings, {"NOMAD_NAMESPACE": "caravan"})
    assert "differs from NOMAD_NAMESPACE 'caravan'" in capsys.readouterr().err
