"""The subset of go-bexpr filter expressions the emulator evaluates (`?filter=`).

Supported: `==`, `!=`, `contains`, `not contains`, `in`, `not in`,
`is empty`, `is not empty`, `matches`, `not matches`, combined with `and`,
`or`, `not` and parentheses. Selectors are dotted paths (`Service.Meta.k`,
`Service.Meta["k"]`); values are quoted strings, numbers or bare words.
Selectors are checked against a template record, so a typo is an error even
when the result set is empty, as in Consul.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

FILTER_ERROR_PREFIX = "Failed to create boolean expression evaluator: "

# In a template, a map whose values are structs holds one entry under ANY_KEY:
# any key selects it, then the struct's fields (`TaggedAddresses.lan.Port`).
ANY_KEY = "*"

# Fields whose children are map keys (any key is a valid selector).
MAP_FIELDS = frozenset(
    {"Meta", "NodeMeta", "ServiceMeta", "TaggedAddresses", "ServiceTaggedAddresses", "Header"}
)

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<lparen>\() | (?P<rparen>\)) | (?P<lbracket>\[) | (?P<rbracket>\]) |
        (?P<op>==|!=) | (?P<dot>\.) |
        (?P<string>"(?:[^"\\]|\\.)*"|`[^`]*`) |
        (?P<word>[A-Za-z0-9_\-/:@+*]+)
    )""",
    re.VERBOSE,
)


class FilterError(ValueError):
    """The expression does not parse or names a selector the data does not have."""


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str
    text: str
    position: int


def _tokenize(expression: str) -> list[_Token]:
    tokens: list[_Token] = []
    position = 0
    while position < len(expression):
        if expression[position:].strip() == "":
            break
        match = _TOKEN.match(expression, position)
        if match is None or match.lastgroup is None:
            raise FilterError(f"{FILTER_ERROR_PREFIX}1:{position + 1} ({position}): no match found")
        text = match.group(match.lastgroup)
        if match.lastgroup == "string":
            text = text[1:-1]
            if match.group(0).strip().startswith('"'):
                text = bytes(text, "utf-8").decode("unicode_escape")
        tokens.append(_Token(match.lastgroup, text, match.start(match.lastgroup)))
        position = match.end()
    return tokens


Predicate = Callable[[Mapping[str, Any]], bool]
_MISSING = object()


def _resolve(record: Any, path: tuple[str, ...]) -> Any:
    current = record
    for part in path:
        if not isinstance(current, Mapping) or part not in current:
            return _MISSING
        current = current[part]
    return current


def _selector_valid(template: Mapping[str, Any], path: tuple[str, ...]) -> bool:
    current: Any = template
    for index, part in enumerate(path):
        if not isinstance(current, Mapping):
            return False
        if part not in current and ANY_KEY in current:
            current = current[ANY_KEY]
            continue
        if part not in current:
            return index > 0 and path[index - 1] in MAP_FIELDS and index == len(path) - 1
        current = current[part]
    return True


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or value is _MISSING:
        return ""
    return str(value)


def _is_empty(value: Any) -> bool:
    if value is _MISSING or value is None:
        return True
    if isinstance(value, (str, list, tuple, dict)):
        return len(value) == 0
    return False


def _contains(container: Any, needle: str) -> bool:
    if isinstance(container, str):
        return needle in container
    if isinstance(container, Mapping):
        return needle in container
    if isinstance(container, (list, tuple)):
        return needle in (_as_text(v) for v in container)
    return False


class _Parser:
    def __init__(self, expression: str, template: Mapping[str, Any]) -> None:
        self._expression = expression
        self._tokens = _tokenize(expression)
        self._position = 0
        self._template = template
        self._selectors: list[tuple[str, ...]] = []

    def _peek(self, offset: int = 0) -> _Token | None:
        index = self._position + offset
        return self._tokens[index] if index < len(self._tokens) else None

    def _peek_word(self, offset: int = 0) -> str | None:
        token = self._peek(offset)
        return token.text if token is not None and token.kind == "word" else None

    def _error(self, what: str) -> FilterError:
        token = self._peek()
        where = token.position if token is not None else len(self._expression)
        return FilterError(f"{FILTER_ERROR_PREFIX}1:{where + 1} ({where}): {what}")

    def _take(self) -> _Token:
        token = self._peek()
        if token is None:
            raise self._error("no match found, expected more input")
        self._position += 1
        return token

    def parse(self) -> Predicate:
        if not self._tokens:
            raise self._error("no match found, expected an expression")
        predicate = self._or()
        if self._peek() is not None:
            raise self._error(f"no match found, unexpected {self._peek_text()!r}")
        # bexpr parses the whole expression first, then validates its selectors.
        for path in self._selectors:
            if not _selector_valid(self._template, path):
                dotted = ".".join(path)
                raise FilterError(f'{FILTER_ERROR_PREFIX}Selector "{dotted}" is not valid')
        return predicate

    def _peek_text(self) -> str:
        token = self._peek()
        return token.text if token is not None else ""

    def _or(self) -> Predicate:
        left = self._and()
        while self._peek_word() == "or":
            self._take()
            right = self._and()
            left = _combine_or(left, right)
        return left

    def _and(self) -> Predicate:
        left = self._not()
        while self._peek_word() == "and":
            self._take()
            right = self._not()
            left = _combine_and(left, right)
        return left

    def _not(self) -> Predicate:
        if self._peek_word() == "not":
            self._take()
            inner = self._not()
            return lambda record: not inner(record)
        return self._primary()

    def _primary(self) -> Predicate:
        token = self._peek()
        if token is not None and token.kind == "lparen":
            self._take()
            inner = self._or()
            closing = self._take()
            if closing.kind != "rparen":
                raise self._error("no match found, expected ')'")
            return inner
        return self._match()

    def _selector(self) -> tuple[str, ...]:
        first = self._take()
        if first.kind != "word":
            raise self._error("no match found, expected a selector")
        parts = [first.text]
        while True:
            token = self._peek()
            if token is not None and token.kind == "dot":
                self._take()
                part = self._take()
                if part.kind != "word":
                    raise self._error("no match found, expected a field name")
                parts.append(part.text)
            elif token is not None and token.kind == "lbracket":
                self._take()
                key = self._take()
                if key.kind != "string" or self._take().kind != "rbracket":
                    raise self._error('no match found, expected ["key"]')
                parts.append(key.text)
            else:
                break
        path = tuple(parts)
        self._selectors.append(path)
        return path

    def _value(self) -> str:
        token = self._take()
        if token.kind not in ("string", "word"):
            raise self._error("no match found, expected a value")
        return token.text

    def _match(self) -> Predicate:
        token = self._peek()
        if token is not None and token.kind == "string":
            # `"value" in Selector` / `"value" not in Selector`
            value = self._value()
            negate = self._peek_word() == "not"
            if negate:
                self._take()
            if self._peek_word() != "in":
                raise self._error("no match found, expected 'in'")
            self._take()
            path = self._selector()
            return _contains_predicate(path, value, negate=negate)
        if (
            token is not None
            and token.kind == "word"
            and self._peek_word(1) in ("in", "not")
            and not _looks_like_selector_op(self._peek_word(1), self._peek_word(2))
        ):
            value = self._value()
            negate = self._peek_word() == "not"
            if negate:
                self._take()
            self._take()
            path = self._selector()
            return _contains_predicate(path, value, negate=negate)
        path = self._selector()
        op_token = self._take()
        if op_token.kind == "op":
            value = self._value()
            equal = op_token.text == "=="
            return lambda record: (_as_text(_resolve(record, path)) == value) is equal
        word = op_token.text if op_token.kind == "word" else ""
        negate = False
        if word == "is":
            if self._peek_word() == "not":
                self._take()
                negate = True
            if self._take().text != "empty":
                raise self._error("no match found, expected 'empty'")
            return lambda record: _is_empty(_resolve(record, path)) is not negate
        if word == "not":
            negate = True
            word = self._take().text
        if word == "contains":
            return _contains_predicate(path, self._value(), negate=negate)
        if word == "matches":
            pattern = _compile(self._value())
            return lambda record: (
                (pattern.search(_as_text(_resolve(record, path))) is not None) is not negate
            )
        raise self._error(f"no match found, unexpected {word or op_token.text!r}")


def _looks_like_selector_op(second: str | None, third: str | None) -> bool:
    # `Tags not contains "x"` starts with a selector, `x not in Tags` with a value.
    return second == "not" and third in ("contains", "matches")


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise FilterError(f"{FILTER_ERROR_PREFIX}invalid regular expression: {exc}") from exc


def _contains_predicate(path: tuple[str, ...], value: str, *, negate: bool) -> Predicate:
    return lambda record: _contains(_resolve(record, path), value) is not negate


def _combine_and(left: Predicate, right: Predicate) -> Predicate:
    return lambda record: left(record) and right(record)


def _combine_or(left: Predicate, right: Predicate) -> Predicate:
    return lambda record: left(record) or right(record)


def compile_filter(expression: str, template: Mapping[str, Any]) -> Predicate:
    """A predicate over records shaped like `template`; FilterError on bad input."""
    return _Parser(expression, template).parse()
