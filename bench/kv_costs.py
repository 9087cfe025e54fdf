"""What precise prefix routing costs (issue 24): the KV feed, the relay, memory, the lookup.

    .venv/bin/python bench/kv_costs.py              # every part (about a minute)
    .venv/bin/python bench/kv_costs.py --quick      # fewer samples
    .venv/bin/python bench/kv_costs.py --parts feed,lookup

Parts, each printed as a markdown table (docs/benchmarks.md, "Precise prefix
routing"):

- `feed`: the router's side of one replica's digest stream. A stand-in relay
  (a separate process, so its CPU is not counted) serves a snapshot and then
  N deltas as fast as the socket takes them; the router's own `KvFeed`
  (aiohttp client, `SseDecoder`, `KvIndex.apply_delta`, the events counter)
  reads them into a `RoutingState`. Reported: deltas per second absorbed
  and the CPU of this process per delta and per digest, for deltas of 1, 8
  and 32 blocks added and as many removed (one engine batch each: decode
  steps store nothing, a 512-token prefill chunk stores 32 blocks of 16).
- `relay`: the relay's side, per engine batch: ZeroMQ frame decode
  (`wire.decode_frame`), `relay_events`, `RelayState.apply` (the keyed
  digests of the stored blocks' token ids), `encode_delta` once.
- `memory`: tracemalloc over a `KvIndex` holding a million digests (one
  replica, and 8 replicas of 125k) and over a `RelayState` holding a million
  engine blocks.
- `lookup`: what routing a request on events adds once its token ids are
  known: `exact_prompt` (the prompt's block digests) and `cached_prefixes`
  over 8 replicas, at 1k and 8k prompt tokens, block sizes 16 and 128, in
  CPU time of the thread (on a dedicated core, the wall time; on this shared
  machine wall-clock percentiles measure the other jobs). The tokenization
  itself is `bench/tokenize_cost.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from caravan_llm.common.block_digest import BlockDigest, DigestKey, block_digests  # noqa: E402
from caravan_llm.common.kv_stream import (  # noqa: E402
    STREAM_PATH,
    KvDelta,
    KvSnapshot,
    encode_delta,
    encode_heartbeat,
    encode_snapshot,
)
from caravan_llm.router.core.kv_index import KvIndex  # noqa: E402

KEY = "bench-engine-key-for-kv-costs"
BLOCK = 16
EPOCH = 7


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _random_digests(rng: random.Random, count: int) -> list[BlockDigest]:
    return [BlockDigest(rng.getrandbits(64)) for _ in range(count)]


# -- feed -----------------------------------------------------------------------------------


def delta_stream(deltas: int, size: int, resident: int, seed: int) -> list[bytes]:
    """A snapshot of `resident` digests, then `deltas` deltas adding and removing `size` each."""
    rng = random.Random(seed)
    held = _random_digests(rng, resident)
    chunks = [encode_snapshot(KvSnapshot(EPOCH, 0, BLOCK, frozenset(held)))]
    window = list(held)
    for seq in range(1, deltas + 1):
        added = tuple(_random_digests(rng, size))
        removed = tuple(window[:size])
        del window[:size]
        window.extend(added)
        chunks.append(encode_delta(KvDelta(EPOCH, seq, BLOCK, added, removed)))
    chunks.append(encode_heartbeat(KvSnapshot(EPOCH, deltas, BLOCK, frozenset())))
    return chunks


def serve_stream(deltas: int, size: int, resident: int) -> None:
    """(subprocess) A stand-in relay: the stream to the first caller, then hold it open."""
    from aiohttp import web  # noqa: PLC0415

    chunks = delta_stream(deltas, size, resident, seed=size)

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        batch: list[bytes] = []
        for chunk in chunks:
            batch.append(chunk)
            if len(batch) >= 64:
                await response.write(b"".join(batch))
                batch = []
        if batch:
            await response.write(b"".join(batch))
        await asyncio.sleep(3600)
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_get(STREAM_PATH, stream)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"port {runner.addresses[0][1]}", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())


@dataclasses.dataclass(frozen=True)
class FeedResult:
    size: int
    deltas: int
    wall_s: float
    cpu_s: float

    @property
    def per_second(self) -> float:
        return self.deltas / self.wall_s

    @property
    def cpu_us_per_delta(self) -> float:
        return 1e6 * self.cpu_s / self.deltas


async def measure_feed(deltas: int, size: int, resident: int) -> FeedResult:
    import aiohttp  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    sys.path.insert(0, str(REPO / "tests" / "unit" / "router"))
    from router_builders import endpoint_entry, live_for, snapshot_of  # noqa: PLC0415

    from caravan_llm.router.core.routing_state import RoutingState, RoutingView  # noqa: PLC0415
    from caravan_llm.router.feeds.kv_feed import KvFeed  # noqa: PLC0415
    from caravan_llm.router.metrics import RouterMetrics  # noqa: PLC0415

    server = subprocess.Popen(  # noqa: ASYNC220 - started once, before the measured part
        [sys.executable, __file__, "serve", str(deltas), str(size), str(resident)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[1])
        snapshot = snapshot_of(endpoint_entry("replica-0"))
        snapshot = dataclasses.replace(
            snapshot,
            by_id={
                eid: dataclasses.replace(e, address="127.0.0.1", kv_port=port)
                for eid, e in snapshot.by_id.items()
            },
        )

        class Keys:
            def key_for(self, service: str) -> str | None:
                del service
                return KEY

        state = RoutingState(KvIndex(stale_after_s=60.0))
        async with aiohttp.ClientSession() as session:
            feed = KvFeed(
                lambda: session,
                state,
                engine_keys=Keys(),
                metrics=RouterMetrics(CollectorRegistry()),
                stale_after_s=60.0,
            )
            gc.collect()
            wall = time.perf_counter()
            cpu = time.process_time()
            task = asyncio.create_task(feed.run())
            state.swap(RoutingView(snapshot=snapshot), live_for(snapshot), synced=True)
            # Polled: the index has no hook (each wake-up is a few us of the CPU counted).
            while state.kv.position("replica-0") != (EPOCH, deltas):  # noqa: ASYNC110
                await asyncio.sleep(0.001)
            result = FeedResult(size, deltas, time.perf_counter() - wall, time.process_time() - cpu)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return result
    finally:
        server.kill()
        server.wait()


def part_feed(quick: bool) -> None:
    deltas = 5000 if quick else 20000
    resident = 100_000
    print(
        f"\n### feed: one replica's stream into the router's KvIndex "
        f"({deltas} deltas, {resident} digests held)\n"
    )
    print("| blocks added + removed per delta | deltas/s | CPU us per delta | CPU us per digest |")
    print("|---|---|---|---|")
    for size in (1, 8, 32):
        runs = [asyncio.run(measure_feed(deltas, size, resident)) for _ in range(3)]
        best = min(runs, key=lambda r: r.cpu_s)
        print(
            f"| {size} + {size} | {best.per_second:.0f} | {best.cpu_us_per_delta:.1f} | "
            f"{best.cpu_us_per_delta / (2 * size):.2f} |"
        )


# -- relay ----------------------------------------------------------------------------------


def part_relay(quick: bool) -> None:
    from caravan_llm.kvrelay.events import relay_events  # noqa: PLC0415
    from caravan_llm.kvrelay.state import RelayState  # noqa: PLC0415
    from caravan_llm.kvrelay.wire import (  # noqa: PLC0415
        BlockRemoved,
        BlockStored,
        decode_frame,
        encode_batch,
    )

    batches = 2000 if quick else 8000
    print(f"\n### relay: one engine batch through the relay ({batches} batches)\n")
    print(
        "| block size | blocks stored + removed per batch | encoding | CPU us per batch "
        "| CPU us per block |"
    )
    print("|---|---|---|---|---|")
    for block_size, size in ((16, 1), (16, 8), (16, 32), (128, 4)):
        for encoding in ("map", "array"):
            rng = random.Random(size)
            frames = []
            previous: list[int] = []
            next_hash = 1
            for seq in range(batches):
                hashes = list(range(next_hash, next_hash + size))
                next_hash += size
                events: list[BlockStored | BlockRemoved] = [
                    BlockStored(
                        block_hashes=tuple(hashes),
                        parent_block_hash=None,
                        token_ids=tuple(rng.randrange(50000) for _ in range(size * block_size)),
                        block_size=block_size,
                        medium="GPU",
                    )
                ]
                if previous:
                    events.append(BlockRemoved(block_hashes=tuple(previous), medium="GPU"))
                previous = hashes
                frames.append(encode_batch(seq, events, encoding=encoding, topic=b"kv-events"))
            state = RelayState(epoch=1, block_size=block_size, key=DigestKey.from_secret(KEY))
            gc.collect()
            cpu = time.process_time()
            for frame in frames:
                batch = decode_frame(frame)
                applied = state.apply(batch.seq, relay_events(batch).events)
                if applied.delta is not None:
                    encode_delta(applied.delta)
            spent = time.process_time() - cpu
            print(
                f"| {block_size} | {size} + {size} | {encoding} | {1e6 * spent / batches:.1f} | "
                f"{1e6 * spent / batches / (2 * size):.2f} |"
            )


# -- memory ---------------------------------------------------------------------------------


def _traced(build: object) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()  # type: ignore[operator]
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before, kept


def part_memory(quick: bool) -> None:
    from caravan_llm.kvrelay.state import RelayState, StoredBlocks  # noqa: PLC0415

    million = 250_000 if quick else 1_000_000
    scale = 1_000_000 / million
    rng = random.Random(1)
    print(f"\n### memory per million cached blocks (tracemalloc, {million} blocks built)\n")
    print("| what | MB per million blocks | bytes per block |")
    print("|---|---|---|")

    def one_replica() -> KvIndex:
        index = KvIndex()
        digests = frozenset(_random_digests(rng, million))
        index.apply_snapshot("r0", KvSnapshot(1, 0, BLOCK, digests), 0.0)
        return index

    def eight_replicas() -> KvIndex:
        index = KvIndex()
        for replica in range(8):
            digests = frozenset(_random_digests(rng, million // 8))
            index.apply_snapshot(f"r{replica}", KvSnapshot(1, 0, BLOCK, digests), 0.0)
        return index

    def relay_state() -> RelayState:
        state = RelayState(
            epoch=1, block_size=BLOCK, key=DigestKey.from_secret(KEY), max_blocks=2 * million
        )
        per_event = 64
        parent: int | None = None
        for seq, start in enumerate(range(0, million, per_event)):
            hashes = tuple(rng.getrandbits(63) for _ in range(per_event))
            tokens = tuple(rng.randrange(50000) for _ in range(per_event * BLOCK))
            state.apply(seq, (StoredBlocks(hashes, parent, tokens, BLOCK),))
            parent = hashes[-1] if start % 4096 else None
        return state

    for name, build in (
        ("router KvIndex, one replica", one_replica),
        ("router KvIndex, 8 replicas", eight_replicas),
        ("relay RelayState (one engine)", relay_state),
    ):
        size, kept = _traced(build)
        del kept
        print(f"| {name} | {scale * size / 1e6:.0f} | {size / million:.0f} |")


# -- lookup ---------------------------------------------------------------------------------


def part_lookup(quick: bool) -> None:
    from caravan_llm.router.core.prompt_digests import exact_prompt  # noqa: PLC0415

    samples = 300 if quick else 1500
    key = DigestKey.from_secret(KEY)
    rng = random.Random(2)
    print(
        f"\n### lookup: the prompt's digests and 8 replicas' lookups, token ids given "
        f"({samples} requests per row)\n"
    )
    print(
        "| prompt tokens | block size | digests p50 us | p99 | lookup (8 replicas) p50 us "
        "| p99 | total p50 ms | p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (1024, 8192):
        for block_size in (16, 128):
            # Eight replicas; each holds a random share of a few shared prefixes.
            prompts = [[rng.randrange(50000) for _ in range(tokens)] for _ in range(8)]
            index = KvIndex()
            for replica in range(8):
                held: set[BlockDigest] = set(_random_digests(rng, 50_000))
                for prompt in prompts:
                    chain = block_digests(prompt, block_size=block_size, key=key)
                    held.update(chain[: rng.randrange(len(chain) + 1)])
                index.apply_snapshot(
                    f"r{replica}", KvSnapshot(1, 0, block_size, frozenset(held)), 0.0
                )
            replicas = [f"r{i}" for i in range(8)]
            digest_us: list[float] = []
            lookup_us: list[float] = []
            for n in range(samples):
                # A known prefix (3/4 of the prompt) and a new tail: the common case.
                prompt = prompts[n % 8][: 3 * tokens // 4] + [
                    rng.randrange(50000) for _ in range(tokens // 4)
                ]
                # CPU time of this thread: what the router's loop spends, whatever else runs.
                started = time.thread_time()
                exact = exact_prompt(
                    prompt, keys={"caravan-bench": key}, kinds={("caravan-bench", block_size)}
                )
                middle = time.thread_time()
                index.cached_prefixes(
                    exact.digests["caravan-bench", block_size],
                    block_size=block_size,
                    replicas=replicas,
                    now=0.0,
                )
                done = time.thread_time()
                digest_us.append(1e6 * (middle - started))
                lookup_us.append(1e6 * (done - middle))
            total = [a + b for a, b in zip(digest_us, lookup_us, strict=True)]
            print(
                f"| {tokens} | {block_size} | {statistics.median(digest_us):.0f} | "
                f"{_percentile(digest_us, 0.99):.0f} | {statistics.median(lookup_us):.0f} | "
                f"{_percentile(lookup_us, 0.99):.0f} | {statistics.median(total) / 1e3:.2f} | "
                f"{_percentile(total, 0.99) / 1e3:.2f} |"
            )


PARTS = {"feed": part_feed, "relay": part_relay, "memory": part_memory, "lookup": part_lookup}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve_stream(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        print(f"unknown parts: {unknown} (known: {', '.join(PARTS)})", file=sys.stderr)
        return 2
    print(f"Python {sys.version.split()[0]}, cores: {len(__import__('os').sched_getaffinity(0))}")
    for name in args.parts.split(","):
        PARTS[name](args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
