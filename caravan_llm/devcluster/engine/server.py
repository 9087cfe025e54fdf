"""The HTTP face of a simulated engine: aiohttp routes over the batch loop.

Loading behaves like each real engine. llama-server listens at once and
answers every route with 503 `Loading model` until the model is loaded. vLLM
binds its port first but only listens once the engine is built, so during the
load a client is refused at TCP level (`vllm/entrypoints/openai/api_server.py`
creates the socket before the engine and serves it afterwards).

Faults (`--sim-failure-rate`, `--sim-disconnect-rate`, `--sim-hang-rate`) are
drawn per request from a generator seeded with `--sim-seed`, in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import jinja2
from aiohttp import web

from caravan_llm.devcluster.engine import sglang
from caravan_llm.devcluster.engine.batch import (
    BatchCore,
    CacheEvent,
    RequestTooLargeError,
    SequenceSpec,
    StepOutcome,
    prompt_block_hashes,
)
from caravan_llm.devcluster.engine.flags import LLAMACPP_TRAINED_CONTEXT, EngineSettings
from caravan_llm.devcluster.engine.hf_tokenizer import HfTokenizer
from caravan_llm.devcluster.engine.kv_events import KvEventPublisher
from caravan_llm.devcluster.engine.loop import EngineLoop, RequestHandle
from caravan_llm.devcluster.engine.lora import LoadedAdapter, LoraRegistry, missing_fields
from caravan_llm.devcluster.engine.lora_slots import AdapterSlots
from caravan_llm.devcluster.engine.metrics import (
    PROMETHEUS_TEXT_CONTENT_TYPE,
    LlamacppMetrics,
    VllmMetrics,
)
from caravan_llm.devcluster.engine.openai_requests import (
    ApiError,
    GenerateRequest,
    parse_chat_request,
    parse_completion_request,
)
from caravan_llm.devcluster.engine.sglang import SglangMetrics
from caravan_llm.devcluster.engine.shapes import (
    LLAMACPP_BUILD_INFO,
    VLLM_SIM_VERSION,
    ApiShape,
    LlamacppShape,
    Reply,
    VllmShape,
    llamacpp_timings,
    now_seconds,
)
from caravan_llm.devcluster.engine.text import (
    CHATML_TEMPLATE,
    PlannedOutput,
    Vocabulary,
    generation_key,
    natural_length,
    plan_output,
    tokenize,
)
from caravan_llm.devcluster.engine.typed_apis import (
    anthropic_message,
    embedding,
    embedding_inputs,
    messages_chat_body,
    messages_stream_delta,
    messages_stream_end,
    messages_stream_start,
    relevance,
    rerank_inputs,
    response_object,
    responses_chat_body,
    responses_stream_delta,
    responses_stream_end,
    responses_stream_start,
)

Fault = Literal["fail", "hang", "disconnect"]
TypedApi = Literal["responses", "messages"]
LLAMACPP_LOADING_BODY = {
    "error": {"message": "Loading model", "type": "unavailable_error", "code": 503}
}
LLAMACPP_UNAUTHORIZED_BODY = {
    "error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}
}
# Routes llama-server answers without its API key.
LLAMACPP_PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class KvEventSink(Protocol):
    """Where each step's prefix-cache events go (the simulated vLLM's KV-event publisher)."""

    def publish(self, events: Sequence[CacheEvent]) -> None: ...


@dataclass(frozen=True, slots=True)
class _Plan:
    request: GenerateRequest
    spec: SequenceSpec
    output: PlannedOutput
    prompt_tokens: int


@dataclass(slots=True)
class _Active:
    """A request being served, for llama.cpp's /slots."""

    prompt_tokens: int
    output_tokens: int
    handle: RequestHandle
    task_id: int


class SimulatedEngine:
    """One simulated vLLM or llama.cpp instance: state, metrics and routes."""

    def __init__(
        self,
        settings: EngineSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        kv_events: KvEventSink | None = None,
    ) -> None:
        self.settings = settings
        self._kv_events = kv_events
        # vLLM's adapter CPU cache and GPU slots (lora_slots.py), with --enable-lora.
        self.adapter_slots: AdapterSlots | None = None
        if settings.flavor == "vllm" and settings.lora is not None:
            self.adapter_slots = AdapterSlots(
                max_loras=settings.lora.max_loras,
                max_cpu_loras=settings.lora.max_cpu_loras,
                costs=settings.lora_costs,
            )
        self._most_registered = 0
        self._lora_stats_written: tuple[int, ...] = ()
        self.core = BatchCore(
            settings.perf,
            record_cache_events=kv_events is not None,
            adapters=self.adapter_slots,
        )
        self.loop = EngineLoop(self.core, clock=clock, observers=(self._observe,))
        self.ready = asyncio.Event()
        self._faults = random.Random(settings.sim.seed)
        self._finish_reasons: dict[str, str] = {}
        self._active: dict[str, _Active] = {}
        self._task_ids = 0
        # Set by abort_all (SIGTERM): new requests are refused, streams end "abort".
        self.shutting_down = False
        self._idle = asyncio.Event()
        self._vocab = Vocabulary()
        # The model's own tokenizer when its directory has one (else the regex tokenizer).
        directory = settings.tokenizer_directory
        self._hf = HfTokenizer.from_directory(directory) if directory is not None else None
        # vLLM's LoRA adapters (--enable-lora); the adapter each request in flight uses.
        self.lora: LoraRegistry | None = None
        if settings.flavor == "vllm" and settings.lora is not None:
            self.lora = LoraRegistry(settings.lora, env=settings.lora_env)
            self.lora.load_static()
            # vLLM loads the --lora-modules into the engine while it starts.
            for module in settings.lora.modules:
                if self.adapter_slots is not None:
                    self.adapter_slots.add(module.name)
            self._note_lora_state()
        self._adapter_of: dict[str, str] = {}
        self.shape: ApiShape
        self._vllm_metrics: VllmMetrics | None = None
        self._llamacpp_metrics: LlamacppMetrics | None = None
        self._sglang_metrics: SglangMetrics | None = None
        if settings.flavor == "sglang":
            self.shape = VllmShape(include_cached_tokens=settings.include_cached_tokens)
            self._sglang_metrics = SglangMetrics(model_name=settings.model_name)
        elif settings.flavor == "vllm":
            self.shape = VllmShape(include_cached_tokens=settings.include_cached_tokens, v032=True)
            self._vllm_metrics = VllmMetrics(
                model_name=settings.model_name,
                max_model_len=settings.max_model_len,
                block_size=settings.perf.block_size,
                prefix_caching=settings.perf.prefix_caching,
                num_gpu_blocks=settings.perf.total_blocks,
                num_gpu_blocks_override=settings.num_gpu_blocks_override,
                user_specified_block_size=settings.user_specified_block_size,
            )
        else:
            self.shape = LlamacppShape()
            self._llamacpp_metrics = LlamacppMetrics()

    # --- wiring ---------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._api_key_gate, self._loading_gate], client_max_size=64 * 1024**2
        )
        routes = [
            web.get("/health", self._health),
            web.get("/v1/models", self._models),
            web.post("/v1/chat/completions", self._chat),
            web.post("/v1/completions", self._completions),
            web.post("/v1/responses", self._responses),
            web.get("/metrics", self._metrics),
        ]
        # The embeddings, score and rerank routes of vLLM and SGLang answer only for
        # a pooling (embedding) model, which the simulator does not model: vLLM
        # does not mount them for a generate model (404 {"detail": "Not Found"}).
        if self.settings.flavor == "sglang":
            # SGLang has no Anthropic route; it serves tokenize with and without /v1.
            routes += [
                web.get("/health_generate", self._health),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.post("/v1/tokenize", self._tokenize),
                web.post("/v1/detokenize", self._detokenize),
            ]
        elif self.settings.flavor == "vllm":
            routes += [
                web.get("/version", self._version),
                web.get("/ping", self._health),
                web.get("/kv_event_sources", self._kv_event_sources),
                web.post("/v1/messages", self._messages),
                web.post("/v1/messages/count_tokens", self._count_tokens),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
            ]
            if self.settings.dev_mode:
                # vLLM mounts its cache-reset route only with VLLM_SERVER_DEV_MODE=1.
                routes.append(web.post("/reset_prefix_cache", self._reset_prefix_cache))
            if self.settings.runtime_lora_updating:
                # vLLM mounts these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING (lora.py).
                routes += [
                    web.post("/v1/load_lora_adapter", self._load_lora_adapter),
                    web.post("/v1/unload_lora_adapter", self._unload_lora_adapter),
                ]
        else:
            routes += [
                web.get("/v1/health", self._health),
                web.get("/slots", self._slots),
                web.get("/props", self._props),
                web.get("/models", self._models),
                web.post("/chat/completions", self._chat),
                web.post("/completions", self._completions),
                web.post("/v1/messages", self._messages),
                web.post("/v1/messages/count_tokens", self._count_tokens),
                web.post("/tokenize", self._llamacpp_tokenize),
                web.post("/detokenize", self._llamacpp_detokenize),
                web.post("/v1/embeddings", self._llamacpp_embeddings),
                web.post("/embeddings", self._llamacpp_embeddings),
                web.post("/v1/rerank", self._llamacpp_rerank),
                web.post("/rerank", self._llamacpp_rerank),
            ]
        app.add_routes(routes)
        return app

    def _authorized(self, request: web.Request) -> bool:
        """Whether the request may pass the engine's API-key check (none set: all pass)."""
        keys = self.settings.api_keys
        if not keys or request.method == "OPTIONS":
            return True
        if self.settings.flavor == "sglang":
            if sglang.is_public_path(request.path):
                return True
            given = request.headers.get("Authorization", "")
            return any(hmac.compare_digest(given, f"Bearer {key}") for key in keys)
        if self.settings.flavor == "vllm":
            # vLLM's AuthenticationMiddleware guards only paths under /v1.
            if not request.path.startswith("/v1"):
                return True
            given = request.headers.get("Authorization", "")
            return any(hmac.compare_digest(given, f"Bearer {key}") for key in keys)
        # llama-server leaves its health routes public (measured on the real build).
        if request.path in LLAMACPP_PUBLIC_PATHS:
            return True
        given = request.headers.get("X-Api-Key", "")
        if not given:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
        return any(hmac.compare_digest(given, key) for key in keys)

    @web.middleware
    async def _api_key_gate(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if self._authorized(request):
            response: web.StreamResponse = await handler(request)
            return response
        if self.settings.api_flavor == "vllm":
            return _json_response({"error": "Unauthorized"}, status=401)
        return _json_response(LLAMACPP_UNAUTHORIZED_BODY, status=401)

    @web.middleware
    async def _loading_gate(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if not self.ready.is_set():
            # Only llama.cpp can get here while loading: vLLM does not listen yet.
            return _json_response(LLAMACPP_LOADING_BODY, status=503)
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPException as exc:
            if exc.status not in (404, 405):
                raise
            # FastAPI's and llama-server's own answers for an unknown route.
            if self.settings.api_flavor == "vllm":
                return _json_response({"detail": exc.reason}, status=exc.status)
            return self._error(ApiError(404, "File Not Found"))
        return response

    def _observe(self, outcome: StepOutcome) -> None:
        if self._kv_events is not None:
            self._kv_events.publish(outcome.cache_events)
        if self._sglang_metrics is not None:
            self._sglang_metrics.observe_step(outcome)
        if self._vllm_metrics is not None:
            self._vllm_metrics.observe_step(outcome)
        if self._llamacpp_metrics is not None:
            self._llamacpp_metrics.observe_step(outcome)
        if self.adapter_slots is not None and self.settings.lora_state_dir is not None:
            stats = self.adapter_slots.stats()
            seen = (stats.disk_loads, stats.swaps, stats.max_active, stats.max_batch_adapters)
            if seen != self._lora_stats_written:
                self._lora_stats_written = seen
                self._note_lora_state()
        for finished in outcome.finished:
            reason = self._finish_reasons.pop(finished.request_id, "stop")
            if self._vllm_metrics is not None:
                self._vllm_metrics.observe_finished(finished, reason)
            if self._llamacpp_metrics is not None:
                self._llamacpp_metrics.observe_finished(finished)

    # --- plain routes ---------------------------------------------------

    async def _health(self, _: web.Request) -> web.Response:
        if self.settings.api_flavor == "vllm":
            return web.Response(status=200)
        return _json_response({"status": "ok"})

    async def _version(self, _: web.Request) -> web.Response:
        return _json_response({"version": VLLM_SIM_VERSION})

    async def _kv_event_sources(self, _: web.Request) -> web.Response:
        return _json_response(self.settings.kv_events.sources())

    async def _reset_prefix_cache(self, _: web.Request) -> web.Response:
        # The AllBlocksCleared event goes out with the next step's batch, as in vLLM.
        if not self.core.reset_prefix_cache():
            return _json_response({"detail": "Prefix cache reset failed."}, status=409)
        return web.Response(status=200)

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=True)

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._lora_call(request, load=False)

    async def _lora_call(self, request: web.Request, *, load: bool) -> web.Response:
        """vLLM's load and unload routes: a text body on success, an error object otherwise."""
        try:
            body = await self._read_json(request)
            text = self._lora_change(body, load=load)
        except ApiError as err:
            return self._error(err)
        await self._lora_resident(body["lora_name"], load=load)
        # vLLM answers a bare Response(content=...): a body without a content type.
        return web.Response(status=200, body=text.encode())

    async def _lora_resident(self, name: str, *, load: bool) -> None:
        """What a load or unload does to the engine's adapter cache (lora_slots.py): a load
        reads and activates the adapter between two steps, holding the engine meanwhile."""
        slots = self.adapter_slots
        if slots is not None:
            if load:
                await self.loop.between_steps(lambda: slots.add(name))
            else:
                slots.remove(name)
        self._note_lora_state()

    def _note_lora_state(self) -> None:
        """Track the most adapters ever registered; write the state file when one is asked for
        (`--sim-lora-state-dir`: `<dir>/<port>.json`, read by bench/adapter_placement.py)."""
        if self.lora is None:
            return
        self._most_registered = max(self._most_registered, len(self.lora.loaded))
        folder = self.settings.lora_state_dir
        if folder is None:
            return
        stats = self.adapter_slots.stats() if self.adapter_slots is not None else None
        document = {
            "port": self.settings.port,
            "max_loras": self.lora.config.max_loras,
            "registered": sorted(self.lora.loaded),
            "max_registered": self._most_registered,
            "max_active": None if stats is None else stats.max_active,
            "max_batch_adapters": None if stats is None else stats.max_batch_adapters,
            "disk_loads": None if stats is None else stats.disk_loads,
            "swaps": None if stats is None else stats.swaps,
        }
        path = folder / f"{self.settings.port}.json"
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(document), encoding="utf-8")
        scratch.replace(path)

    def _lora_change(self, body: Any, *, load: bool) -> str:
        if not isinstance(body, dict):
            raise ApiError(400, "Input should be a valid dictionary", error_type="BadRequestError")
        # FastAPI validates the body before vLLM looks at it.
        missing = missing_fields(body, ("lora_name", "lora_path") if load else ("lora_name",))
        if missing is not None:
            raise missing
        if self.lora is None:
            # vLLM's engine has no LoRA manager without --enable-lora.
            raise ApiError(
                500,
                "LoRA is not enabled. Use --enable-lora to enable LoRA.",
                error_type="InternalServerError",
            )
        if load:
            return self.lora.load(body.get("lora_name"), body.get("lora_path"))
        return self.lora.unload(body.get("lora_name"))

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        try:
            body = await self._read_json(request)
            fields = body if isinstance(body, dict) else {}
            if "messages" in fields:
                parsed = parse_chat_request({"max_tokens": 1, **fields}, self.settings.api_flavor)
            else:
                parsed = parse_completion_request(
                    {"max_tokens": 1, **fields}, self.settings.api_flavor
                )
            self._check_model(parsed)
        except ApiError as err:
            return self._error(err)
        _, ids = self._prompt_tokens(parsed)
        return _json_response(
            {
                "count": len(ids),
                "max_model_len": self.settings.max_model_len,
                "tokens": list(ids),
                "token_strs": None,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            ids = self._detokenize_ids(await self._read_json(request))
        except ApiError as err:
            return self._error(err)
        if self._hf is not None:
            return _json_response({"prompt": self._hf.decode(ids)})
        return _json_response({"prompt": "".join(self._vocab.token_of(i) for i in ids)})

    def _detokenize_ids(self, body: Any) -> list[int]:
        fields = body if isinstance(body, dict) else {}
        model = fields.get("model")
        if isinstance(model, str) and model not in self.settings.served_model_names:
            raise ApiError(404, self._unknown_model_message(model), param="model")
        ids = fields.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise ApiError(400, "tokens must be a list of integers", param="tokens")
        return ids

    async def _llamacpp_tokenize(self, request: web.Request) -> web.Response:
        """llama-server's /tokenize: `content` to ids (with their pieces on `with_pieces`)."""
        try:
            body = await self._read_json(request)
        except ApiError as err:
            return self._error(err)
        fields = body if isinstance(body, dict) else {}
        content = fields.get("content")
        tokens = tokenize(content) if isinstance(content, str) else []
        if fields.get("with_pieces") is True:
            pieces = [{"id": self._vocab.id_of(token), "piece": token} for token in tokens]
            return _json_response({"tokens": pieces})
        return _json_response({"tokens": [self._vocab.id_of(token) for token in tokens]})

    async def _llamacpp_detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
        except ApiError as err:
            return self._error(err)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            ids = []
        return _json_response({"content": "".join(self._vocab.token_of(i) for i in ids)})

    async def _llamacpp_embeddings(self, request: web.Request) -> web.Response:
        """llama-server's /v1/embeddings: 501 without `--embeddings` (as measured)."""
        if not self.settings.embeddings:
            return self._error(
                ApiError(
                    501,
                    "This server does not support embeddings. Start it with `--embeddings`",
                    error_type="not_supported_error",
                )
            )
        try:
            texts = embedding_inputs(await self._read_json(request))
        except ApiError as err:
            return self._error(err)
        used = sum(len(tokenize(text)) for text in texts)
        return _json_response(
            {
                "model": self.settings.model_name,
                "object": "list",
                "usage": {"prompt_tokens": used, "total_tokens": used},
                "data": [
                    {"embedding": embedding(text), "index": index, "object": "embedding"}
                    for index, text in enumerate(texts)
                ],
            }
        )

    async def _llamacpp_rerank(self, request: web.Request) -> web.Response:
        """llama-server's /v1/rerank: 501 without `--reranking` (as measured)."""
        if not self.settings.reranking:
            return self._error(
                ApiError(
                    501,
                    "This server does not support reranking. Start it with `--reranking`",
                    error_type="not_supported_error",
                )
            )
        try:
            query, documents, top_n = rerank_inputs(await self._read_json(request))
        except ApiError as err:
            return self._error(err)
        results = sorted(
            (
                {"index": index, "relevance_score": relevance(query, document)}
                for index, document in enumerate(documents)
            ),
            key=lambda result: -float(result["relevance_score"]),
        )
        used = len(tokenize(query)) + sum(len(tokenize(d)) for d in documents)
        return _json_response(
            {
                "model": self.settings.model_name,
                "object": "list",
                "usage": {"prompt_tokens": used, "total_tokens": used},
                "results": results[:top_n] if top_n is not None else results,
            }
        )

    async def _models(self, _: web.Request) -> web.Response:
        created = now_seconds()
        s = self.settings
        if s.flavor == "sglang":
            return _json_response(sglang.model_cards(s, created))
        if s.flavor == "vllm":
            cards: list[dict[str, Any]] = [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": s.model,
                    "parent": None,
                    "max_model_len": s.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
                for name in s.served_model_names
            ]
            cards += [
                {
                    "id": adapter.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": adapter.path,
                    "parent": s.served_model_names[0],
                    "max_model_len": None,
                    "permission": cards[0]["permission"],
                }
                for adapter in (self.lora.loaded.values() if self.lora is not None else ())
            ]
            return _json_response({"object": "list", "data": cards})
        card = {
            "id": s.model_name,
            "aliases": list(s.served_model_names),
            "tags": [],
            "object": "model",
            "created": created,
            "owned_by": "llamacpp",
            "meta": {
                "vocab_type": 1,
                "n_vocab": 32000,
                "n_ctx": s.max_model_len,
                "n_ctx_train": LLAMACPP_TRAINED_CONTEXT,
                "n_embd": 64,
                "n_params": 0,
                "size": 0,
                "ftype": "F16",
            },
        }
        entry = {
            "name": s.model_name,
            "model": s.model_name,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
        return _json_response({"models": [entry], "object": "list", "data": [card]})

    async def _metrics(self, _: web.Request) -> web.Response:
        stats = self.core.stats()
        if self._sglang_metrics is not None:
            if not self.settings.metrics_enabled:
                # Without --enable-metrics SGLang mounts no /metrics route.
                return _json_response({"detail": "Not Found"}, status=404)
            body = self._sglang_metrics.render(stats)
            return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT_CONTENT_TYPE})
        if self._vllm_metrics is not None:
            if self.lora is not None:
                running = set(self.core.running_ids())
                self._vllm_metrics.observe_lora(
                    max_lora=self.lora.config.max_loras,
                    running=[a for rid, a in self._adapter_of.items() if rid in running],
                    waiting=[a for rid, a in self._adapter_of.items() if rid not in running],
                    now=time.time(),
                )
            body = self._vllm_metrics.render(stats)
            return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT_CONTENT_TYPE})
        if not self.settings.metrics_enabled or self._llamacpp_metrics is None:
            return self._error(
                ApiError(
                    501,
                    "This server does not support metrics endpoint. Start it with `--metrics`",
                )
            )
        text = self._llamacpp_metrics.render(stats)
        return web.Response(text=text, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _slots(self, request: web.Request) -> web.Response:
        if not self.settings.slots_enabled:
            return self._error(
                ApiError(
                    501, "This server does not support slots endpoint. Start it with `--slots`"
                )
            )
        slots: list[dict[str, Any]] = [
            {
                "id": slot,
                "n_ctx": self.settings.max_model_len,
                "speculative": False,
                "is_processing": False,
            }
            for slot in range(self.settings.perf.max_num_seqs)
        ]
        busy = 0
        for request_id, active in self._active.items():
            slot = self.core.slot_of(request_id)
            if slot is None:
                continue
            busy += 1
            first = active.handle.first_token
            cached = first.cached_tokens if first is not None else 0
            slots[slot].update(
                {
                    "is_processing": True,
                    "id_task": active.task_id,
                    "n_prompt_tokens": active.prompt_tokens,
                    "n_prompt_tokens_processed": active.prompt_tokens - cached,
                    "n_prompt_tokens_cache": cached,
                    "next_token": [
                        {
                            "has_next_token": True,
                            "has_new_line": False,
                            "n_remain": active.output_tokens - active.handle.ready,
                            "n_decoded": active.handle.ready,
                        }
                    ],
                }
            )
        if request.query.get("fail_on_no_slot") and busy >= len(slots):
            return self._error(ApiError(503, "no slot available"))
        return _json_response(slots)

    async def _props(self, _: web.Request) -> web.Response:
        s = self.settings
        n_predict = s.default_max_tokens if s.default_max_tokens is not None else -1
        return _json_response(
            {
                "default_generation_settings": {
                    "params": {"n_predict": n_predict, "max_tokens": n_predict, "stream": False},
                    "n_ctx": s.max_model_len,
                },
                "total_slots": s.perf.max_num_seqs,
                "model_alias": s.model_name,
                "model_ftype": "F16",
                "model_path": s.model,
                "modalities": {"vision": False, "video": False, "audio": False},
                "media_marker": "<__media__>",
                "endpoint_slots": s.slots_enabled,
                "endpoint_props": False,
                "endpoint_metrics": s.metrics_enabled,
                "ui": False,
                "ui_settings": {},
                "chat_template": CHATML_TEMPLATE,
                "chat_template_caps": {},
                "bos_token": "<s>",
                "eos_token": "</s>",
                "build_info": LLAMACPP_BUILD_INFO,
                "is_sleeping": False,
                "cors_proxy_enabled": False,
            }
        )

    def _error(self, err: ApiError) -> web.Response:
        return _json_response(self.shape.error(err), status=err.status)

    # --- generation -----------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._typed(request, "responses")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._typed(request, "messages")

    async def _count_tokens(self, request: web.Request) -> web.StreamResponse:
        """/v1/messages/count_tokens: the prompt tokens the messages would take, nothing run."""
        try:
            body = await self._read_json(request)
            parsed = parse_chat_request(messages_chat_body(body), self.settings.api_flavor)
            self._check_model(parsed)
            plan = self._plan(parsed)
        except ApiError as err:
            return self._error(err)
        return _json_response({"input_tokens": plan.prompt_tokens})

    async def _typed(self, request: web.Request, api: TypedApi) -> web.StreamResponse:
        """/v1/responses and /v1/messages: the chat they describe, answered in their shape."""
        try:
            body = await self._read_json(request)
            chat = responses_chat_body(body) if api == "responses" else messages_chat_body(body)
            parsed = parse_chat_request(chat, self.settings.api_flavor)
            self._check_model(parsed)
            plan = self._plan(parsed)
        except ApiError as err:
            return self._error(err)
        if self.shutting_down:
            return self._error(ApiError(503, "The server is shutting down."))
        try:
            handle = self.loop.submit(plan.spec)
        except RequestTooLargeError as exc:
            return self._error(ApiError(400, str(exc)))
        request_id = plan.spec.request_id
        self._finish_reasons[request_id] = plan.output.finish_reason
        self._task_ids += 1
        self._active[request_id] = _Active(
            prompt_tokens=plan.prompt_tokens,
            output_tokens=len(plan.output.tokens),
            handle=handle,
            task_id=self._task_ids,
        )
        try:
            if parsed.stream:
                return await self._typed_stream(request, api, plan, handle)
            while not handle.finished:
                await handle.wait()
            return _json_response(self._typed_answer(api, plan, handle))
        finally:
            self._active.pop(request_id, None)
            if self._finish_reasons.pop(request_id, None) is not None:
                self.loop.abort(request_id)
            if not self._active:
                self._idle.set()

    def _typed_answer(self, api: TypedApi, plan: _Plan, handle: RequestHandle) -> dict[str, Any]:
        tokens = plan.output.tokens[: handle.ready] if handle.aborted else plan.output.tokens
        reason = "abort" if handle.aborted else plan.output.finish_reason
        cached = handle.first_token.cached_tokens if handle.first_token is not None else 0
        usage = (plan.prompt_tokens, len(tokens), cached)
        model = self._reported_model(plan.request)
        if api == "messages":
            return anthropic_message(
                message_id="chatcmpl-" + uuid.uuid4().hex,
                model=model,
                text="".join(tokens),
                finish_reason=reason,
                usage=usage,
            )
        return response_object(
            response_id="resp_" + uuid.uuid4().hex,
            message_id="msg_" + uuid.uuid4().hex,
            created=now_seconds(),
            model=model,
            text="".join(tokens),
            finish_reason=reason,
            usage=usage,
        )

    def _typed_timings(self, plan: _Plan, handle: RequestHandle) -> dict[str, Any] | None:
        """llama-server's `timings` of a finished request (None for the other engines)."""
        if self.settings.flavor != "llamacpp":
            return None
        first, finish = handle.first_token, handle.finish
        reply = Reply(
            id="",
            created=0,
            model="",
            kind="chat",
            role="assistant",
            prompt_tokens=plan.prompt_tokens,
            cached_tokens=first.cached_tokens if first is not None else 0,
            completion_tokens=handle.ready,
            prompt_ms=1e3 * finish.prefill_seconds if finish is not None else 0.0,
            predicted_ms=1e3 * finish.decode_seconds if finish is not None else 0.0,
        )
        return llamacpp_timings(reply)

    async def _typed_stream(
        self, request: web.Request, api: TypedApi, plan: _Plan, handle: RequestHandle
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        response_id, message_id = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex
        model = self._reported_model(plan.request)
        if api == "responses":
            await response.write(responses_stream_start(response_id, message_id))
        else:
            message_id = "chatcmpl-" + uuid.uuid4().hex
            await response.write(messages_stream_start(message_id, model, (plan.prompt_tokens, 0)))
        sent = 0
        while True:
            while sent < handle.ready:
                text = plan.output.tokens[sent]
                delta = (
                    responses_stream_delta(message_id, text)
                    if api == "responses"
                    else messages_stream_delta(text)
                )
                await response.write(delta)
                sent += 1
            if handle.finished:
                break
            await handle.wait()
        final = self._typed_answer(api, plan, handle)
        if api == "responses":
            final["id"], final["output"][0]["id"] = response_id, message_id
            await response.write(responses_stream_end(final, self._typed_timings(plan, handle)))
        else:
            await response.write(
                messages_stream_end("abort" if handle.aborted else plan.output.finish_reason, sent)
            )
        await response.write_eof()
        return response

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(
        self, request: web.Request, kind: Literal["chat", "completion"]
    ) -> web.StreamResponse:
        try:
            body = await self._read_json(request)
            parsed = (
                parse_chat_request(body, self.settings.api_flavor)
                if kind == "chat"
                else parse_completion_request(body, self.settings.api_flavor)
            )
            self._check_model(parsed)
            plan = self._plan(parsed)
        except ApiError as err:
            return self._error(err)

        fault = self._draw_fault()
        if fault == "fail":
            return self._error(ApiError(500, "simulated engine failure (--sim-failure-rate)"))
        if fault == "hang":
            # Never answers; the handler is cancelled when the client goes away.
            await asyncio.Event().wait()
        if self.shutting_down:
            return self._error(ApiError(503, "The server is shutting down."))

        # n > 1: one sequence per choice in the batch (as vLLM fans a request out);
        # they share the prompt, so every choice after the first hits the prefix cache.
        plans = [plan] + [self._plan(parsed, choice=index) for index in range(1, parsed.n)]
        handles: list[RequestHandle] = []
        shared_wake = asyncio.Event()
        try:
            for branch in plans:
                handle = self.loop.submit(branch.spec)
                # One event for every choice, so a stream wakes when any of them moves.
                handle.event = shared_wake
                handles.append(handle)
        except RequestTooLargeError as exc:
            for handle in handles:
                self.loop.abort(handle.request_id)
            return self._error(ApiError(400, str(exc)))
        adapter = self._adapter(parsed)
        for branch, handle in zip(plans, handles, strict=True):
            request_id = branch.spec.request_id
            self._finish_reasons[request_id] = branch.output.finish_reason
            if adapter is not None:
                self._adapter_of[request_id] = adapter.name
            self._task_ids += 1
            self._active[request_id] = _Active(
                prompt_tokens=branch.prompt_tokens,
                output_tokens=len(branch.output.tokens),
                handle=handle,
                task_id=self._task_ids,
            )
        reply = Reply(
            id=self.shape.id_prefix(kind) + uuid.uuid4().hex,
            created=now_seconds(),
            model=self._reported_model(parsed),
            kind=kind,
            role=parsed.reply_role,
            prompt_tokens=plan.prompt_tokens,
        )
        branches = list(zip(plans, handles, strict=True))
        if self._vllm_metrics is not None:
            self._vllm_metrics.observe_request(n=parsed.n, max_tokens=len(plan.output.tokens))
        try:
            disconnect = fault == "disconnect"
            if parsed.stream:
                return await self._stream(request, branches, shared_wake, reply, disconnect)
            return await self._respond(request, branches, shared_wake, reply, disconnect)
        finally:
            for branch in plans:
                request_id = branch.spec.request_id
                self._active.pop(request_id, None)
                self._adapter_of.pop(request_id, None)
                if self._finish_reasons.pop(request_id, None) is not None:
                    # Still unfinished: the client went away or the connection was dropped.
                    self.loop.abort(request_id)
                    if self._vllm_metrics is not None:
                        self._vllm_metrics.observe_aborted()
            if not self._active:
                self._idle.set()

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if self.settings.flavor == "llamacpp":
                raise ApiError(500, f"[json.exception.parse_error] {exc}") from None
            # vLLM (pydantic) names the position: `body.<offset>`.
            where = f"body.{exc.pos}" if isinstance(exc, json.JSONDecodeError) else "body"
            raise ApiError(400, f"JSON decode error: {exc}", param=where) from None

    def _check_model(self, parsed: GenerateRequest) -> None:
        if self.settings.api_flavor != "vllm" or parsed.model is None:
            return
        if parsed.model in self.settings.served_model_names:
            return
        if self.lora is not None and parsed.model in self.lora.loaded:
            return
        raise ApiError(404, self._unknown_model_message(parsed.model), param="model")

    def _unknown_model_message(self, model: str) -> str:
        aliases = ", ".join(self.settings.served_model_names)
        return f"The model `{model}` does not exist. Valid aliases: {aliases}."

    def _reported_model(self, parsed: GenerateRequest) -> str:
        # vLLM echoes the served name asked for; llama.cpp always reports its alias.
        if self.settings.api_flavor == "vllm" and parsed.model is not None:
            return parsed.model
        return self.settings.model_name

    def _plan(self, parsed: GenerateRequest, *, choice: int = 0) -> _Plan:
        s = self.settings
        prompt_tokens, prompt_ids = self._prompt_tokens(parsed)
        n_prompt = len(prompt_tokens)
        room = s.max_model_len - n_prompt
        if s.api_flavor == "vllm":
            wanted = parsed.max_tokens
            if wanted is not None and wanted > s.max_model_len:
                # vLLM 0.32 checks max_tokens against the whole context first.
                raise ApiError(
                    400,
                    f"max_tokens={wanted} cannot be greater than max_model_len="
                    f"{s.max_model_len}. Please request fewer output tokens. "
                    f"(parameter=max_tokens, value={wanted})",
                    param="max_tokens",
                )
            if room <= 0:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {s.max_model_len} tokens. "
                    f"However, your prompt contains at least {n_prompt} input tokens, which "
                    "exceeds this limit even without any output tokens. Please reduce the "
                    f"length of the input prompt. (parameter=input_tokens, value={n_prompt})",
                    param="input_tokens",
                )
            if wanted is not None and wanted > room:
                asked = n_prompt + wanted
                raise ApiError(
                    400,
                    f"This model's maximum context length is {s.max_model_len} tokens. "
                    f"However, you requested {asked} tokens ({n_prompt} in the messages, "
                    f"{wanted} in the completion). Please reduce the length of the "
                    "messages or completion.",
                    param="max_tokens",
                )
            max_new = wanted if wanted is not None else room
        else:
            if room <= 0:
                raise ApiError(
                    400,
                    f"request ({n_prompt} tokens) exceeds the available context size "
                    f"({s.max_model_len} tokens), try increasing it",
                    error_type="exceed_context_size_error",
                    details={"n_prompt_tokens": n_prompt, "n_ctx": s.max_model_len},
                )
            wanted = parsed.max_tokens if parsed.max_tokens is not None else s.default_max_tokens
            max_new = min(wanted, room) if wanted is not None else room
        # Each choice of an n > 1 request draws its own text; an adapter gives text of its own.
        seed = (parsed.seed if parsed.seed is not None else s.sim.seed) + choice
        adapter = self._adapter(parsed)
        if adapter is not None:
            seed += adapter.seed_salt
        key = generation_key(parsed.key_prompt)
        output = plan_output(
            key=key,
            seed=seed,
            start=parsed.continued_tokens,
            max_new_tokens=max_new,
            natural_len=(
                # Past the limit: the reply always ends by length.
                parsed.continued_tokens + max_new + 1
                if parsed.ignore_eos
                else natural_length(key, seed, s.sim.output_tokens)
            ),
            stop=parsed.stop,
        )
        spec = SequenceSpec(
            request_id=uuid.uuid4().hex,
            prompt_len=n_prompt,
            block_hashes=prompt_block_hashes(prompt_tokens, s.perf.block_size),
            output_len=len(output.tokens),
            # Only the KV events carry token ids (BlockStored.token_ids).
            prompt_token_ids=prompt_ids if self._kv_events is not None else (),
            adapter=None if adapter is None else adapter.name,
        )
        return _Plan(request=parsed, spec=spec, output=output, prompt_tokens=n_prompt)

    def _prompt_tokens(
        self, parsed: GenerateRequest
    ) -> tuple[Sequence[str] | Sequence[int], tuple[int, ...]]:
        """The prompt's tokens (what block hashes chain over) and their ids.

        With the model's tokenizer both are its ids: a chat rendered with its
        template (a continuation keeps the simulator's ChatML text), no special
        tokens added; a completion with them unless the request says otherwise.
        Else the regex tokenizer's strings and their hashed ids.
        """
        if self._hf is None:
            tokens = tokenize(parsed.prompt)
            return tokens, tuple(self._vocab.id_of(token) for token in tokens)
        if parsed.kind == "completion":
            ids = self._hf.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)
        elif parsed.messages:
            try:
                text = self._hf.render_chat(
                    parsed.messages, add_generation_prompt=parsed.add_generation_prompt
                )
            except (ValueError, jinja2.TemplateError) as exc:
                raise ApiError(400, f"chat template: {exc}", param="messages") from None
            ids = self._hf.encode(text, add_special_tokens=False)
        else:
            ids = self._hf.encode(parsed.prompt, add_special_tokens=False)
        return ids, tuple(ids)

    def _adapter(self, parsed: GenerateRequest) -> LoadedAdapter | None:
        """The LoRA adapter a request names in `model`, if any."""
        if self.lora is None or parsed.model is None:
            return None
        return self.lora.loaded.get(parsed.model)

    def _draw_fault(self) -> Fault | None:
        sim = self.settings.sim
        if not (sim.failure_rate or sim.hang_rate or sim.disconnect_rate):
            return None
        draw = self._faults.random()
        if draw < sim.failure_rate:
            return "fail"
        draw -= sim.failure_rate
        if draw < sim.hang_rate:
            return "hang"
        draw -= sim.hang_rate
        if draw < sim.disconnect_rate:
            return "disconnect"
        return None

    # --- shutting down ----------------------------------------------------

    def abort_all(self) -> None:
        """Stop generating for every request in flight, as vLLM does on SIGTERM.

        Each stream then ends with a chunk whose finish_reason is "abort" (and
        usage when asked for) and `data: [DONE]`; a non-streamed request gets
        its text so far with finish_reason "abort".
        """
        self.shutting_down = True
        for request_id, active in list(self._active.items()):
            if active.handle.finished:
                continue
            self.loop.abort(request_id)
            self._finish_reasons.pop(request_id, None)
            if self._vllm_metrics is not None:
                self._vllm_metrics.observe_aborted()
            active.handle.aborted = True
            active.handle.finished = True
            active.handle.event.set()

    async def drained(self) -> None:
        """Until every request handler has answered (after `abort_all`)."""
        if self._active:
            self._idle.clear()
            await self._idle.wait()

    def _final_reply(self, reply: Reply, handles: list[RequestHandle], sent: int) -> Reply:
        first = handles[0].first_token
        finish = handles[0].finish
        prompt_ms = 0.0
        predicted_ms = 0.0
        if finish is not None:
            prompt_ms = 1e3 * finish.prefill_seconds
            predicted_ms = 1e3 * finish.decode_seconds
        return replace(
            reply,
            cached_tokens=first.cached_tokens if first is not None else 0,
            completion_tokens=sent,
            prompt_ms=prompt_ms,
            predicted_ms=predicted_ms,
        )

    async def _respond(
        self,
        request: web.Request,
        branches: list[tuple[_Plan, RequestHandle]],
        wake: asyncio.Event,
        reply: Reply,
        disconnect: bool,
    ) -> web.StreamResponse:
        handles = [handle for _, handle in branches]
        while not all(handle.finished for handle in handles):
            await wake.wait()
            wake.clear()
        if disconnect:
            _drop_connection(request)
            return web.Response(status=500)
        sent = [
            handle.ready if handle.aborted else len(branch.output.tokens)
            for branch, handle in branches
        ]
        final = self._final_reply(reply, handles, sum(sent))
        body: dict[str, Any] | None = None
        for index, ((branch, handle), count) in enumerate(zip(branches, sent, strict=True)):
            tokens = branch.output.tokens[:count] if handle.aborted else branch.output.tokens
            text = (branch.request.response_echo if index == 0 else "") + "".join(tokens)
            reason = "abort" if handle.aborted else branch.output.finish_reason
            one = self.shape.response(final, text, reason)
            if body is None:
                body = one
            else:
                choice = one["choices"][0]
                choice["index"] = index
                body["choices"].append(choice)
        return _json_response(body)

    async def _stream(
        self,
        request: web.Request,
        branches: list[tuple[_Plan, RequestHandle]],
        wake: asyncio.Event,
        reply: Reply,
        disconnect: bool,
    ) -> web.StreamResponse:
        plan = branches[0][0]
        first_tokens = plan.output.tokens
        # A dropped stream breaks after some tokens, never before the first.
        drop_after = self._faults.randint(1, max(len(first_tokens) - 1, 1)) if disconnect else None
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        count = len(branches)
        sent = [0] * count
        started = [False] * count
        ended = [False] * count
        echo = plan.request.stream_echo
        include_usage = plan.request.include_usage or self.settings.force_include_usage
        handles = [handle for _, handle in branches]
        while True:
            if not any(
                not ended[i] and (handle.ready > sent[i] or handle.finished)
                for i, handle in enumerate(handles)
            ):
                await wake.wait()
                wake.clear()
            chunks: list[dict[str, Any]] = []
            for index, (branch, handle) in enumerate(branches):
                tokens = branch.output.tokens
                finish_reason = branch.output.finish_reason
                if not started[index] and (handle.ready > 0 or handle.finished):
                    chunks += _indexed(self.shape.stream_start(reply), index)
                    started[index] = True
                while sent[index] < handle.ready and not ended[index]:
                    is_last = sent[index] == len(tokens) - 1
                    text = tokens[sent[index]]
                    if index == 0:
                        text = echo + text
                        echo = ""
                    chunk = self.shape.stream_token(reply, text, finish_reason if is_last else None)
                    chunks += _indexed([chunk], index)
                    sent[index] += 1
                    if index == 0 and drop_after is not None and sent[0] >= drop_after:
                        await _write_events(response, chunks)
                        _drop_connection(request)
                        return response
                if handle.finished and not ended[index]:
                    if index == 0 and echo:
                        chunks.append(self.shape.stream_token(reply, echo, None))
                        echo = ""
                    if handle.aborted:
                        # vLLM ends an aborted stream with an empty chunk marked "abort".
                        chunks += _indexed([self.shape.stream_token(reply, "", "abort")], index)
                    elif count > 1:
                        chunks += _indexed(
                            self.shape.stream_end(
                                reply, finish_reason, include_usage=False, last_sent=bool(tokens)
                            ),
                            index,
                        )
                    ended[index] = True
            if include_usage and self.settings.flavor == "vllm":
                chunks = self._usage_carries_fingerprint(chunks)
            if all(ended):
                final = self._final_reply(reply, handles, sum(sent))
                if count == 1 and not handles[0].aborted:
                    chunks += self.shape.stream_end(
                        final,
                        plan.output.finish_reason,
                        include_usage=include_usage,
                        last_sent=bool(first_tokens),
                    )
                elif include_usage:
                    # Every choice has its finish chunk: only the usage chunk is left.
                    chunks += self.shape.stream_end(
                        final, plan.output.finish_reason, include_usage=True, last_sent=True
                    )
                await _write_events(response, chunks, done=True)
                await response.write_eof()
                return response
            await _write_events(response, chunks)

    def _usage_carries_fingerprint(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """With a usage chunk to come, vLLM writes system_fingerprint there, not on finishes."""
        for chunk in chunks:
            if chunk.get("choices"):
                chunk.pop("system_fingerprint", None)
        return chunks


def _indexed(chunks: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """Chunks of choice `index` (the shapes build choice 0)."""
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            choice["index"] = index
    return chunks


async def _write_events(
    response: web.StreamResponse, chunks: list[dict[str, Any]], *, done: bool = False
) -> None:
    parts = [f"data: {_compact_json(chunk)}\n\n" for chunk in chunks]
    if done:
        parts.append("data: [DONE]\n\n")
    if parts:
        await response.write("".join(parts).encode())


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _json_response(body: Any, *, status: int = 200) -> web.Response:
    # Both engines write compact JSON (FastAPI's JSONResponse, nlohmann::json::dump()).
    return web.json_response(body, status=status, dumps=_compact_json)


def _drop_connection(request: web.Request) -> None:
    """Cut the TCP connection under a response, as a crashing engine would."""
    transport = request.transport
    if transport is not None:
        transport.abort()


# --- running an instance -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunningEngine:
    """A started instance: where it listens and its engine object."""

    engine: SimulatedEngine
    host: str
    port: int

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind without listening: the port is ours, connections are refused until we listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)  # noqa: FBT003 (socket's own API)
    return sock


@contextlib.asynccontextmanager
async def run_engine(
    settings: EngineSettings, *, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[RunningEngine]:
    """Serve one simulated instance on this event loop until the context exits.

    Returns at once with the bound port; the model "loads" in the background
    (`engine.ready` is set when it is served). Port 0 picks a free port.
    """
    publisher: KvEventPublisher | None = None
    if settings.flavor == "vllm" and settings.kv_events.publishes:
        # vLLM opens its publisher with the engine, before the API listens.
        publisher = KvEventPublisher(
            settings.kv_events,
            block_size=settings.perf.block_size,
            encoding=settings.kv_events_encoding,
        )
    engine = SimulatedEngine(settings, clock=clock, kv_events=publisher)
    # A short shutdown: in-flight streams are cut rather than waited for.
    runner = web.AppRunner(
        engine.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
    )
    await runner.setup()
    tasks: list[asyncio.Task[None]] = []
    sock: socket.socket | None = None
    try:
        sock = bind_socket(settings.host, settings.port)
        if settings.flavor == "llamacpp":
            # llama-server listens before loading and answers 503 meanwhile.
            await web.SockSite(runner, sock).start()

        async def load(listen_on: socket.socket) -> None:
            await asyncio.sleep(settings.sim.load_seconds)
            if settings.flavor != "llamacpp":
                # vLLM and SGLang listen only once the model is loaded.
                await web.SockSite(runner, listen_on).start()
            engine.ready.set()

        tasks.append(asyncio.create_task(engine.loop.run(), name="engine-batch-loop"))
        tasks.append(asyncio.create_task(load(sock), name="engine-load"))
        if publisher is not None:
            tasks.append(asyncio.create_task(publisher.run(), name="engine-kv-events"))
        yield RunningEngine(engine=engine, host=settings.host, port=int(sock.getsockname()[1]))
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()
        if sock is not None:
            sock.close()
        if publisher is not None:
            publisher.close()
