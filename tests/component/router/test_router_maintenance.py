"""A replica an operator puts into Consul maintenance mode gets no requests (devcluster Consul).

The router reads the health entries `caravan_llm.common.consul_api` decoded, checks and all, so
Consul's maintenance check (`_service_maintenance:<id>`) reaches the one aggregate
status and takes the endpoint out; turning maintenance off brings it back.
"""

from __future__ import annotations

import aiohttp
from router_cluster import (
    FakeEngine,
    chat_body,
    register_replica,
    routable_count,
    running_router,
    wait_until,
)

from caravan_llm.common.consul_api import CheckStatus, ConsulClient

MODEL = "tiny"


async def test_service_in_maintenance_is_not_routed_to_until_it_leaves_it(
    consul: ConsulClient, http: aiohttp.ClientSession
) -> None:
    async with FakeEngine(MODEL) as resting, FakeEngine(MODEL) as serving:
        resting_id = await register_replica(consul, MODEL, 0, resting.port, check="none")
        await register_replica(consul, MODEL, 1, serving.port, check="none")
        async with running_router(consul) as router:
            await wait_until(lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="2 eps")

            await consul.agent_service_maintenance(resting_id, enable=True, reason="upgrade")
            await wait_until(
                lambda: routable_count(router, MODEL) == 1, timeout_s=5, what="maintenance seen"
            )
            snapshot = router.runtime.state.view.snapshot
            assert CheckStatus.CRITICAL == snapshot.by_id[resting_id].status
            for index in range(4):
                async with http.post(
                    router.url + "/v1/chat/completions", json=chat_body(MODEL, f"{index}")
                ) as response:
                    assert 200 == response.status
            assert (0, 4) == (resting.requests, serving.requests)

            await consul.agent_service_maintenance(resting_id, enable=False)
            await wait_until(
                lambda: routable_count(router, MODEL) == 2, timeout_s=5, what="maintenance over"
            )
