"""The operations on models that both the CLI and the scheduler's HTTP API offer.

One implementation, two front doors: `caravan submit/list/status/delete/scale`
call it directly against Consul and Nomad, and the scheduler's `/v1/models`
endpoints call it for remote clients.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.cluster_config import ClusterConfig
from scheduler.model_store import ModelStore
from scheduler.profiles import ModelProfile, ProfileError, parse_profile_text
from scheduler.render import RenderError, render
from scheduler.status import ModelStatus, StatusReader


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


def validate_submission(
    documents: list[tuple[str, str]], config: ClusterConfig
) -> list[ModelProfile]:
    """Validate every (source, text) profile; raise with every problem, or return them all."""
    problems: list[SubmissionProblem] = []
    profiles: list[ModelProfile] = []
    seen: dict[str, str] = {}
    for source, text in documents:
        try:
            profile = parse_profile_text(text, source)
            # What the schema cannot see (unknown GPU class, multi-node) is
            # caught by rendering replica 0, before anything is written.
            render(profile, 0, config=config)
        except ProfileError as exc:
            problems.extend(SubmissionProblem(source, p) for p in exc.problems)
            continue
        except RenderError as exc:
            problems.append(SubmissionProblem(source, str(exc)))
            continue
        if profile.name in seen:
            problems.append(
                SubmissionProblem(source, f"name: {profile.name!r} is also in {seen[profile.name]}")
            )
            continue
        seen[profile.name] = source
        profiles.append(profile)
    if problems:
        raise SubmissionRejectedError(problems)
    return profiles


@dataclass(slots=True)
class ModelService:
    store: ModelStore
    status: StatusReader
    config: ClusterConfig

    async def submit(self, documents: list[tuple[str, str]]) -> list[ModelProfile]:
        """Validate all, then write all: a submission that fails validation writes nothing.

        Profiles are validated against the cluster config the leading
        scheduler published (GPU classes, images), else the local one.
        """
        config = await self.store.cluster_config() or self.config
        profiles = validate_submission(documents, config)
        await self.store.submit(profiles)
        return profiles

    async def list(self) -> list[ModelStatus]:
        return await self.status.models()

    async def describe(self, name: str) -> ModelStatus:
        return await self.status.model(name)

    async def delete(self, name: str) -> None:
        await self.store.delete(name)

    async def scale(self, name: str, count: int) -> ModelProfile:
        return await self.store.scale(name, count)
