"""Task `template` blocks that read Nomad Variables, rendered the way Nomad's client does.

Nomad renders a task's templates (consul-template) in a prestart hook: each
`EmbeddedTmpl` goes to `DestPath`, relative to the task directory
(`secrets/`, `local/`), with `Perms`; a template with `Envvars: true` is
then read as an env file whose variables override the task's own `env`
(`client/taskenv/env.go`). While a variable a template needs is missing the
task does not start: the template runner waits and reports a `Template`
task event `Missing: nomad.var.block(<path>@<namespace>.<region>)`. A template
that cannot be rendered kills the task (`Killing`, `Template failed: ...`).

This module renders the subset of Go's text/template that caravan emits:

    {{ with nomadVar "path" }}...{{ .item }}...{{ end }}
    {{ with nomadVar "path" }}{{ range .Tuples }}{{ .K }}={{ .V }}{{ end }}{{ end }}

plus `{{-`/`-}}` whitespace trimming. Anything else is a render error. The
pure part is `render`; `render_task_templates` writes the files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Json = dict[str, Any]
# (path) -> items, or None when the variable does not exist (or may not be read).
VariableLookup = Callable[[str], Mapping[str, str] | None]

# An absent item is the zero `NomadVarItem` (consul-template's map of structs), which prints "".
NO_VALUE = ""
_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.DOTALL)
_WITH_VAR = re.compile(r'^with\s+nomadVar\s+"([^"]*)"$')
_RANGE_TUPLES = re.compile(r"^range\s+\.Tuples$")
_FIELD = re.compile(r"^\.([A-Za-z_][A-Za-z0-9_]*)$")


class TemplateError(Exception):
    """The template cannot be rendered; the text is what the task event says."""


class MissingVariable(Exception):
    """A variable the template reads does not exist yet; rendering waits for it."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass(frozen=True, slots=True)
class _Text:
    text: str


@dataclass(frozen=True, slots=True)
class _Field:
    name: str


@dataclass(frozen=True, slots=True)
class _WithVar:
    path: str
    body: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _RangeTuples:
    body: tuple[_Node, ...]


_Node = _Text | _Field | _WithVar | _RangeTuples


def _tokens(source: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", s)], with Go's `{{- ` / ` -}}` trimming applied."""
    out: list[tuple[str, str]] = []
    position = 0
    trim_next = False
    for match in _ACTION.finditer(source):
        text = source[position : match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        if text:
            out.append(("text", text))
        out.append(("action", match.group(2).strip()))
        trim_next = bool(match.group(3))
        position = match.end()
    tail = source[position:]
    if trim_next:
        tail = tail.lstrip()
    if tail:
        out.append(("text", tail))
    return out


def parse(source: str, name: str = "tmpl") -> tuple[_Node, ...]:
    """Parse the supported subset; `TemplateError` names what is not supported."""
    tokens = _tokens(source)
    nodes, _, ended = _parse_block(tokens, 0, name)
    if ended:
        raise TemplateError(f"template: {name}: unexpected {{{{end}}}}")
    return nodes


def _parse_block(
    tokens: Sequence[tuple[str, str]], index: int, name: str
) -> tuple[tuple[_Node, ...], int, bool]:
    """Nodes from `index` up to a matching `end` (nodes, index after it, found `end`)."""
    nodes: list[_Node] = []
    while index < len(tokens):
        kind, value = tokens[index]
        index += 1
        if kind == "text":
            nodes.append(_Text(value))
            continue
        if value == "end":
            return tuple(nodes), index, True
        if value.startswith("/*") and value.endswith("*/"):
            continue
        with_var = _WITH_VAR.match(value)
        if with_var is not None or _RANGE_TUPLES.match(value):
            body, index, ended = _parse_block(tokens, index, name)
            if not ended:
                raise TemplateError(f"template: {name}: unexpected EOF")
            nodes.append(_WithVar(with_var.group(1), body) if with_var else _RangeTuples(body))
            continue
        field = _FIELD.match(value)
        if field is not None:
            nodes.append(_Field(field.group(1)))
            continue
        raise TemplateError(f"template: {name}: devcluster does not render {{{{{value}}}}}")
    return tuple(nodes), index, False


def render(
    source: str, lookup: VariableLookup, *, name: str = "tmpl", err_missing_key: bool = False
) -> str:
    """Render `source`; `MissingVariable` when a `nomadVar` is absent."""
    nodes = parse(source, name)
    return _render(nodes, None, lookup, name, err_missing_key)


def _render(
    nodes: Sequence[_Node],
    dot: Mapping[str, str] | None,
    lookup: VariableLookup,
    name: str,
    err_missing_key: bool,
) -> str:
    out: list[str] = []
    for node in nodes:
        match node:
            case _Text(text):
                out.append(text)
            case _Field(field):
                if dot is None:
                    raise TemplateError(
                        f"template: {name}: can't evaluate field {field} outside nomadVar"
                    )
                if field not in dot:
                    if err_missing_key:
                        raise TemplateError(f'template: {name}: map has no entry for key "{field}"')
                    out.append(NO_VALUE)
                else:
                    out.append(dot[field])
            case _WithVar(path, body):
                items = lookup(path)
                if items is None:
                    raise MissingVariable(path)
                if items:
                    out.append(_render(body, items, lookup, name, err_missing_key))
            case _RangeTuples(body):
                if dot is None:
                    raise TemplateError(f"template: {name}: range .Tuples outside nomadVar")
                for key in sorted(dot):
                    pair = {"K": key, "V": dot[key]}
                    out.append(_render(body, pair, lookup, name, err_missing_key))
    return "".join(out)


_ENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*(.*)$")


def parse_env_file(text: str) -> dict[str, str]:
    """`KEY=value` lines (`#` comments, optional quotes, `export `) as Nomad reads them."""
    env: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if match is None:
            raise TemplateError(f"invalid env line {line.split('=', 1)[0]!r}")
        key, value = match.group(1), match.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in {'"', "'"}:
            value = value[1:-1]
        env[key] = value
    return env


def render_texts(templates: Sequence[Mapping[str, Any]], lookup: VariableLookup) -> list[str]:
    """Every template's text, in order; raises `MissingVariable` or `TemplateError`."""
    return [
        render(
            str(template.get("EmbeddedTmpl") or ""),
            lookup,
            name=f"tmpl{number}",
            err_missing_key=bool(template.get("ErrMissingKey", False)),
        )
        for number, template in enumerate(templates)
    ]


def write_task_templates(
    templates: Sequence[Mapping[str, Any]], task_dir: Path, texts: Sequence[str]
) -> dict[str, str]:
    """Write rendered `texts` under `task_dir`; return the env of `Envvars` templates."""
    targets: list[Path] = []
    for number, template in enumerate(templates):
        dest = str(template.get("DestPath") or "")
        target = (task_dir / dest).resolve()
        if not dest or not target.is_relative_to(task_dir.resolve()):
            raise TemplateError(f"template {number}: destination {dest!r} escapes the task dir")
        targets.append(target)
    env: dict[str, str] = {}
    for template, target, text in zip(templates, targets, texts, strict=True):
        perms = int(str(template.get("Perms") or "0644"), 8)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, perms)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        target.chmod(perms)
        if template.get("Envvars", False):
            env.update(parse_env_file(text))
    return env


def render_task_templates(
    templates: Sequence[Mapping[str, Any]], task_dir: Path, lookup: VariableLookup
) -> dict[str, str]:
    """Render and write every template under `task_dir`; the env of `Envvars` templates.

    Raises `MissingVariable` (nothing is written) or `TemplateError`.
    """
    return write_task_templates(templates, task_dir, render_texts(templates, lookup))
