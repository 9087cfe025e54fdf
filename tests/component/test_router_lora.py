"""LoRA adapters through the router on devcluster's simulated vLLM (issue 25, routing).

One replica slot per replica (`max_loras: 1`) on two replicas and three good
adapters: the plan places two, the third is held nowhere. The router loads it
on demand (the request answers, the load time is in the request log), the
scheduler's next passes keep it where the router put it (the router reports
its demand), a bad adapter gets an OpenAI-shaped error naming it while the
others keep answering, and `/v1/models` lists the adapters with their parent.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import polling
import pytest

from caravan_llm.cli.local_stack import LocalStack, StackOptions, local_profile, local_stack
from caravan_llm.common.contract import KVLayout, decode_model_adapters
from caravan_llm.router.settings import RouterSettings
from caravan_llm.scheduler.model_store import ModelStore
from caravan_llm.scheduler.profiles import ModelProfile, load_profile

ROOT = Path(__file__).resolve().parents[2]
GOOD = ("a-one", "b-two", "c-three")


def lora_profile(root: Path) -> ModelProfile:
    for name in GOOD:
        folder = root / "loras" / name
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    profile = load_profile(ROOT / "examples" / "profiles" / "qwen-vllm-h100.yaml")
    document = profile.model_dump(mode="json", by_alias=True, exclude_none=True)
    document.update(
        drain_s=1,
        replicas={"min": 2, "max": 2},
        adapters=[
            *({"name": n, "source": str(root / "loras" / n), "rank": 8} for n in GOOD),
            {"name": "broken", "source": str(root / "loras" / "missing")},
        ],
        lora={"max_loras": 1, "max_lora_rank": 8},
    )
    document.pop("autoscaling", None)
    return ModelProfile.model_validate(document)


async def adapters_document(stack: LocalStack, model: str) -> Any:
    _, entry = await stack.scheduler.consul.kv_get(KVLayout().adapters_key(model))
    if entry is None:
        return None
    return decode_model_adapters(entry.value, key=entry.key, model=model)


@pytest.mark.slow
async def test_an_adapter_held_nowhere_is_loaded_on_demand_and_kept_by_the_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The router loads an unplaced adapter where it sends the request, the plan keeps it
    there, a bad adapter gets a clear error, and the model list shows each parent."""
    # The canonical request lines are written at info level.
    caplog.set_level(logging.INFO, logger="router.proxy")
    lines: list[dict[str, Any]] = []
    options = StackOptions(
        prefer_real_llama_server=False,
        gpus_per_node=4,
        autoscale=False,
        work_dir=tmp_path,
        resync_s=1.0,
        router=RouterSettings(
            port=0, scrape_interval_s=0.5, log_level="warning", adapter_demand_interval_s=0.5
        ),
        request_log=lines.append,
    )
    profile = lora_profile(tmp_path)
    async with local_stack(options) as stack:
        assert stack.router is not None
        router = stack.router
        await ModelStore(stack.scheduler.consul, KVLayout()).submit(
            [local_profile(profile, stack.engine)]
        )

        async def two_placed() -> Any:
            document = await adapters_document(stack, profile.name)
            if document is None or len(document.replicas) != 2:
                return None
            held = [set(r.loaded) for r in document.replicas]
            return document if all(len(h) == 1 for h in held) else None

        document = await polling.eventually(two_placed, 90, "two adapters placed")
        (unplaced,) = set(GOOD) - {n for r in document.replicas for n in r.loaded}

        async with aiohttp.ClientSession() as http:

            async def ask(model: str) -> tuple[int, dict[str, Any]]:
                body = {"model": model, "prompt": "hello", "max_tokens": 4}
                async with http.post(
                    f"{router.base_url}/v1/completions", json=body, headers=router.headers
                ) as answer:
                    return answer.status, await answer.json()

            async def routable() -> Any:
                async with http.get(f"{router.base_url}/v1/models", headers=router.headers) as r:
                    cards = {m["id"]: m for m in (await r.json())["data"]}
                return cards if profile.served_name in cards else None

            cards = await polling.eventually(routable, 30, "the router to list the model")
            assert dict.fromkeys((*GOOD, "broken"), profile.served_name) == {
                n: cards[n]["parent"] for n in (*GOOD, "broken")
            }
            assert str(tmp_path / "loras" / "a-one") == cards["a-one"]["root"]

            status, answer = await ask(unplaced)
            assert (200, unplaced) == (status, answer["model"])
            loaded_line = next(line for line in lines if line["model"] == unplaced)
            assert loaded_line["adapter_load_s"] is not None
            for _ in range(3):
                assert 200 == (await ask(unplaced))[0]
            assert [None, None, None] == [
                line["adapter_load_s"] for line in lines if line["model"] == unplaced
            ][1:]
            endpoint = loaded_line["endpoint"]

            status, answer = await ask("broken")
            assert 503 == status
            assert "adapter_unavailable" == answer["error"]["code"]
            assert "'broken'" in answer["error"]["message"]
            assert "No adapter found" in answer["error"]["message"]
            for name in GOOD:
                reply = await ask(name)
                assert (200, name) == (reply[0], reply[1].get("model")), reply
            assert 200 == (await ask(profile.served_name))[0]

            async def kept() -> Any:
                document = await adapters_document(stack, profile.name)
                holders = [
                    r
                    for r in document.replicas
                    if unplaced in r.loaded and unplaced in r.desired and r.alloc_id in endpoint
                ]
                return document if holders else None

            # The plan now wants the adapter where the router loaded it, pass after pass.
            await polling.eventually(kept, 30, "the plan to keep the router's copy")
            await stack.scheduler.controller.reconcile_once()
            await stack.scheduler.controller.reconcile_once()
            assert await kept() is not None
            document = await adapters_document(stack, profile.name)
            assert all(len(r.loaded) <= 1 for r in document.replicas)
