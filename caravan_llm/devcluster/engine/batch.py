"""The simulated engines' performance model: continuous batching over a paged KV cache.

This is the decision core (admit, step, evict, preempt). It holds state but no
clock, no I/O and no asyncio: the caller passes `now` in and sleeps for the
durations it returns, so tests drive it as plain function calls.

How a step works, in the order a real continuous-batching engine does it:

1. Running sequences go first, in admission order. Each computes what it
   still needs (one token when decoding, a chunk of its prompt while
   prefilling), within a per-step token budget (chunked prefill). A sequence
   that needs a KV block when none is free preempts the most recently
   admitted one (vLLM's recompute preemption): its blocks are released and it
   goes back to the head of the queue.
2. Waiting sequences are admitted first-in first-out while a sequence slot,
   budget and KV blocks remain. Prompt blocks found in the prefix cache are
   reused and skip prefill.
3. The step lasts `step_seconds + decode_seconds_per_seq * decoding sequences
   + prefill_seconds_per_token * prefill tokens`; at its end each sequence
   that has computed everything it needs samples one token.

LoRA adapters (vLLM with `--enable-lora`, when the core is given an
`AdapterSlots`, `lora_slots.py`): a waiting request is admitted only while
the step's batch mixes at most `max_loras` adapters; one whose adapter would
be one too many is skipped this step and the queue behind it goes on (vLLM's
scheduler). The step then lasts longer by the time it takes to make the
batch's adapters resident (read from disk, copied into a slot).

KV cache: a fixed number of blocks of `block_size` tokens. Full prompt blocks
are registered in the prefix cache under a hash chain of their tokens; when no
sequence holds them any more they stay cached and are evicted least recently
used first when a block is needed. Usage counts the blocks held by sequences,
as vLLM's `kv_cache_usage_perc` does (cached but idle blocks count as free).

Cache events (vLLM's KV events, when asked for with `record_cache_events`):
each step's outcome carries what happened to the prefix cache since the
previous step, in order: `BlocksStored` for each run of consecutive prompt
blocks a sequence put in the cache (a block already cached is shared and
stored again by no one), `BlockEvicted` for each idle cached block given to
another use, and `CacheCleared` after `reset_prefix_cache`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from caravan_llm.devcluster.engine.lora_slots import AdapterSlots


class RequestTooLargeError(ValueError):
    """The request can never fit in the KV cache, however empty."""


@dataclass(frozen=True, slots=True)
class PerfModel:
    """How fast one engine instance is and how much it holds."""

    max_num_seqs: int
    kv_cache_tokens: int
    block_size: int = 16
    max_batched_tokens: int = 8192
    step_seconds: float = 0.015
    decode_seconds_per_seq: float = 0.0002
    prefill_seconds_per_token: float = 0.00005
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "kv_cache_tokens", "block_size", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("step_seconds", "decode_seconds_per_seq", "prefill_seconds_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) is smaller than one block "
                f"({self.block_size} tokens)"
            )

    @property
    def total_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def step_duration(self, *, prefill_tokens: int, decode_seqs: int) -> float:
        """Seconds one forward pass takes; the decode part grows with the batch."""
        return (
            self.step_seconds
            + self.decode_seconds_per_seq * decode_seqs
            + self.prefill_seconds_per_token * prefill_tokens
        )


def prompt_block_hashes(tokens: Sequence[str] | Sequence[int], block_size: int) -> tuple[int, ...]:
    """The hash chain of the prompt's full blocks: equal prefixes give equal hashes.

    Token strings (the regex tokenizer) or ids (a model's tokenizer, whose
    hashes are then the same in every process: Python salts str hashes only).
    """
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """What the core needs to know about a request (not its text)."""

    request_id: str
    prompt_len: int
    block_hashes: tuple[int, ...]
    output_len: int
    # The prompt's token ids, for the cache events' `token_ids` (empty when none are recorded).
    prompt_token_ids: tuple[int, ...] = ()
    # The LoRA adapter the request uses (None: the base model).
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive full prompt blocks just put in the prefix cache, in prefix order."""

    block_hashes: tuple[int, ...]
    # The block before the first one here; None when they start the prompt.
    parent_block_hash: int | None
    # The blocks' tokens (block_size per block), when the sequence gave its token ids.
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockEvicted:
    """An idle cached block taken for another use: its prefix is no longer cached."""

    block_hash: int


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """The whole prefix cache was dropped (`reset_prefix_cache`)."""


CacheEvent = BlocksStored | BlockEvicted | CacheCleared


@dataclass(frozen=True, slots=True)
class FirstToken:
    request_id: str
    prompt_len: int
    cached_tokens: int
    ttft_seconds: float
    queue_seconds: float


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    prompt_len: int
    generated: int
    e2e_seconds: float
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduled step: who computes how many tokens, and for how long."""

    started_at: float
    duration: float
    chunks: tuple[tuple[str, int], ...]
    prefill_tokens: int
    decode_seqs: int
    # Seconds of the step spent making its LoRA adapters resident.
    adapter_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a finished step produced."""

    emitted: tuple[str, ...]
    first_tokens: tuple[FirstToken, ...]
    finished: tuple[Finished, ...]
    prefill_tokens: int
    decode_seqs: int
    busy_seqs: int
    duration: float
    # What happened to the prefix cache since the previous step (when recorded).
    cache_events: tuple[CacheEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class CoreStats:
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    preemptions: int


@dataclass(slots=True, eq=False)
class _Seq:
    spec: SequenceSpec
    arrival: float
    computed: int = 0
    generated: int = 0
    cached_hashes: list[int] = field(default_factory=list)
    private_blocks: int = 0
    slot: int = -1
    admitted_at: float | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0

    @property
    def target(self) -> int:
        """Tokens to compute before the next sample: the prompt plus what was sampled."""
        return self.spec.prompt_len + self.generated

    @property
    def num_blocks(self) -> int:
        return len(self.cached_hashes) + self.private_blocks


class BlockPool:
    """Fixed KV blocks: private to a sequence, or cached under a prompt-block hash."""

    def __init__(self, total_blocks: int, *, on_evict: Callable[[int], None] | None = None) -> None:
        self.total = total_blocks
        self.free = total_blocks
        self._refs: dict[int, int] = {}
        # Cached blocks no sequence holds, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._on_evict = on_evict

    @property
    def available(self) -> int:
        return self.free + len(self._evictable)

    @property
    def usage(self) -> float:
        return (self.total - self.available) / self.total

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are in the cache."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._refs:
                break
            count += 1
        return count

    def acquire(self, block_hash: int) -> None:
        refs = self._refs[block_hash]
        if refs == 0:
            del self._evictable[block_hash]
        self._refs[block_hash] = refs + 1

    def release(self, block_hash: int) -> None:
        refs = self._refs[block_hash] - 1
        self._refs[block_hash] = refs
        if refs == 0:
            self._evictable[block_hash] = None

    def allocate(self, count: int) -> bool:
        """Take `count` private blocks, evicting idle cached ones if needed."""
        if count > self.available:
            return False
        while self.free < count:
            evicted, _ = self._evictable.popitem(last=False)
            del self._refs[evicted]
            self.free += 1
            if self._on_evict is not None:
                self._on_evict(evicted)
        self.free -= count
        return True

    def in_use(self) -> bool:
        """Whether any block is held by a sequence (private, or cached and referenced)."""
        return self.available < self.total

    def clear_cache(self) -> None:
        """Forget every cached block; only valid when none is in use."""
        self.free += len(self._evictable)
        self._evictable.clear()
        self._refs.clear()

    def free_private(self, count: int) -> None:
        self.free += count

    def register(self, block_hash: int) -> bool:
        """Publish a just-computed private block under `block_hash`; False if already cached."""
        if block_hash in self._refs:
            return False
        self._refs[block_hash] = 1
        return True


class BatchCore:
    """One engine instance's scheduler: a FIFO queue, a running batch and a KV cache."""

    def __init__(
        self,
        model: PerfModel,
        *,
        record_cache_events: bool = False,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.model = model
        self.adapters = adapters
        self._record = record_cache_events
        self._cache_events: list[CacheEvent] = []
        self._pool = BlockPool(
            model.total_blocks, on_evict=self._evicted if record_cache_events else None
        )
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._free_slots = list(range(model.max_num_seqs))
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0

    # --- requests -------------------------------------------------------

    def submit(self, spec: SequenceSpec, now: float) -> None:
        if spec.request_id in self._by_id:
            raise ValueError(f"request id {spec.request_id!r} is already in the engine")
        if spec.prompt_len < 1 or spec.output_len < 0:
            raise ValueError(
                f"prompt_len must be >= 1 and output_len >= 0, got {spec.prompt_len}, "
                f"{spec.output_len}"
            )
        needed = -(-(spec.prompt_len + spec.output_len) // self.model.block_size)
        if needed > self._pool.total:
            raise RequestTooLargeError(
                f"{spec.prompt_len + spec.output_len} tokens need {needed} KV blocks; "
                f"the cache has {self._pool.total}"
            )
        seq = _Seq(spec=spec, arrival=now)
        self._by_id[spec.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (client gone); False if unknown or already done."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self._running:
            self._running.remove(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def slot_of(self, request_id: str) -> int | None:
        """The sequence slot a running request holds (llama.cpp's slot id), else None."""
        seq = self._by_id.get(request_id)
        if seq is None or seq.slot < 0:
            return None
        return seq.slot

    def running_ids(self) -> list[str]:
        return [seq.spec.request_id for seq in self._running]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's `reset_prefix_cache`); False while any is in use."""
        if self._pool.in_use():
            return False
        self._pool.clear_cache()
        if self._record:
            self._cache_events.append(CacheCleared())
        return True

    def stats(self) -> CoreStats:
        return CoreStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_cache_usage=self._pool.usage,
            prefix_queries_tokens=self._prefix_queries,
            prefix_hits_tokens=self._prefix_hits,
            preemptions=self._preemptions,
        )

    # --- stepping -------------------------------------------------------

    def schedule(self, now: float) -> StepPlan | None:
        """Pick this step's work; None when there is nothing to do."""
        budget = self.model.max_batched_tokens
        chunks: list[tuple[str, int]] = []
        prefill_tokens = 0
        decode_seqs = 0
        # The adapters this step's batch uses so far.
        batch_adapters: set[str] = set()

        for seq in list(self._running):
            if budget == 0:
                break
            if seq not in self._running:  # preempted earlier in this loop
                continue
            need = seq.target - seq.computed
            chunk = min(need, budget)
            if not self._make_room(seq, seq.computed + chunk):
                continue
            chunks.append((seq.spec.request_id, chunk))
            budget -= chunk
            if seq.spec.adapter is not None:
                batch_adapters.add(seq.spec.adapter)
            if need == 1 and seq.generated > 0:
                decode_seqs += 1
            else:
                prefill_tokens += chunk

        # Waiting requests skipped for their adapter (they keep their place in the queue).
        skipped = 0
        while (
            len(self._waiting) > skipped
            and len(self._running) < self.model.max_num_seqs
            and budget > 0
        ):
            seq = self._waiting[skipped]
            if self.adapters is not None and not self.adapters.fits(
                batch_adapters, seq.spec.adapter
            ):
                skipped += 1
                continue
            first_chunk = self._admit(seq, budget, now)
            if first_chunk is None:
                break
            chunks.append((seq.spec.request_id, first_chunk))
            budget -= first_chunk
            prefill_tokens += first_chunk
            if seq.spec.adapter is not None:
                batch_adapters.add(seq.spec.adapter)

        if not chunks:
            return None
        adapter_seconds = (
            self.adapters.prepare(batch_adapters)
            if self.adapters is not None and batch_adapters
            else 0.0
        )
        return StepPlan(
            started_at=now,
            duration=self.model.step_duration(
                prefill_tokens=prefill_tokens, decode_seqs=decode_seqs
            )
            + adapter_seconds,
            chunks=tuple(chunks),
            prefill_tokens=prefill_tokens,
            decode_seqs=decode_seqs,
            adapter_seconds=adapter_seconds,
        )

    def complete(self, plan: StepPlan, now: float) -> StepOutcome:
        """Apply a step that has run: advance, sample, finish."""
        emitted: list[str] = []
        first_tokens: list[FirstToken] = []
        finished: list[Finished] = []
        for request_id, chunk in plan.chunks:
            seq = self._by_id.get(request_id)
            if seq is None or seq.slot < 0:  # aborted or preempted meanwhile
                continue
            seq.computed += chunk
            if self.model.prefix_caching:
                self._publish_prompt_blocks(seq)
            if seq.computed < seq.target:
                continue  # prompt not finished yet (chunked prefill)
            if seq.generated < seq.spec.output_len:
                seq.generated += 1
                emitted.append(request_id)
                if seq.first_token_at is None:
                    seq.first_token_at = now
                    first_tokens.append(
                        FirstToken(
                            request_id=request_id,
                            prompt_len=seq.spec.prompt_len,
                            cached_tokens=seq.cached_tokens,
                            ttft_seconds=now - seq.arrival,
                            queue_seconds=(seq.admitted_at or now) - seq.arrival,
                        )
                    )
            if seq.generated >= seq.spec.output_len:
                finished.append(self._finish(seq, now))
        return StepOutcome(
            emitted=tuple(emitted),
            first_tokens=tuple(first_tokens),
            finished=tuple(finished),
            prefill_tokens=plan.prefill_tokens,
            decode_seqs=plan.decode_seqs,
            busy_seqs=len(plan.chunks),
            duration=plan.duration,
            cache_events=self._take_cache_events(),
        )

    # --- internals ------------------------------------------------------

    def _admit(self, seq: _Seq, budget: int, now: float) -> int | None:
        """Admit a waiting request (the head, unless those before it were skipped for their
        adapter) if its first chunk fits; its chunk size, else None."""
        bs = self.model.block_size
        hit_blocks = 0
        if self.model.prefix_caching:
            hit_blocks = self._pool.cached_prefix(seq.spec.block_hashes)
            # At least one token is always computed, to sample from.
            hit_blocks = min(hit_blocks, (seq.target - 1) // bs)
        hits = seq.spec.block_hashes[:hit_blocks]
        for block_hash in hits:
            self._pool.acquire(block_hash)
        cached = hit_blocks * bs
        chunk = min(seq.target - cached, budget)
        new_blocks = -(-(cached + chunk) // bs) - hit_blocks
        if not self._pool.allocate(new_blocks):
            for block_hash in hits:
                self._pool.release(block_hash)
            return None
        if self._waiting[0] is seq:
            self._waiting.popleft()
        else:
            self._waiting.remove(seq)
        seq.cached_hashes = list(hits)
        seq.private_blocks = new_blocks
        seq.computed = cached
        seq.cached_tokens = cached
        seq.slot = heapq.heappop(self._free_slots)
        if seq.admitted_at is None:
            seq.admitted_at = now
        self._running.append(seq)
        self._prefix_queries += seq.spec.prompt_len
        self._prefix_hits += cached
        return chunk

    def _make_room(self, seq: _Seq, tokens: int) -> bool:
        """Give `seq` blocks for `tokens`, preempting the newest sequences if needed.

        False when `seq` itself had to be preempted.
        """
        missing = -(-tokens // self.model.block_size) - seq.num_blocks
        while missing > 0 and not self._pool.allocate(missing):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if missing > 0:
            seq.private_blocks += missing
        return True

    def _preempt(self, seq: _Seq) -> None:
        self._running.remove(seq)
        self._release(seq)
        seq.computed = 0
        self._waiting.appendleft(seq)
        self._preemptions += 1

    def _release(self, seq: _Seq) -> None:
        # Tail blocks first, so they are evicted before the head of the prefix (as vLLM does).
        for block_hash in reversed(seq.cached_hashes):
            self._pool.release(block_hash)
        self._pool.free_private(seq.private_blocks)
        seq.cached_hashes = []
        seq.private_blocks = 0
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = -1

    def _publish_prompt_blocks(self, seq: _Seq) -> None:
        """Put the prompt's newly completed full blocks into the prefix cache."""
        full = min(seq.computed, seq.spec.prompt_len) // self.model.block_size
        stored: list[int] = []  # indexes of the blocks this sequence stored first
        for index in range(len(seq.cached_hashes), min(full, len(seq.spec.block_hashes))):
            block_hash = seq.spec.block_hashes[index]
            if self._pool.register(block_hash):
                stored.append(index)
            else:
                # Another sequence computed the same block first: share its copy.
                self._pool.acquire(block_hash)
                self._pool.free_private(1)
            seq.cached_hashes.append(block_hash)
            seq.private_blocks -= 1
        if self._record and stored:
            self._record_stored(seq.spec, stored)

    def _record_stored(self, spec: SequenceSpec, indexes: Sequence[int]) -> None:
        """One BlocksStored per run of consecutive block indexes."""
        bs = self.model.block_size
        runs: list[list[int]] = []
        for index in indexes:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            self._cache_events.append(
                BlocksStored(
                    block_hashes=spec.block_hashes[first : last + 1],
                    parent_block_hash=spec.block_hashes[first - 1] if first > 0 else None,
                    token_ids=spec.prompt_token_ids[first * bs : (last + 1) * bs],
                )
            )

    def _evicted(self, block_hash: int) -> None:
        self._cache_events.append(BlockEvicted(block_hash))

    def _take_cache_events(self) -> tuple[CacheEvent, ...]:
        events = tuple(self._cache_events)
        self._cache_events.clear()
        return events

    def _finish(self, seq: _Seq, now: float) -> Finished:
        self._running.remove(seq)
        self._release(seq)
        del self._by_id[seq.spec.request_id]
        admitted = seq.admitted_at if seq.admitted_at is not None else now
        first = seq.first_token_at if seq.first_token_at is not None else now
        return Finished(
            request_id=seq.spec.request_id,
            prompt_len=seq.spec.prompt_len,
            generated=seq.generated,
            e2e_seconds=now - seq.arrival,
            queue_seconds=admitted - seq.arrival,
            prefill_seconds=first - admitted,
            decode_seconds=now - first,
        )
