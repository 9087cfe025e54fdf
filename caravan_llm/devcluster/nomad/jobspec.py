"""`POST /v1/jobs/parse`: an HCL2 jobspec to the job's API JSON, for the HCL caravan uses.

python-hcl2 reads the syntax; this module evaluates the small expression
language caravan's own jobspecs (`jobspecs/`) and `nomad init`'s example use,
and maps blocks to the `api.Job` fields the way Nomad's `jobspec2` does:

* `variable` blocks with defaults, overridden by the request's `Variables`;
* `var.<name>` references, string interpolation of them, `==`, `!=`, `&&`,
  `||`, `!`, `? :`, lists, and the functions `trimprefix`, `trimsuffix`,
  `lower`, `upper`, `length`; `validation` blocks are checked;
* `dynamic "<block>"` with `for_each` and `content` (`<block>.value`/`.key`);
* heredocs (`<<EOT`, `<<-EOT`); `${...}` that refers to anything other than
  variables (`${node.class}`, `${NOMAD_PORT_http}`) stays as text for the
  client to interpolate, as in Nomad.

Anything else (locals, other functions, `for` expressions, HCL1) is refused
with an error naming it: `Failed to parse job: input.hcl: ...`.
Keys the jobspec does not set are left out (Nomad's reply has them as null);
`Canonicalize: true` fills the defaults as registration does.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

try:
    import hcl2

    HCL_AVAILABLE = True
except ImportError:  # python-hcl2 comes with the `demo` extra
    HCL_AVAILABLE = False

from caravan_llm.devcluster.nomad.canonicalize import canonicalize_job
from caravan_llm.devcluster.nomad.gotext import parse_go_duration

Json = dict[str, Any]

BLOCK = "__is_block__"
VAR_ROOTS = ("var.",)


class JobspecError(ValueError):
    """The jobspec cannot be parsed (or uses HCL devcluster does not evaluate)."""


# -- expressions ---------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<num>\d+(?:\.\d+)?)
      | (?P<str>"(?:[^"\\]|\\.)*")
      | (?P<op>==|!=|&&|\|\||[!?:()\[\],])
      | (?P<name>[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z_][A-Za-z0-9_\-]*)*)
    )""",
    re.VERBOSE,
)

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "trimprefix": lambda s, p: s.removeprefix(p),
    "trimsuffix": lambda s, p: s.removesuffix(p),
    "lower": lambda s: s.lower(),
    "upper": lambda s: s.upper(),
    "length": len,
}


class _Expr:
    """A recursive-descent evaluator for the expression subset above."""

    def __init__(self, text: str, scope: Mapping[str, Any]) -> None:
        self.text = text
        self.scope = scope
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        stripped = text.rstrip()
        while pos < len(stripped):
            match = _TOKEN.match(stripped, pos)
            if match is None or match.end() == pos:
                raise JobspecError(f"Unsupported expression: {text!r} (at {stripped[pos:]!r})")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.at = 0

    def _peek(self) -> str | None:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> tuple[str, str]:
        if self.at >= len(self.tokens):
            raise JobspecError(f"Unsupported expression: {self.text!r} (ends early)")
        token = self.tokens[self.at]
        if expected is not None and token[1] != expected:
            raise JobspecError(f"Unsupported expression: {self.text!r} (expected {expected!r})")
        self.at += 1
        return token

    def evaluate(self) -> Any:
        value = self._ternary()
        if self.at != len(self.tokens):
            raise JobspecError(f"Unsupported expression: {self.text!r}")
        return value

    def _ternary(self) -> Any:
        condition = self._or()
        if self._peek() != "?":
            return condition
        self._take("?")
        yes = self._ternary()
        self._take(":")
        no = self._ternary()
        return yes if condition else no

    def _or(self) -> Any:
        value = self._and()
        while self._peek() == "||":
            self._take()
            right = self._and()
            value = bool(value) or bool(right)
        return value

    def _and(self) -> Any:
        value = self._compare()
        while self._peek() == "&&":
            self._take()
            right = self._compare()
            value = bool(value) and bool(right)
        return value

    def _compare(self) -> Any:
        value = self._unary()
        while self._peek() in {"==", "!="}:
            op = self._take()[1]
            right = self._unary()
            value = (value == right) if op == "==" else (value != right)
        return value

    def _unary(self) -> Any:
        if self._peek() == "!":
            self._take()
            return not self._unary()
        return self._primary()

    def _primary(self) -> Any:
        kind, text = self._take()
        if kind == "num":
            return float(text) if "." in text else int(text)
        if kind == "str":
            return interpolate(_unescape(text[1:-1]), self.scope)
        if text == "(":
            value = self._ternary()
            self._take(")")
            return value
        if text == "[":
            items: list[Any] = []
            while self._peek() != "]":
                items.append(self._ternary())
                if self._peek() == ",":
                    self._take()
            self._take("]")
            return items
        if kind == "name":
            return self._name(text)
        raise JobspecError(f"Unsupported expression: {self.text!r}")

    def _name(self, text: str) -> Any:
        if text in {"true", "false", "null"}:
            return {"true": True, "false": False, "null": None}[text]
        if self._peek() == "(":
            function = FUNCTIONS.get(text)
            if function is None:
                raise JobspecError(f'Call to unknown function: "{text}" is not supported')
            self._take("(")
            args: list[Any] = []
            while self._peek() != ")":
                args.append(self._ternary())
                if self._peek() == ",":
                    self._take()
            self._take(")")
            return function(*args)
        if text in self.scope:
            return self.scope[text]
        if text.startswith("var."):
            raise JobspecError(
                f'Reference to undeclared input variable: "{text.removeprefix("var.")}"'
            )
        raise JobspecError(f"Unsupported expression: reference to {text!r}")


def _unescape(body: str) -> str:
    try:
        text: str = json.loads(f'"{body}"')
    except ValueError:
        raise JobspecError(f"Invalid string literal: {body!r}") from None
    return text


def _evaluable(inner: str, scope: Mapping[str, Any]) -> bool:
    """Whether `${inner}` is ours to evaluate (it names a variable or iterator)."""
    names = re.findall(r"[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z_][A-Za-z0-9_\-]*)*", inner)
    return any(name.startswith(VAR_ROOTS) or name in scope for name in names)


def interpolate(text: str, scope: Mapping[str, Any]) -> str:
    """Replace the `${...}` of a string that refer to variables; keep the rest as text."""
    out: list[str] = []
    pos = 0
    while (start := text.find("${", pos)) >= 0:
        if start > 0 and text[start - 1] == "$":
            out.append(text[pos : start + 2])
            pos = start + 2
            continue
        end = text.find("}", start)
        if end < 0:
            break
        inner = text[start + 2 : end]
        out.append(text[pos:start])
        if _evaluable(inner, scope):
            value = _Expr(inner, scope).evaluate()
            out.append(value if isinstance(value, str) else json.dumps(value))
        else:
            out.append(text[start : end + 1])
        pos = end + 1
    out.append(text[pos:])
    return "".join(out).replace("$${", "${")


def _heredoc(raw: str) -> str:
    header, _, rest = raw.partition("\n")
    body = rest.rsplit("\n", 1)[0] + "\n"
    return textwrap.dedent(body) if header.startswith("<<-") else body


def value_of(raw: Any, scope: Mapping[str, Any]) -> Any:
    """The value of one attribute as python-hcl2 returned it (quotes kept)."""
    if isinstance(raw, bool | int | float) or raw is None:
        return raw
    if isinstance(raw, list):
        return [value_of(item, scope) for item in raw]
    if isinstance(raw, dict):
        return {_label(key): value_of(item, scope) for key, item in raw.items() if key != BLOCK}
    text = str(raw)
    if text.startswith('"<<'):
        return interpolate(_heredoc(text[1:-1]), scope)
    if text.startswith('"') and text.endswith('"'):
        return interpolate(_unescape(text[1:-1]), scope)
    if text.startswith("${") and text.endswith("}"):
        return _Expr(text[2:-1], scope).evaluate()
    return _Expr(text, scope).evaluate()


def _label(key: str) -> str:
    return key[1:-1] if key.startswith('"') and key.endswith('"') else key


# -- variables -----------------------------------------------------------------


def _variables(document: Json, given: Mapping[str, str]) -> dict[str, Any]:
    declared: dict[str, Json] = {}
    for entry in document.get("variable", []):
        for label, body in entry.items():
            declared[_label(label)] = body
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise JobspecError(f'Undefined variable: A variable named "{unknown[0]}" was assigned')
    scope: dict[str, Any] = {}
    for name, body in declared.items():
        kind = str(body.get("type", "string")).strip("${}")
        if name in given:
            scope[f"var.{name}"] = _typed(name, given[name], kind)
        elif "default" in body:
            scope[f"var.{name}"] = value_of(body["default"], {})
        else:
            raise JobspecError(f'Unset variable "{name}": a value is required')
    for body in declared.values():
        for rule in body.get("validation", []):
            if not value_of(rule.get("condition"), scope):
                message = value_of(rule.get("error_message", '""'), scope)
                raise JobspecError(f"Invalid value for variable: {message}")
    return scope


def _typed(name: str, text: str, kind: str) -> Any:
    if kind == "string":
        return text
    if kind == "number":
        try:
            return float(text) if "." in text else int(text)
        except ValueError:
            raise JobspecError(
                f'Invalid value for variable "{name}": a number is required'
            ) from None
    if kind == "bool" and text in {"true", "false"}:
        return text == "true"
    try:
        return json.loads(text)
    except ValueError:
        raise JobspecError(f'Invalid value for variable "{name}": {kind} expected') from None


# -- blocks ----------------------------------------------------------------------

DURATIONS = frozenset(
    {
        "interval",
        "timeout",
        "delay",
        "max_delay",
        "min_healthy_time",
        "healthy_deadline",
        "progress_deadline",
        "stagger",
        "kill_timeout",
        "shutdown_delay",
        "grace",
        "deadline",
        "splay",
        "ttl",
    }
)
# Attribute names whose API field is not the PascalCase of the HCL name.
RENAMES = {
    "cpu": "CPU",
    "memory": "MemoryMB",
    "memory_max": "MemoryMaxMB",
    "size": "SizeMB",
    "destination": "DestPath",
    "data": "EmbeddedTmpl",
    "source": "SourcePath",
    "left_delimiter": "LeftDelim",
    "right_delimiter": "RightDelim",
    "max_file_size": "MaxFileSizeMB",
    "url": "URL",
    "id": "ID",
    "attribute": "LTarget",
    "operator": "Operand",
    "ttl": "TTL",
}
# Blocks: HCL name -> (API field, repeated, labelled-by).
BLOCKS: dict[str, tuple[str, bool, str | None]] = {
    "group": ("TaskGroups", True, "Name"),
    "task": ("Tasks", True, "Name"),
    "constraint": ("Constraints", True, None),
    "affinity": ("Affinities", True, None),
    "spread": ("Spreads", True, None),
    "target": ("SpreadTarget", True, "Value"),
    "service": ("Services", True, None),
    "check": ("Checks", True, None),
    "check_restart": ("CheckRestart", False, None),
    "network": ("Networks", True, None),
    "template": ("Templates", True, None),
    "update": ("Update", False, None),
    "migrate": ("Migrate", False, None),
    "restart": ("RestartPolicy", False, None),
    "reschedule": ("ReschedulePolicy", False, None),
    "resources": ("Resources", False, None),
    "ephemeral_disk": ("EphemeralDisk", False, None),
    "logs": ("LogConfig", False, None),
    "device": ("Devices", True, "Name"),
    "identity": ("Identity", False, None),
    "ui": ("UI", False, None),
    "link": ("Links", True, None),
    "parameterized": ("ParameterizedJob", False, None),
    "lifecycle": ("Lifecycle", False, None),
}
RAW_MAPS = frozenset({"config", "env", "meta"})


def _pascal(name: str) -> str:
    return RENAMES.get(name) or "".join(part.capitalize() for part in name.split("_"))


def _attribute(name: str, value: Any) -> Any:
    if name in DURATIONS and isinstance(value, str):
        try:
            return parse_go_duration(value)
        except ValueError:
            raise JobspecError(
                f'Unsuitable value: "{name}" = "{value}" is not a duration'
            ) from None
    return value


def _entries(raw: Any, kind: str) -> list[tuple[str | None, Json]]:
    """(label, body) of each `kind` block python-hcl2 returned."""
    found: list[tuple[str | None, Json]] = []
    for entry in raw if isinstance(raw, list) else [raw]:
        if not isinstance(entry, dict):
            raise JobspecError(f'Unsupported argument: "{kind}" must be a block')
        if entry.get(BLOCK):
            found.append((None, entry))
            continue
        for label, body in entry.items():
            if not isinstance(body, dict):
                raise JobspecError(f'Unsupported argument: "{kind}" must be a block')
            found.append((_label(label), body))
    return found


def _expand_dynamic(body: Json, scope: Mapping[str, Any]) -> Json:
    """`dynamic "x" { for_each, content }` -> plain `x` blocks, one per element."""
    dynamics = body.get("dynamic")
    if not dynamics:
        return body
    expanded = {key: value for key, value in body.items() if key != "dynamic"}
    for label, spec in _entries(dynamics, "dynamic"):
        if label is None:
            raise JobspecError('Missing name for dynamic block: "dynamic" needs a block type')
        items = value_of(spec.get("for_each"), scope)
        contents = [content for _, content in _entries(spec.get("content", []), "content")]
        if len(contents) != 1:
            raise JobspecError(f'dynamic "{label}" needs exactly one content block')
        if any(_is_block_or_map(value) for value in contents[0].values()):
            raise JobspecError(f'dynamic "{label}": blocks inside content are not supported')
        pairs = items.items() if isinstance(items, dict) else enumerate(items or [])
        for key, item in pairs:
            inner = {**scope, f"{label}.value": item, f"{label}.key": key}
            resolved = {
                name: value_of(value, inner) for name, value in contents[0].items() if name != BLOCK
            }
            expanded.setdefault(label, []).append({**resolved, BLOCK: True, "__resolved__": True})
    return expanded


def _is_block_or_map(raw: Any) -> bool:
    return isinstance(raw, dict) or (
        isinstance(raw, list) and bool(raw) and isinstance(raw[0], dict)
    )


def _port(label: str, body: Json) -> tuple[str, Json]:
    port: Json = {"Label": label}
    if "static" in body:
        port["Value"] = body["static"]
    for name in ("to", "host_network"):
        if name in body:
            port[_pascal(name)] = body[name]
    return ("ReservedPorts" if "static" in body else "DynamicPorts"), port


def convert_block(kind: str, body: Json, scope: Mapping[str, Any]) -> Json:
    """One block body to its API object."""
    body = _expand_dynamic(body, scope)
    out: Json = {}
    for name, raw in body.items():
        if name in {BLOCK, "__resolved__"}:
            continue
        resolved = body.get("__resolved__", False)
        if name == "port" and kind == "network":
            for label, port_body in _entries(raw, "port"):
                values = {k: value_of(v, scope) for k, v in port_body.items() if k != BLOCK}
                field, port = _port(label or "", values)
                out.setdefault(field, []).append(port)
            continue
        if name in RAW_MAPS and _is_block_or_map(raw):
            bodies = [b for _, b in _entries(raw, name)] if isinstance(raw, list) else [raw]
            merged: Json = {}
            for item in bodies:
                merged.update(
                    {_label(k): value_of(v, scope) for k, v in item.items() if k != BLOCK}
                )
            out[name.capitalize() if name != "env" else "Env"] = merged
            continue
        if name in BLOCKS and isinstance(raw, list) and raw and isinstance(raw[0], dict):
            field, repeated, label_field = BLOCKS[name]
            items = []
            for label, inner in _entries(raw, name):
                converted = convert_block(name, inner, scope)
                if label_field is not None and label is not None:
                    converted[label_field] = label
                items.append(converted)
            out[field] = items if repeated else items[-1]
            continue
        if isinstance(raw, list) and raw and isinstance(raw[0], dict) and raw[0].get(BLOCK):
            raise JobspecError(f'block "{name}" is not supported by devcluster\'s jobs/parse')
        value = raw if resolved else value_of(raw, scope)
        out[_pascal(name)] = _attribute(name, value)
    return _finish(kind, out)


def _finish(kind: str, out: Json) -> Json:
    if kind in {"constraint", "affinity"}:
        if out.pop("DistinctHosts", None):
            out["Operand"] = "distinct_hosts"
        if "DistinctProperty" in out:
            out["Operand"] = "distinct_property"
            out["LTarget"] = out.pop("DistinctProperty")
        if "Value" in out:
            out["RTarget"] = str(out.pop("Value"))
        out.setdefault("Operand", "=")
    if kind == "spread" and "LTarget" in out:
        out["Attribute"] = out.pop("LTarget")
    if kind in {"service", "check"} and "Port" in out:
        out["PortLabel"] = str(out.pop("Port"))
    if kind == "template" and "Env" in out:
        out["Envvars"] = out.pop("Env")
    return out


def parse_jobspec(
    text: str, *, variables: Mapping[str, str] | None = None, canonicalize: bool = False
) -> Json:
    """The one job of an HCL2 jobspec as Nomad's API JSON."""
    if not HCL_AVAILABLE:
        raise JobspecError(
            "devcluster needs python-hcl2 to parse HCL: pip install 'caravan-llm[demo]'"
        )
    options = hcl2.SerializationOptions(
        strip_string_quotes=False, with_comments=False, explicit_blocks=True, preserve_heredocs=True
    )
    try:
        document: Json = hcl2.loads(text, serialization_options=options)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise JobspecError(f"input.hcl: {first}") from None
    unsupported = sorted(set(document) - {"job", "variable"})
    if unsupported:
        raise JobspecError(
            f'input.hcl: Unsupported block type: "{unsupported[0]}" is not supported'
        )
    jobs = _entries(document.get("job", []), "job")
    if len(jobs) != 1:
        raise JobspecError(f"input.hcl: expected 1 job block, found {len(jobs)}")
    label, body = jobs[0]
    scope = _variables(document, variables or {})
    job = convert_block("job", body, scope)
    job["ID"] = job.get("ID") or label
    job.setdefault("Name", label)
    return canonicalize_job(job) if canonicalize else job
