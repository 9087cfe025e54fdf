"""A profile may not choose what code its engine loads or where it listens, unless allowed."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from atomic_writes_harness import Cluster, caravan_cli, tiny

from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.profile_policy import ProfilePolicy

LD_PRELOAD = "env: {LD_PRELOAD: /tmp/evil.so}"


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


async def test_ld_preload_through_the_api_is_refused_and_nothing_written(writes_cluster: Cluster):
    """PUT of a profile with env LD_PRELOAD is a 400 naming LD_PRELOAD; KV is unchanged."""
    before = await writes_cluster.snapshot()
    text = tiny("alpha") + LD_PRELOAD + "\n"
    async with aiohttp.ClientSession() as session:
        url = f"{writes_cluster.api_url}/v1/models/alpha"
        async with session.put(url, data=text) as response:
            status, body = response.status, await response.json()
    assert 400 == status
    [problem] = body["error"]["problems"]
    assert problem.startswith("PUT /v1/models/alpha: env: LD_PRELOAD is refused")
    assert before == await writes_cluster.snapshot()


@pytest.mark.parametrize("through_scheduler", [False, True], ids=["direct", "scheduler"])
@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ('engine_args: ["--host", "0.0.0.0"]', "engine_args: --host"),
        ('engine_args: ["--path", "/"]', "engine_args: --path"),
        (LD_PRELOAD, "env: LD_PRELOAD"),
    ],
    ids=["host", "path", "ld-preload"],
)
async def test_cli_submit_refuses_with_the_name(
    writes_cluster: Cluster, tmp_path: Path, through_scheduler: bool, extra: str, named: str
):
    """`caravan submit` exits 1 with FILE: FIELD naming the refused value; nothing is written."""
    good = _write(tmp_path, "good.yaml", tiny("good"))
    bad = _write(tmp_path, "bad.yaml", tiny("bad") + extra + "\n")
    before = await writes_cluster.snapshot()
    through = ["--scheduler", writes_cluster.api_url] if through_scheduler else []
    code, _, err = await caravan_cli(writes_cluster.env, "submit", good, bad, *through)
    assert 1 == code
    assert f"{bad}: {named} " in err
    assert "Traceback" not in err
    assert before == await writes_cluster.snapshot()


async def test_operator_allow_list_admits_what_it_names(writes_cluster: Cluster, tmp_path: Path):
    """With the scheduler's published config allowing LD_PRELOAD, the same submit is written.

    Other refused names stay refused.
    """
    policy = ProfilePolicy(allow_env=("LD_PRELOAD",))
    await writes_cluster.store.publish_cluster_config(ClusterConfig(profile_policy=policy))
    allowed = _write(tmp_path, "allowed.yaml", tiny("allowed") + LD_PRELOAD + "\n")
    still_refused = _write(tmp_path, "refused.yaml", tiny("refused") + "env: {PYTHONPATH: /tmp}\n")
    code, out, err = await caravan_cli(writes_cluster.env, "submit", allowed)
    refused_code, _, refused_err = await caravan_cli(writes_cluster.env, "submit", still_refused)
    stored = await writes_cluster.store.read_models()
    assert (0, "", "submitted allowed\n") == (code, err, out)
    assert {"LD_PRELOAD": "/tmp/evil.so"} == dict(stored.profiles["allowed"].env)
    assert 1 == refused_code
    assert f"{still_refused}: env: PYTHONPATH is refused" in refused_err
    assert ["allowed"] == list(stored.profiles)
