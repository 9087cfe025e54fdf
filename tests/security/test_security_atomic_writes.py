"""Validate everything, then write once: a refused or lost write leaves KV exactly as it was."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from atomic_writes_harness import (
    Cluster,
    InterferingKV,
    caravan_cli,
    tiny,
)
from prometheus_client import CollectorRegistry

from caravan_llm.scheduler.api import create_api
from caravan_llm.scheduler.model_service import SubmissionRejectedError
from caravan_llm.scheduler.model_store import (
    WRITE_ATTEMPTS,
    ScaleOutOfBoundsError,
    WriteConflictError,
)


async def test_mismatched_put_writes_nothing(writes_cluster: Cluster):
    """PUT /v1/models/alpha with a profile named beta is 400 and writes no key at all."""
    before = await writes_cluster.snapshot()
    async with aiohttp.ClientSession() as session:
        url = f"{writes_cluster.api_url}/v1/models/alpha"
        async with session.put(url, data=tiny("beta")) as response:
            status, body = response.status, await response.json()
    assert 400 == status
    assert "nothing was written" in body["error"]["message"]
    assert [
        "PUT /v1/models/alpha: name: the profile is named 'beta' but was sent as 'alpha'"
    ] == body["error"]["problems"]
    assert before == await writes_cluster.snapshot()


async def test_put_with_matching_name_is_written(writes_cluster: Cluster):
    """The same PUT under the right name is accepted and stored."""
    async with aiohttp.ClientSession() as session:
        url = f"{writes_cluster.api_url}/v1/models/beta"
        async with session.put(url, data=tiny("beta")) as response:
            status = response.status
    stored = await writes_cluster.store.read_models()
    assert 200 == status
    assert ["beta"] == list(stored.profiles)


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("through_scheduler", [False, True], ids=["direct", "scheduler"])
async def test_multi_document_submit_with_one_bad_document_writes_nothing(
    writes_cluster: Cluster, tmp_path: Path, through_scheduler: bool
):
    """`caravan submit good.yaml bad.yaml` exits 1 naming the file and field; KV is unchanged."""
    await writes_cluster.store.submit([])  # a revision key exists too, so "unchanged" covers it
    good = _write(tmp_path, "good.yaml", tiny("good"))
    bad = _write(tmp_path, "bad.yaml", "name: bad\nmodel: m\nengine: vllm\n")
    before = await writes_cluster.snapshot()
    extra = ["--scheduler", writes_cluster.api_url] if through_scheduler else []
    code, out, err = await caravan_cli(writes_cluster.env, "submit", good, bad, *extra)
    assert 1 == code
    assert "" == out
    assert f"{bad}: gpu: engine 'vllm' needs a gpu block" in err
    assert err.rstrip().endswith("nothing was submitted")
    assert "Traceback" not in err
    assert before == await writes_cluster.snapshot()


@pytest.mark.parametrize("through_scheduler", [False, True], ids=["direct", "scheduler"])
async def test_multi_document_submit_writes_all_in_one_transaction(
    writes_cluster: Cluster, tmp_path: Path, through_scheduler: bool
):
    """A valid set is written at once: every profile carries the same ModifyIndex."""
    files = [_write(tmp_path, f"{n}.yaml", tiny(n)) for n in ("one", "two", "three")]
    extra = ["--scheduler", writes_cluster.api_url] if through_scheduler else []
    code, out, err = await caravan_cli(writes_cluster.env, "submit", *files, *extra)
    _, entries = await writes_cluster.client.kv_get_recurse(writes_cluster.layout.models)
    assert (0, "") == (code, err)
    assert ["submitted one", "submitted two", "submitted three"] == out.splitlines()
    assert ["one", "three", "two"] == [e.key.rsplit("/", 1)[1] for e in entries]
    assert 1 == len({e.modify_index for e in entries})


async def test_served_name_clash_with_a_stored_model_is_refused_naming_it(writes_cluster: Cluster):
    """A profile whose served name another stored model serves is refused, naming that model."""
    service = writes_cluster.service()
    await service.submit([("alpha.yaml", tiny("alpha", served="shared-name"))])
    before = await writes_cluster.snapshot()
    with pytest.raises(SubmissionRejectedError) as refused:
        await service.submit([("beta.yaml", tiny("beta", served="shared-name"))])
    expected = (
        "beta.yaml: served_model_name: 'shared-name' is already served by model 'alpha'; "
        "choose another served_model_name or delete alpha first"
    )
    assert [expected] == [str(p) for p in refused.value.problems]
    assert before == await writes_cluster.snapshot()


async def test_served_name_clash_through_the_cli_names_the_other_model(
    writes_cluster: Cluster, tmp_path: Path
):
    """Through the scheduler's API too, the refusal names the model already serving the name."""
    await writes_cluster.service().submit([("alpha.yaml", tiny("alpha", served="shared-name"))])
    beta = _write(tmp_path, "beta.yaml", tiny("beta", served="shared-name"))
    before = await writes_cluster.snapshot()
    code, _, err = await caravan_cli(
        writes_cluster.env, "submit", beta, "--scheduler", writes_cluster.api_url
    )
    assert 1 == code
    assert f"{beta}: served_model_name: 'shared-name' is already served by model 'alpha'" in err
    assert before == await writes_cluster.snapshot()


async def test_served_name_clash_within_one_submission_is_refused(writes_cluster: Cluster):
    """Two documents of one submission may not share a served name either."""
    before = await writes_cluster.snapshot()
    with pytest.raises(SubmissionRejectedError) as refused:
        await writes_cluster.service().submit(
            [("a.yaml", tiny("a", served="same")), ("b.yaml", tiny("b", served="same"))]
        )
    assert ["b.yaml: served_model_name: 'same' is also served by model 'a' in a.yaml"] == [
        str(p) for p in refused.value.problems
    ]
    assert before == await writes_cluster.snapshot()


async def test_resubmitting_a_model_keeps_its_own_served_name(writes_cluster: Cluster):
    """Replacing a model with a new version of itself is not a clash with itself."""
    service = writes_cluster.service()
    await service.submit([("alpha.yaml", tiny("alpha", served="shared-name"))])
    await service.submit([("alpha.yaml", tiny("alpha", served="shared-name", drain_s="20"))])
    stored = await writes_cluster.store.read_models()
    assert 20 == stored.profiles["alpha"].drain_s


async def test_lost_race_is_revalidated_from_a_fresh_read(writes_cluster: Cluster):
    """A clashing model written between our read and our write is seen on the retry: refused.

    The other writer's model stays; ours is not written.
    """
    other = writes_cluster.service()

    async def concurrent_submit() -> None:
        await other.submit([("rival.yaml", tiny("rival", served="contested"))])

    kv = InterferingKV(writes_cluster.client, concurrent_submit, times=1)
    with pytest.raises(SubmissionRejectedError) as refused:
        await writes_cluster.service(kv=kv).submit(
            [("mine.yaml", tiny("mine", served="contested"))]
        )
    stored = await writes_cluster.store.read_models()
    assert 1 == kv.transactions
    assert "already served by model 'rival'" in str(refused.value)
    assert ["rival"] == list(stored.profiles)


async def test_lost_race_retried_then_written(writes_cluster: Cluster):
    """An unrelated concurrent write makes our transaction fail once; the retry writes it."""
    other = writes_cluster.service()

    async def unrelated_submit() -> None:
        await other.submit([("other.yaml", tiny("other"))])

    kv = InterferingKV(writes_cluster.client, unrelated_submit, times=1)
    await writes_cluster.service(kv=kv).submit([("mine.yaml", tiny("mine"))])
    stored = await writes_cluster.store.read_models()
    assert 2 == kv.transactions
    assert ["mine", "other"] == sorted(stored.profiles)


async def test_a_race_lost_every_time_is_a_clear_conflict_and_writes_nothing(
    writes_cluster: Cluster,
):
    """When every attempt loses, the answer is WriteConflictError (API: 409), nothing of ours."""

    async def keep_writing() -> None:
        await writes_cluster.store.submit([])  # bumps the revision every time

    kv = InterferingKV(writes_cluster.client, keep_writing, times=100)
    with pytest.raises(WriteConflictError) as conflict:
        await writes_cluster.service(kv=kv).submit([("mine.yaml", tiny("mine"))])
    stored = await writes_cluster.store.read_models()
    assert WRITE_ATTEMPTS == kv.transactions
    assert conflict.value.retryable
    assert "nothing was written" in str(conflict.value)
    assert {} == dict(stored.profiles)


async def test_scale_racing_a_profile_change_is_checked_again(writes_cluster: Cluster):
    """A scale whose profile's bounds change before the write re-reads them and refuses."""
    await writes_cluster.service().submit([("m.yaml", tiny("m"))])  # replicas 1..2

    async def narrow_bounds() -> None:
        narrowed = tiny("m").replace("max: 2", "max: 1")
        await writes_cluster.service().submit([("m.yaml", narrowed)])

    kv = InterferingKV(writes_cluster.client, narrow_bounds, times=1)
    with pytest.raises(ScaleOutOfBoundsError) as refused:
        await writes_cluster.service(kv=kv).scale("m", 2)
    _, desired = await writes_cluster.client.kv_get(writes_cluster.layout.desired_key("m"))
    assert 1 == kv.transactions
    assert "outside replicas.min..max (1..1)" in str(refused.value)
    assert desired is None


async def test_scale_retries_a_lost_race_and_writes(writes_cluster: Cluster):
    """A scale whose profile was rewritten (same bounds) before the write is retried."""
    await writes_cluster.service().submit([("m.yaml", tiny("m"))])

    async def rewrite() -> None:
        await writes_cluster.service().submit([("m.yaml", tiny("m", drain_s="30"))])

    kv = InterferingKV(writes_cluster.client, rewrite, times=1)
    profile = await writes_cluster.service(kv=kv).scale("m", 2)
    _, desired = await writes_cluster.client.kv_get(writes_cluster.layout.desired_key("m"))
    assert 2 == kv.transactions
    assert 30 == profile.drain_s
    assert desired is not None
    assert b"2" == desired.value


async def test_delete_removes_everything_of_the_model_at_once(writes_cluster: Cluster):
    """Delete removes the profile, desired count and autoscaler memory in one transaction."""
    service = writes_cluster.service()
    await service.submit([("m.yaml", tiny("m")), ("k.yaml", tiny("k"))])
    await service.scale("m", 2)
    await writes_cluster.store.put_autoscaler_state("m", "{}")
    await service.delete("m")
    keys = [key for key, _, _ in await writes_cluster.snapshot()]
    assert [
        "caravan/models-revision",
        "caravan/models/k",
    ] == keys


async def test_api_answers_a_lost_race_with_409(writes_cluster: Cluster):
    """The HTTP API reports WriteConflictError as a JSON 409, never a 500."""

    async def keep_writing() -> None:
        await writes_cluster.store.submit([])

    kv = InterferingKV(writes_cluster.client, keep_writing, times=100)
    app = create_api(writes_cluster.service(kv=kv), CollectorRegistry(), lambda: True)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/models/mine"
        async with aiohttp.ClientSession() as session:
            async with session.put(url, data=tiny("mine")) as response:
                status, body = response.status, await response.json()
    finally:
        await runner.cleanup()
    assert 409 == status
    assert "conflict" == body["error"]["type"]


async def test_post_models_refuses_a_malformed_body(writes_cluster: Cluster):
    """POST /v1/models with a body that is not a list of documents is a JSON 400."""
    async with aiohttp.ClientSession() as session:
        url = f"{writes_cluster.api_url}/v1/models"
        async with session.post(url, data="[1, 2]") as response:
            status, body = response.status, await response.json()
    assert 400 == status
    assert "invalid_request" == body["error"]["type"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/v1/models/deep", "[" * 20000),
        ("POST", "/v1/models", "[" * 200000),
        (
            "POST",
            "/v1/models",
            '{"documents": [{"source": "d.yaml", "text": "' + "[" * 20000 + '"}]}',
        ),
    ],
    ids=["put-yaml", "post-json", "post-yaml"],
)
async def test_deeply_nested_documents_are_400_not_500(
    writes_cluster: Cluster, method: str, path: str, body: str
):
    """A hostile, deeply nested body is refused as invalid; nothing is written."""
    before = await writes_cluster.snapshot()
    async with aiohttp.ClientSession() as session:
        url = f"{writes_cluster.api_url}{path}"
        async with session.request(method, url, data=body) as response:
            status, answer = response.status, await response.json()
    assert 400 == status
    assert answer["error"]["type"] in ("invalid_profile", "invalid_request")
    assert before == await writes_cluster.snapshot()
