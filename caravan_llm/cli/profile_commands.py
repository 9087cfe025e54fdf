"""`caravan validate` and `caravan render`: check profiles and show their jobs offline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from caravan_llm.cli.output import emit, fail, wants_json
from caravan_llm.scheduler.cluster_config import ClusterConfigError, load_cluster_config
from caravan_llm.scheduler.profiles import ProfileError, load_profile
from caravan_llm.scheduler.render import PlacementHints, RenderError, render, secret_templates
from caravan_llm.scheduler.weights import render_prefetch

if TYPE_CHECKING:
    from caravan_llm.scheduler.profiles import ModelProfile


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    validate = subparsers.add_parser(
        "validate",
        help="validate profile files (exit 1 with one line per problem)",
        description="Validate model profiles. Prints one line per problem: FILE: FIELD: MESSAGE.",
    )
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.add_argument("--config", help="cluster config YAML (GPU classes, images)")
    validate.add_argument("--json", action="store_true", help="print the result as JSON")
    validate.set_defaults(handler=run_validate)

    render_parser = subparsers.add_parser(
        "render",
        help="print the Nomad job JSON of one replica",
        description="Render one replica of a profile into the body of Nomad's PUT /v1/jobs.",
    )
    render_parser.add_argument("file", metavar="FILE")
    render_parser.add_argument("--replica", type=int, default=0, help="replica index (default 0)")
    render_parser.add_argument("--config", help="cluster config YAML (GPU classes, images)")
    render_parser.add_argument(
        "--avoid-node",
        action="append",
        default=[],
        metavar="NODE_ID",
        help="Nomad node ID hosting a sibling replica (repeatable; CPU replicas avoid it)",
    )
    render_parser.add_argument(
        "--prefetch",
        action="store_true",
        help="print the model's weights prefetch job instead of a replica",
    )
    render_parser.add_argument(
        "--json", action="store_true", help="errors as JSON too (the job is JSON already)"
    )
    render_parser.set_defaults(handler=run_render)


def run_validate(args: argparse.Namespace) -> int:
    """The scheduler's own validation (`validate_submission`, as submit runs it), offline.

    Each file gets the schema, the cluster's profile policy and a render of
    every replica it may scale to; then the files are checked together
    (names, served names). Every problem of every file is printed.
    """
    # Imported here: caravan_llm.scheduler.model_service also holds the store's I/O, whose
    # clients (aiohttp, consul) the parser of an offline command must not load.
    from caravan_llm.scheduler.model_service import (  # noqa: PLC0415
        SubmissionRejectedError,
        validate_submission,
    )

    try:
        config = load_cluster_config(args.config)
    except ClusterConfigError as exc:
        return fail(args, str(exc), kind="invalid_config")
    problems: list[str] = []
    seen: dict[str, str] = {}
    valid: list[tuple[str, bytes, ModelProfile]] = []
    for path in args.files:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            problems.append(f"{path}: cannot read file: {exc.strerror or exc}")
            continue
        try:
            (profile,) = validate_submission([(path, raw)], config)
        except SubmissionRejectedError as exc:
            problems.extend(str(problem) for problem in exc.problems)
            continue
        if profile.name in seen:
            problems.append(
                f"{path}: name: {profile.name!r} is already used by {seen[profile.name]}"
            )
            continue
        seen[profile.name] = path
        valid.append((path, raw, profile))
    try:
        validate_submission([(path, raw) for path, raw, _ in valid], config)
    except SubmissionRejectedError as exc:
        problems.extend(str(problem) for problem in exc.problems)
        valid = []
    if problems:
        noun = "problem" if len(problems) == 1 else "problems"
        message = f"{len(problems)} {noun}" if wants_json(args) else ""
        return fail(args, message, kind="invalid_profile", problems=problems)
    files = [
        {"file": path, "name": profile.name, "engine": profile.engine.value}
        for path, _, profile in valid
    ]
    text = "\n".join(f"{f['file']}: ok ({f['name']}, {f['engine']})" for f in files)
    emit(args, {"valid": files}, text)
    return 0


def run_render(args: argparse.Namespace) -> int:
    try:
        config = load_cluster_config(args.config)
        profile = load_profile(args.file)
        body = render(
            profile,
            args.replica,
            PlacementHints(sibling_nodes=frozenset(args.avoid_node)),
            config,
        )
        if args.prefetch:
            prefetch = render_prefetch(profile, config, secret_templates(profile))
            if prefetch is None:
                return fail(
                    args,
                    f"{args.file}: weights.prefetch: this profile has no prefetch job",
                    kind="not_found",
                )
            body = prefetch
    except ProfileError as exc:
        problems = [f"{args.file}: {problem}" for problem in exc.problems]
        message = "the profile is invalid" if wants_json(args) else ""
        return fail(args, message, kind="invalid_profile", problems=problems)
    except (RenderError, ClusterConfigError) as exc:
        return fail(args, f"{args.file}: {exc}", kind="invalid_profile")
    print(json.dumps(body, indent=2))
    return 0
