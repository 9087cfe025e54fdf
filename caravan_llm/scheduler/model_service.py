"""The operations on models that both the CLI and the scheduler's HTTP API offer.

One implementation, two front doors: `caravan submit/list/status/delete/scale`
call it directly against Consul and Nomad, and the scheduler's `/v1/models`
endpoints call it for remote clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from caravan_llm.common.consul_api import TxnConflictError
from caravan_llm.common.contract import (
    JOB_PREFIX,
    ProfileDocumentError,
    decode_profile_document,
)
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.dry_run import SubmissionPlan, plan_submission
from caravan_llm.scheduler.model_history import ModelHistory, ProfileVersion
from caravan_llm.scheduler.model_store import (
    MAX_PROFILES_PER_SUBMISSION,
    WRITE_ATTEMPTS,
    ModelStore,
    UnknownModelError,
    WriteConflictError,
    name_clash_message,
)
from caravan_llm.scheduler.profile_policy import document_policy_problems, policy_problems
from caravan_llm.scheduler.profiles import ModelProfile, ProfileError, profile_from_mapping
from caravan_llm.scheduler.render import RenderError, render
from caravan_llm.scheduler.status import ModelStatus, StatusReader
from caravan_llm.scheduler.world import ObservedReplica, replica_from_job_stub


@dataclass(frozen=True, slots=True)
class SubmissionProblem:
    """One reason a submission was refused: where, and what is wrong."""

    source: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.message}"


class SubmissionRejectedError(ValueError):
    """At least one profile is invalid; nothing was written."""

    def __init__(self, problems: list[SubmissionProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True, slots=True)
class SubmittedProfile:
    """A profile as written, with the version it is in its model's history."""

    profile: ModelProfile
    version: int


class UnknownVersionError(KeyError):
    """The model's history keeps no such version."""

    def __init__(self, name: str, version: int, history: ModelHistory) -> None:
        self.name = name
        self.version = version
        self.kept = tuple(v.version for v in history.versions)
        super().__init__(name)

    def __str__(self) -> str:
        kept = ", ".join(str(v) for v in self.kept) or "none"
        return (
            f"{self.name}: no version {self.version} is kept (kept: {kept}; "
            f"see `caravan history {self.name}`)"
        )


class NothingToRevertError(ValueError):
    """The version asked for is the model's current profile already."""


@dataclass(frozen=True, slots=True)
class ModelHistoryView:
    """What `caravan history` shows: kept versions newest first, and the current one."""

    name: str
    # The version whose profile is in models/<name>; None when it was written
    # around caravan, or the model is deleted.
    current: int | None
    exists: bool
    versions: tuple[ProfileVersion, ...]
    unreadable: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "current": self.current,
            "exists": self.exists,
            "versions": [v.to_json() for v in self.versions],
            "unreadable": list(self.unreadable),
        }


# Rendering checks every replica a profile may have; beyond this many, refuse.
MAX_RENDERED_REPLICAS = 1024


def _render_problems(profile: ModelProfile, config: ClusterConfig) -> list[str]:
    """Render every replica the profile may scale to; what the schema cannot see shows here."""
    if profile.replicas.max > MAX_RENDERED_REPLICAS:
        limit = MAX_RENDERED_REPLICAS
        return [f"replicas.max: {profile.replicas.max} is more than caravan runs ({limit})"]
    try:
        for replica in range(profile.replicas.max):
            render(profile, replica, config=config)
    except RenderError as exc:
        return [str(exc)]
    return []


def _clash_problems(
    submitted: list[tuple[str, ModelProfile]], stored: Mapping[str, ModelProfile]
) -> list[SubmissionProblem]:
    """Two models may not share a `model` value (a served name or an adapter's name): the
    router could route it to only one of them."""
    problems: list[SubmissionProblem] = []
    replaced = {profile.name for _, profile in submitted}
    owners = {
        served: name
        for name, p in sorted(stored.items())
        if name not in replaced
        for served in p.declared_names
    }
    seen: dict[str, tuple[str, str]] = {}
    for source, profile in submitted:
        for served in profile.declared_names:
            owner = owners.get(served)
            if owner is not None:
                problems.append(
                    SubmissionProblem(source, name_clash_message(profile, served, owner))
                )
            earlier = seen.get(served)
            if earlier is not None and earlier[0] != profile.name:
                problems.append(
                    SubmissionProblem(
                        source, name_clash_message(profile, served, earlier[0], earlier[1])
                    )
                )
            seen.setdefault(served, (profile.name, source))
    return problems


def validate_submission(
    documents: Sequence[tuple[str, str | bytes]],
    config: ClusterConfig,
    stored: Mapping[str, ModelProfile] | None = None,
    *,
    expected_name: str | None = None,
) -> list[ModelProfile]:
    """Validate every (source, text) profile; raise with every problem, or return them all.

    Checks, for each document: the schema, the cluster's profile policy,
    rendering of every replica against `config`, the name it was sent under
    (`expected_name`), and that its name and served name are unique within
    the submission and its served name among the `stored` models it does not
    replace. Pure: nothing is read or written.
    """
    problems: list[SubmissionProblem] = []
    accepted: list[tuple[str, ModelProfile]] = []
    seen: dict[str, str] = {}
    if len(documents) > MAX_PROFILES_PER_SUBMISSION:
        problems.append(
            SubmissionProblem(
                "submission",
                f"{len(documents)} profiles is more than one submission holds "
                f"({MAX_PROFILES_PER_SUBMISSION})",
            )
        )
    for source, text in documents:
        try:
            document = decode_profile_document(text, source=source)
        except ProfileDocumentError as exc:
            problems.append(SubmissionProblem(source, exc.problem))
            continue
        except RecursionError:
            problems.append(SubmissionProblem(source, "the document is nested too deeply"))
            continue
        try:
            profile = profile_from_mapping(document, source)
        except ProfileError as exc:
            # Every problem in one run: the policy's too, on what could be read.
            found_now = [
                *exc.problems,
                *document_policy_problems(
                    document, config.profile_policy, cluster_images=config.engine_images
                ),
            ]
            problems.extend(SubmissionProblem(source, p) for p in found_now)
            continue
        except RecursionError:
            # A hostile document (thousands of nested lists) must be a problem, not a 500.
            problems.append(SubmissionProblem(source, "the document is nested too deeply"))
            continue
        found: list[str] = []
        if expected_name is not None and profile.name != expected_name:
            found.append(
                f"name: the profile is named {profile.name!r} but was sent as {expected_name!r}"
            )
        found += [
            *policy_problems(profile, config.profile_policy, cluster_images=config.engine_images),
            *_render_problems(profile, config),
        ]
        if profile.name in seen:
            found.append(f"name: {profile.name!r} is also in {seen[profile.name]}")
        if found:
            problems.extend(SubmissionProblem(source, p) for p in found)
            continue
        seen[profile.name] = source
        accepted.append((source, profile))
    problems.extend(_clash_problems(accepted, stored or {}))
    if problems:
        raise SubmissionRejectedError(problems)
    return [profile for _, profile in accepted]


@dataclass(slots=True)
class ModelService:
    store: ModelStore
    status: StatusReader
    config: ClusterConfig

    async def submit(
        self, documents: list[tuple[str, str]], *, expected_name: str | None = None
    ) -> list[ModelProfile]:
        """Validate all, then write all in one transaction: a refused submission writes nothing."""
        return [
            s.profile for s in await self.submit_versioned(documents, expected_name=expected_name)
        ]

    async def submit_versioned(
        self,
        documents: list[tuple[str, str]],
        *,
        expected_name: str | None = None,
        reverted_from: int | None = None,
    ) -> list[SubmittedProfile]:
        """Validate all, then write all in one transaction; each profile with its version.

        Profiles are validated against the cluster config the leading
        scheduler published (GPU classes, images, profile policy), else the
        local one, and against the models stored when the write is prepared;
        if those change before the write lands, it is validated again from a
        fresh read (a bounded number of times). `reverted_from` marks the
        new version of `expected_name` as a revert to that version.
        """
        origins = (
            {} if reverted_from is None or expected_name is None else {expected_name: reverted_from}
        )
        for _ in range(WRITE_ATTEMPTS):
            stored = await self.store.read_models()
            config = await self.store.cluster_config() or self.config
            profiles = validate_submission(
                documents, config, stored.profiles, expected_name=expected_name
            )
            try:
                versions = await self.store.write_profiles(profiles, stored, reverted_from=origins)
            except TxnConflictError:
                continue
            return [SubmittedProfile(p, versions[p.name]) for p in profiles]
        raise WriteConflictError("submit", WRITE_ATTEMPTS)

    async def history(self, name: str) -> ModelHistoryView:
        """The kept versions of a model's profile, newest first, and which one is current."""
        history = await self.store.history(name)
        stored = await self.store.stored_profile_document(name)
        if not history.versions and stored is None:
            raise UnknownModelError(name)
        return ModelHistoryView(
            name=name,
            current=history.current_version(stored),
            exists=stored is not None,
            versions=tuple(reversed(history.versions)),
            unreadable=history.unreadable,
        )

    async def revert(self, name: str, version: int) -> SubmittedProfile:
        """Submit a kept version again as a new version, through the full validation.

        Like `nomad job revert`: the old profile becomes the newest version
        (marked as a revert); the cluster's current policy and the models
        stored now decide whether it is accepted, as for any submission.
        """
        history = await self.store.history(name)
        chosen = history.version(version)
        if chosen is None:
            raise UnknownVersionError(name, version, history)
        stored = await self.store.stored_profile_document(name)
        if stored is not None and stored == dict(chosen.profile):
            raise NothingToRevertError(
                f"{name}: version {version} is the current profile; there is nothing to revert"
            )
        (submitted,) = await self.submit_versioned(
            [(f"{name} version {version}", chosen.profile_text())],
            expected_name=name,
            reverted_from=version,
        )
        return submitted

    async def plan(self, documents: list[tuple[str, str]]) -> SubmissionPlan:
        """What submitting `documents` would change, job by job; nothing is written.

        The validation is the submission's own (`validate_submission`, against
        the published cluster config and the stored models); an invalid
        document raises SubmissionRejectedError as submit would.
        """
        stored = await self.store.read_models()
        config = await self.store.cluster_config() or self.config
        profiles = validate_submission(documents, config, stored.profiles)
        state = await self.store.read()
        stubs = (await self.status.nomad.list_jobs(JOB_PREFIX, meta=True)).value
        running: dict[str, list[ObservedReplica]] = {}
        for stub in stubs:
            replica = replica_from_job_stub(stub)
            if replica is not None:
                running.setdefault(replica.model, []).append(replica)
        return plan_submission(profiles, state, running, state.cluster_config or config)

    async def list(self) -> list[ModelStatus]:
        return await self.status.models()

    async def describe(self, name: str) -> ModelStatus:
        return await self.status.model(name)

    async def delete(self, name: str) -> None:
        await self.store.delete(name)

    async def scale(self, name: str, count: int, *, hold_s: float | None = None) -> ModelProfile:
        """Set the count; on an autoscaled model also hold it for `hold_s` (default 1 h)."""
        return await self.store.scale(name, count, hold_s=hold_s)

    async def release(self, name: str) -> ModelProfile:
        """`caravan scale NAME --auto`: end the hold, the autoscaler decides again."""
        return await self.store.release_override(name)
