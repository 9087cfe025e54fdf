"""Desired state in Consul KV: profiles, desired counts, drain markers, demand signals.

Layout (contract 2, under a configurable prefix, default `caravan/`):

    models/<name>      the validated profile, as JSON
    desired/<name>     the desired replica count (decimal text); absent = replicas.start
    draining/<job-id>  a replica being drained (JSON DrainRecord)
    demand/<name>      a router's cold-start demand signal (JSON)
    state/<name>       the autoscaler's memory (JSON)
    override/<name>    a manual count the autoscaler holds until it expires (JSON ScaleOverride)
    failed/<name>      why every replica failed for good (JSON ModelFailure, scheduler-written)

    models-revision    a counter every caravan write of models/ bumps (check-and-set)

Beside the prefix, `<prefix>-history/<name>/<version>` keeps earlier versions
of each profile (`scheduler/model_history.py`), written in the same
transaction as the profile.

`ModelStore` is the one implementation both the CLI and the scheduler's HTTP
API use to read and write it. A profile is validated before anything is
written, so an invalid one never reaches KV through caravan.

Every change a user asks for (submit one or many profiles, scale, delete) is
one Consul transaction, conditioned on what was read: `cas` on each model
key at the index read (0: must not exist yet), `cas` on models-revision
(so a concurrent submission, validated against the same models, loses),
`check-index`/`delete-cas` on keys that must not have changed. Either all of
it is written or none; a lost race is retried from a fresh read a bounded
number of times, then reported as `WriteConflictError`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from caravan_llm.common.consul_api import (
    MAX_TXN_OPS,
    KVEntry,
    TxnCas,
    TxnCheckIndex,
    TxnConflictError,
    TxnDelete,
    TxnDeleteCas,
    TxnOp,
    TxnSet,
)
from caravan_llm.common.contract import (
    AdapterDemandRecord,
    ContractDecodeError,
    ContractError,
    DemandRecord,
    DrainRecord,
    KVLayout,
    ModelAdapters,
    ModelFailure,
    ScaleOverride,
    declared_name_owners,
    decode_adapter_demand,
    decode_demand,
    decode_desired_count,
    decode_drain,
    decode_model_adapters,
    decode_models_revision,
    encode_desired_count,
    encode_drain,
    encode_models_revision,
)
from caravan_llm.scheduler.cluster_config import CLUSTER_CONFIG_CODEC, ClusterConfig
from caravan_llm.scheduler.model_history import (
    ModelHistory,
    parse_history,
    prune_ops,
    version_write,
)
from caravan_llm.scheduler.profile_policy import policy_problems
from caravan_llm.scheduler.profiles import (
    ModelProfile,
    ProfileError,
    parse_profile_text,
    profile_to_json,
)
from caravan_llm.scheduler.world import DesiredModel

log = logging.getLogger(__name__)


class KVStore(Protocol):
    """The Consul KV calls the store needs (implemented by
    caravan_llm.common.consul_api.ConsulClient)."""

    async def kv_get(
        self, key: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, KVEntry | None]: ...

    async def kv_get_recurse(
        self, prefix: str, *, index: int = 0, wait_s: float | None = None
    ) -> tuple[int, tuple[KVEntry, ...]]: ...

    async def kv_put(
        self,
        key: str,
        value: bytes | str,
        *,
        cas: int | None = None,
        flags: int | None = None,
        acquire: str | None = None,
        release: str | None = None,
    ) -> bool: ...

    async def kv_delete(
        self, key: str, *, recurse: bool = False, cas: int | None = None
    ) -> bool: ...

    async def txn(self, ops: list[TxnOp] | tuple[TxnOp, ...]) -> tuple[KVEntry, ...]: ...


# A lost race is retried from a fresh read this many times in all, then reported.
WRITE_ATTEMPTS = 4
# One transaction holds every profile of a submission and its new version in
# the history, plus the revision counter.
MAX_PROFILES_PER_SUBMISSION = (MAX_TXN_OPS - 1) // 2


class UnknownModelError(KeyError):
    """No profile with that name exists in KV."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(name)

    def __str__(self) -> str:
        return f"no model named {self.name!r} (see `caravan list`)"


class ScaleOutOfBoundsError(ValueError):
    """A manual scale the model refuses: outside replicas.min..max, or a bad option."""


# How long `caravan scale` holds the count of an autoscaled model when no
# duration is given, and the longest hold it accepts (a forgotten override
# must not pin a model for ever: `--auto` or a new count ends one sooner).
DEFAULT_OVERRIDE_S = 3600.0
MAX_OVERRIDE_S = 7 * 24 * 3600.0


class WriteConflictError(Exception):
    """Others kept changing the models while this change was applied; nothing was written.

    Retryable: the same request may succeed a moment later.
    """

    retryable = True

    def __init__(self, what: str, attempts: int) -> None:
        self.what = what
        self.attempts = attempts
        super().__init__(
            f"{what}: the models changed while this was being written ({attempts} attempts); "
            "nothing was written, try again"
        )


@dataclass(frozen=True, slots=True)
class StoredModels:
    """models/ and the revision counter as read, with the indexes a write is conditioned on."""

    profiles: Mapping[str, ModelProfile]
    # ModifyIndex of every key under models/ (valid or not), by model name.
    indexes: Mapping[str, int]
    revision: int = 0
    revision_index: int = 0

    def index_of(self, name: str) -> int:
        """The index a write of this model is conditioned on (0: it must not exist)."""
        return self.indexes.get(name, 0)


def parse_stored_models(
    entries: tuple[KVEntry, ...], revision: KVEntry | None, layout: KVLayout
) -> StoredModels:
    """Sort a read of models/ and the revision key (pure)."""
    profiles: dict[str, ModelProfile] = {}
    indexes: dict[str, int] = {}
    for entry in entries:
        name = _suffix(entry, layout.models)
        indexes[name] = entry.modify_index
        try:
            profile = parse_profile_text(entry.value, entry.key)
        except ProfileError:
            continue
        if profile.name == name:
            profiles[name] = profile
    count = 0
    if revision is not None:
        try:
            count = decode_models_revision(revision.value, key=revision.key)
        except ContractError:
            # Written around caravan: the next write replaces it (still check-and-set).
            count = 0
    return StoredModels(
        profiles=profiles,
        indexes=indexes,
        revision=count,
        revision_index=revision.modify_index if revision is not None else 0,
    )


def submit_ops(profiles: list[ModelProfile], stored: StoredModels, layout: KVLayout) -> list[TxnOp]:
    """The one transaction that writes `profiles`, valid only if nothing changed since `stored`."""
    ops: list[TxnOp] = [
        TxnCas(layout.model_key(p.name), profile_to_json(p).encode(), stored.index_of(p.name))
        for p in profiles
    ]
    ops.append(
        TxnCas(
            layout.models_revision,
            encode_models_revision(stored.revision + 1),
            stored.revision_index,
        )
    )
    return ops


def delete_ops(name: str, model_index: int, layout: KVLayout) -> list[TxnOp]:
    """Remove a model and its desired count, demand signal, autoscaler memory and hold, at once.

    Its failure record (`failed/`, the scheduler's to write) is removed by the
    scheduler's next pass, which records failures of existing models only.
    """
    return [
        TxnDeleteCas(layout.model_key(name), model_index),
        TxnDelete(layout.desired_key(name)),
        TxnDelete(layout.demand_key(name)),
        TxnDelete(layout.state_key(name)),
        TxnDelete(layout.override_key(name)),
    ]


def scale_ops(
    name: str,
    count: int,
    model_index: int,
    layout: KVLayout,
    override: ScaleOverride | None = None,
) -> list[TxnOp]:
    """Set the desired count, only if the profile whose bounds were checked is unchanged.

    With an `override` (an autoscaled model) the hold is written in the same
    transaction, so the autoscaler never sees the count without it.
    """
    ops: list[TxnOp] = [
        TxnCheckIndex(layout.model_key(name), model_index),
        TxnSet(layout.desired_key(name), encode_desired_count(count)),
    ]
    if override is not None:
        ops.append(TxnSet(layout.override_key(name), override.encode()))
    else:
        # A model without autoscaling keeps any count; a hold left from when it
        # had autoscaling would only be shown, so it goes.
        ops.append(TxnDelete(layout.override_key(name)))
    return ops


def release_ops(name: str, model_index: int, layout: KVLayout) -> list[TxnOp]:
    """Hand the count back to the autoscaler (`caravan scale NAME --auto`)."""
    return [
        TxnCheckIndex(layout.model_key(name), model_index),
        TxnDelete(layout.override_key(name)),
    ]


def hold_seconds(profile: ModelProfile, hold_s: float | None) -> float | None:
    """How long a manual scale holds against the autoscaler: None when it has none (pure)."""
    if profile.autoscaling is None or not profile.autoscaling.enabled:
        return None
    return DEFAULT_OVERRIDE_S if hold_s is None else hold_s


def scale_override_for(
    profile: ModelProfile, count: int, hold_s: float | None, now: float
) -> ScaleOverride | None:
    """The override a manual scale writes (pure); raises ScaleOutOfBoundsError on a bad ask.

    An autoscaled model is held for `hold_s` (default `DEFAULT_OVERRIDE_S`);
    a model without autoscaling keeps any count until it is changed, so a
    duration means nothing there and is refused rather than ignored.
    """
    autoscaled = profile.autoscaling is not None and profile.autoscaling.enabled
    if not autoscaled:
        if hold_s is not None:
            raise ScaleOutOfBoundsError(
                f"{profile.name}: hold duration: the model has no autoscaling, so its count "
                "holds until changed; a duration applies to autoscaled models only"
            )
        return None
    duration = DEFAULT_OVERRIDE_S if hold_s is None else hold_s
    if not math.isfinite(duration) or not 0 < duration <= MAX_OVERRIDE_S:
        raise ScaleOutOfBoundsError(
            f"{profile.name}: hold duration: {duration:g}s is not within 0..{MAX_OVERRIDE_S:g}s"
        )
    return ScaleOverride(count=count, until=now + duration, set_at=now)


@dataclass(frozen=True, slots=True)
class DesiredState:
    """Everything under the prefix that drives reconciliation, read in one pass."""

    profiles: Mapping[str, ModelProfile]
    # Keys under models/ whose value does not validate: name -> problems.
    invalid: Mapping[str, str]
    stored_counts: Mapping[str, int]
    draining: Mapping[str, DrainRecord]
    demand: Mapping[str, DemandRecord]
    index: int = 0
    autoscaler_state: Mapping[str, bytes] = field(default_factory=dict)
    # Manual counts held against the autoscaler (expired ones included).
    overrides: Mapping[str, ScaleOverride] = field(default_factory=dict)
    # Models whose every replica failed for good, as the scheduler recorded it.
    failures: Mapping[str, ModelFailure] = field(default_factory=dict)
    # The cluster config the leading scheduler renders with, when it published one.
    cluster_config: ClusterConfig | None = None
    # The LoRA adapters each replica of a model holds, as the leader last published.
    adapters: Mapping[str, ModelAdapters] = field(default_factory=dict)
    # Each router's requests per second for each adapter of a model (model -> records).
    adapter_demand: Mapping[str, tuple[AdapterDemandRecord, ...]] = field(default_factory=dict)

    def desired_count(self, name: str) -> int:
        """The desired replica count: the stored one clamped to the profile's bounds."""
        profile = self.profiles[name]
        stored = self.stored_counts.get(name)
        count = profile.replicas.start if stored is None else stored
        return min(max(count, profile.replicas.min), profile.replicas.max)

    def desired_models(self) -> dict[str, DesiredModel]:
        """Every valid profile with its desired count, as the planner and assess take them."""
        return {
            name: DesiredModel(profile=profile, count=self.desired_count(name))
            for name, profile in self.profiles.items()
        }


def _suffix(entry: KVEntry, prefix: str) -> str:
    return entry.key[len(prefix) :]


def _parse_draining(entry: KVEntry, job_id: str) -> DrainRecord | None:
    try:
        return decode_drain(entry.value, key=entry.key)
    except ContractError as exc:
        log.warning("drain_marker_unreadable", extra={"job_id": job_id, "error": str(exc)})
        return None


def _parse_demand(entry: KVEntry) -> DemandRecord | None:
    try:
        return decode_demand(entry.value, key=entry.key)
    except ContractError:
        return None


def parse_desired_state(entries: tuple[KVEntry, ...], layout: KVLayout, index: int) -> DesiredState:
    """Sort a recursive read of the prefix into its parts (pure)."""
    profiles: dict[str, ModelProfile] = {}
    declared_at: dict[str, int] = {}
    invalid: dict[str, str] = {}
    counts: dict[str, int] = {}
    draining: dict[str, DrainRecord] = {}
    demand: dict[str, DemandRecord] = {}
    state: dict[str, bytes] = {}
    overrides: dict[str, ScaleOverride] = {}
    failures: dict[str, ModelFailure] = {}
    adapters: dict[str, ModelAdapters] = {}
    adapter_demand: dict[str, list[AdapterDemandRecord]] = {}
    cluster_config: ClusterConfig | None = None
    for entry in entries:
        if entry.key == layout.cluster_config:
            try:
                cluster_config = CLUSTER_CONFIG_CODEC.decode(entry.value, key=entry.key)
            except ContractError as exc:
                log.warning(
                    "cluster_config_unreadable", extra={"key": entry.key, "error": str(exc)}
                )
        elif entry.key.startswith(layout.models):
            name = _suffix(entry, layout.models)
            try:
                profile = parse_profile_text(entry.value, entry.key)
            except ProfileError as exc:
                invalid[name] = "; ".join(exc.problems)
                continue
            if profile.name != name:
                invalid[name] = f"profile name {profile.name!r} does not match its key {name!r}"
                continue
            profiles[name] = profile
            declared_at[name] = entry.create_index
        elif entry.key.startswith(layout.desired):
            try:
                counts[_suffix(entry, layout.desired)] = decode_desired_count(
                    entry.value, key=entry.key
                )
            except ContractError:
                log.warning("desired_count_unreadable", extra={"key": entry.key})
        elif entry.key.startswith(layout.draining):
            job_id = _suffix(entry, layout.draining)
            record = _parse_draining(entry, job_id)
            if record is not None:
                draining[job_id] = record
        elif entry.key.startswith(layout.demand):
            signal = _parse_demand(entry)
            if signal is not None:
                demand[_suffix(entry, layout.demand)] = signal
        elif entry.key.startswith(layout.state):
            state[_suffix(entry, layout.state)] = entry.value
        elif entry.key.startswith(layout.overrides):
            try:
                overrides[_suffix(entry, layout.overrides)] = ScaleOverride.decode(entry.value)
            except ContractDecodeError as exc:
                # Unreadable: the autoscaler acts as if there were none.
                log.warning(
                    "scale_override_unreadable", extra={"key": entry.key, "error": str(exc)}
                )
        elif entry.key.startswith(layout.adapter_demand):
            model, _, router = _suffix(entry, layout.adapter_demand).partition("/")
            try:
                figures = decode_adapter_demand(entry.value, key=entry.key)
            except ContractError as exc:
                log.warning(
                    "adapter_demand_unreadable", extra={"key": entry.key, "error": str(exc)}
                )
                continue
            if model and router:
                # The key names the writer (what `forget_adapter_demand` deletes).
                named = (
                    figures
                    if figures.router == router
                    else figures.model_copy(update={"router": router})
                )
                adapter_demand.setdefault(model, []).append(named)
        elif entry.key.startswith(layout.adapters):
            model = _suffix(entry, layout.adapters)
            try:
                adapters[model] = decode_model_adapters(entry.value, key=entry.key, model=model)
            except ContractError as exc:
                # Unreadable: status shows none until the leader writes it again.
                log.warning("adapters_unreadable", extra={"key": entry.key, "error": str(exc)})
        elif entry.key.startswith(layout.failures):
            try:
                failures[_suffix(entry, layout.failures)] = ModelFailure.decode(entry.value)
            except ContractDecodeError as exc:
                log.warning("model_failure_unreadable", extra={"key": entry.key, "error": str(exc)})
    # Profiles written around caravan (Terraform, `consul kv put`) skipped the
    # submit-time policy check: the scheduler refuses them here too, so they
    # are left alone (their running replicas, if any, stay as they are).
    policy_config = cluster_config or ClusterConfig()
    for name, profile in list(profiles.items()):
        problems = policy_problems(
            profile, policy_config.profile_policy, cluster_images=policy_config.engine_images
        )
        if problems:
            invalid[name] = "; ".join(problems)
            del profiles[name]
    # Two models may not share a served name (submit refuses it; KV writes
    # around caravan are held to it here): the one declared first keeps it,
    # by the contract's rule, which the routers follow too.
    # Adapter names are `model` values too: unique across every profile's served
    # name and adapters (`declared_name_owners`).
    owners = declared_name_owners(
        {name: (p.declared_names, declared_at[name]) for name, p in profiles.items()}
    )
    for name, profile in list(profiles.items()):
        taken = [(n, owners[n]) for n in profile.declared_names if owners.get(n, name) != name]
        if taken:
            served, owner = taken[0]
            invalid[name] = name_clash_message(profile, served, owner)
            del profiles[name]
    return DesiredState(
        profiles=profiles,
        invalid=invalid,
        stored_counts=counts,
        draining=draining,
        demand=demand,
        index=index,
        autoscaler_state=state,
        overrides=overrides,
        failures=failures,
        cluster_config=cluster_config,
        adapters=adapters,
        adapter_demand={m: tuple(r) for m, r in sorted(adapter_demand.items())},
    )


def name_clash_message(profile: ModelProfile, name: str, owner: str, where: str = "") -> str:
    """Why `profile` may not serve `name`: model `owner` serves it (one line, naming the field).

    `where` says where the owner was declared ("" for a stored model).
    """
    if name == profile.served_name:
        field, other = "served_model_name", "served_model_name"
    else:
        index = [adapter.name for adapter in profile.adapters].index(name)
        field, other = f"adapters[{index}].name", "adapter name"
    if where:
        return f"{field}: {name!r} is also served by model {owner!r} in {where}"
    return (
        f"{field}: {name!r} is already served by model {owner!r}; "
        f"choose another {other} or delete {owner} first"
    )


class ModelStore:
    """Reads and writes caravan's desired state in Consul KV."""

    def __init__(self, kv: KVStore, layout: KVLayout) -> None:
        self.kv = kv
        self.layout = layout

    async def read(self, *, index: int = 0, wait_s: float | None = None) -> DesiredState:
        """Everything under the prefix (blocking when `index` is given)."""
        new_index, entries = await self.kv.kv_get_recurse(
            self.layout.prefix, index=index, wait_s=wait_s
        )
        return parse_desired_state(entries, self.layout, new_index)

    async def profile(self, name: str) -> ModelProfile:
        _, entry = await self.kv.kv_get(self.layout.model_key(name))
        if entry is None:
            raise UnknownModelError(name)
        return parse_profile_text(entry.value, entry.key)

    async def stored_profile_document(self, name: str) -> dict[str, Any] | None:
        """The JSON object stored at models/<name>; None when absent or not a JSON object."""
        _, entry = await self.kv.kv_get(self.layout.model_key(name))
        if entry is None:
            return None
        try:
            document = json.loads(entry.value)
        except (ValueError, UnicodeDecodeError):
            return None
        return document if isinstance(document, dict) else None

    async def read_models(self) -> StoredModels:
        """models/ and the revision counter, with the indexes writes are conditioned on."""
        _, entries = await self.kv.kv_get_recurse(self.layout.models)
        _, revision = await self.kv.kv_get(self.layout.models_revision)
        return parse_stored_models(entries, revision, self.layout)

    async def history(self, name: str) -> ModelHistory:
        """The kept versions of a model's profile (empty for one never written by caravan)."""
        _, entries = await self.kv.kv_get_recurse(self.layout.history_prefix(name))
        return parse_history(name, entries, self.layout)

    async def histories(self) -> dict[str, ModelHistory]:
        """The kept versions of every model's profile, by model name."""
        _, entries = await self.kv.kv_get_recurse(self.layout.history)
        by_model: dict[str, list[KVEntry]] = {}
        for entry in entries:
            name, _, _ = entry.key[len(self.layout.history) :].partition("/")
            by_model.setdefault(name, []).append(entry)
        return {name: parse_history(name, found, self.layout) for name, found in by_model.items()}

    async def write_profiles(
        self,
        profiles: list[ModelProfile],
        stored: StoredModels,
        *,
        reverted_from: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> dict[str, int]:
        """Write validated profiles in one transaction conditioned on `stored`.

        Each changed profile becomes a new version in its model's history in
        the same transaction (cas 0: nobody else may have claimed it).
        Returns the version of each model; raises TxnConflictError (nothing
        written) when anything changed since.
        """
        if len(profiles) > MAX_PROFILES_PER_SUBMISSION:
            raise ValueError(
                f"a submission holds at most {MAX_PROFILES_PER_SUBMISSION} profiles "
                f"(got {len(profiles)})"
            )
        now = clock()
        origins = reverted_from or {}
        ops = submit_ops(profiles, stored, self.layout)
        versions: dict[str, int] = {}
        prunes: list[TxnOp] = []
        for profile in profiles:
            history = await self.history(profile.name)
            write = version_write(
                profile_to_json(profile),
                history,
                self.layout,
                now=now,
                reverted_from=origins.get(profile.name),
            )
            versions[profile.name] = write.version
            ops.extend(write.ops)
            prunes.extend(prune_ops(history, len(write.ops), self.layout))
        # Old versions go as far as the transaction has room; a later write takes the rest.
        ops.extend(prunes[: max(MAX_TXN_OPS - len(ops), 0)])
        await self.kv.txn(ops)
        return versions

    async def submit(self, profiles: list[ModelProfile]) -> None:
        """Write profiles validated by the caller, all or none, retrying a lost race."""
        for _ in range(WRITE_ATTEMPTS):
            stored = await self.read_models()
            try:
                await self.write_profiles(profiles, stored)
            except TxnConflictError:
                continue
            return
        raise WriteConflictError("submit", WRITE_ATTEMPTS)

    async def delete(self, name: str) -> None:
        """Remove a model: the scheduler then drains and stops its replicas."""
        for _ in range(WRITE_ATTEMPTS):
            _, entry = await self.kv.kv_get(self.layout.model_key(name))
            if entry is None:
                raise UnknownModelError(name)
            try:
                await self.kv.txn(delete_ops(name, entry.modify_index, self.layout))
            except TxnConflictError:
                continue
            return
        raise WriteConflictError(f"delete {name}", WRITE_ATTEMPTS)

    async def scale(
        self,
        name: str,
        count: int,
        *,
        hold_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> ModelProfile:
        """Set the desired count of a model, within its replicas.min..max.

        On an autoscaled model the count is also an override the autoscaler
        holds for `hold_s` (default `DEFAULT_OVERRIDE_S`), written in the same
        transaction.
        """
        for _ in range(WRITE_ATTEMPTS):
            _, entry = await self.kv.kv_get(self.layout.model_key(name))
            if entry is None:
                raise UnknownModelError(name)
            profile = parse_profile_text(entry.value, entry.key)
            bounds = profile.replicas
            if not bounds.min <= count <= bounds.max:
                raise ScaleOutOfBoundsError(
                    f"{name}: {count} replicas is outside replicas.min..max "
                    f"({bounds.min}..{bounds.max})"
                )
            override = scale_override_for(profile, count, hold_s, clock())
            try:
                await self.kv.txn(scale_ops(name, count, entry.modify_index, self.layout, override))
            except TxnConflictError:
                continue
            return profile
        raise WriteConflictError(f"scale {name}", WRITE_ATTEMPTS)

    async def release_override(self, name: str) -> ModelProfile:
        """End a manual hold: the autoscaler decides the count again from its next evaluation."""
        for _ in range(WRITE_ATTEMPTS):
            _, entry = await self.kv.kv_get(self.layout.model_key(name))
            if entry is None:
                raise UnknownModelError(name)
            profile = parse_profile_text(entry.value, entry.key)
            if profile.autoscaling is None or not profile.autoscaling.enabled:
                raise ScaleOutOfBoundsError(
                    f"{name}: --auto: the model has no enabled autoscaling to hand the count to"
                )
            try:
                await self.kv.txn(release_ops(name, entry.modify_index, self.layout))
            except TxnConflictError:
                continue
            return profile
        raise WriteConflictError(f"scale {name} --auto", WRITE_ATTEMPTS)

    async def record_failure(self, name: str, failure: ModelFailure | None) -> None:
        """Publish (or clear, with None) why every replica of a model failed; scheduler only."""
        if failure is None:
            await self.kv.kv_delete(self.layout.failure_key(name))
        else:
            await self.kv.kv_put(self.layout.failure_key(name), failure.encode())

    async def set_desired(self, name: str, count: int) -> None:
        """Write a desired count as the autoscaler decided it (bounds already applied)."""
        await self.kv.kv_put(self.layout.desired_key(name), encode_desired_count(count))

    async def mark_draining(self, job_id: str, record: DrainRecord) -> None:
        await self.kv.kv_put(self.layout.draining_key(job_id), encode_drain(record))

    async def clear_draining(self, job_id: str) -> None:
        await self.kv.kv_delete(self.layout.draining_key(job_id))

    async def clear_demand(self, name: str) -> None:
        await self.kv.kv_delete(self.layout.demand_key(name))

    async def forget_adapter_demand(self, model: str, router: str) -> None:
        """Delete a router's adapter-demand record (`adapter-demand/<model>/<router>`)."""
        await self.kv.kv_delete(self.layout.adapter_demand_key(model, router))

    async def publish_cluster_config(self, config: ClusterConfig) -> None:
        """Share the config the scheduler renders with (status and validation use it)."""
        document = CLUSTER_CONFIG_CODEC.encode(config)
        _, entry = await self.kv.kv_get(self.layout.cluster_config)
        if entry is None or entry.value.decode("utf-8", "replace") != document:
            await self.kv.kv_put(self.layout.cluster_config, document)

    async def cluster_config(self) -> ClusterConfig | None:
        _, entry = await self.kv.kv_get(self.layout.cluster_config)
        if entry is None:
            return None
        try:
            return CLUSTER_CONFIG_CODEC.decode(entry.value, key=entry.key)
        except ContractError:
            return None

    async def put_autoscaler_state(self, name: str, document: str) -> None:
        await self.kv.kv_put(self.layout.state_key(name), document)
