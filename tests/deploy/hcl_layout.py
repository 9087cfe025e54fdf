"""A checker for the layout `nomad fmt` / `terraform fmt` give HCL files.

Neither binary can run here, so this re-states the rules of hclwrite's
formatter (hashicorp/hcl, `hclwrite/format.go`) that a hand-edited file most
often breaks:

1. indentation is two spaces per open bracket (`{`, `[`, `(`, `${`), and a
   line that closes brackets is dedented;
2. consecutive lines that each assign a single-line value form a chain whose
   `=` signs line up one space after the longest name; a blank line, a
   comment line, a block header or a multi-line value ends the chain; a
   heredoc value counts as single-line (its body belongs to its line);
3. exactly one space follows `=`, and one space precedes an `=` outside a
   chain;
4. trailing comments on consecutive lines line up one space after the
   longest content;
5. no tabs and no trailing whitespace outside heredoc bodies.

It is not the formatter: spacing between other tokens is not checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_HEREDOC_START = re.compile(r"<<(-?)([A-Za-z_][A-Za-z0-9_-]*)[ \t]*\n")
_WORD = re.compile(r"[A-Za-z0-9_.\-*/%+!<>?:]")
_OPENERS = "{[("
_CLOSERS = "}])"
# Two-character operators that contain `=` and are not assignments.
_EQUAL_OPERATORS = ("==", "!=", "<=", ">=", "=>")


@dataclass(frozen=True, slots=True)
class LayoutProblem:
    """One departure from the formatter's layout, at a 1-based line number."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "open", "close", "assign", "comment", "heredoc", "other"
    start: int  # column on the logical line's first physical line
    end: int
    brackets: int = 0  # net bracket change carried by the token (strings: 0)


@dataclass(slots=True)
class _Line:
    """A formatter line: one physical line, or several when a heredoc spans them."""

    number: int
    text: str  # the first physical line
    tokens: list[_Token] = field(default_factory=list)


class _Scanner:
    def __init__(self, source: str) -> None:
        self.source = source
        self.pos = 0
        self.line_number = 1
        self.line_start = 0
        self.problems: list[LayoutProblem] = []

    def column(self) -> int:
        return self.pos - self.line_start

    def scan(self) -> list[_Line]:
        lines: list[_Line] = []
        current = self._new_line()
        while self.pos < len(self.source):
            char = self.source[self.pos]
            if char == "\n":
                lines.append(current)
                self.pos += 1
                self.line_number += 1
                self.line_start = self.pos
                current = self._new_line()
            elif char in " \r":
                self.pos += 1
            elif char == "\t":
                self.problems.append(LayoutProblem(self.line_number, "tab character"))
                self.pos += 1
            elif char == "#" or self.source.startswith("//", self.pos):
                end = self.source.find("\n", self.pos)
                end = len(self.source) if end == -1 else end
                current.tokens.append(_Token("comment", self.column(), end - self.line_start))
                self.pos = end
            elif self.source.startswith("/*", self.pos):
                self._block_comment(current)
            elif char == '"':
                start = self.column()
                self._skip_string()
                current.tokens.append(_Token("other", start, self.column()))
            elif self.source.startswith("${", self.pos) or self.source.startswith("%{", self.pos):
                current.tokens.append(_Token("open", self.column(), self.column() + 2, 1))
                self.pos += 2
            elif _HEREDOC_START.match(self.source, self.pos):
                self._heredoc(current)
            elif char == "=":
                self._equals(current)
            elif char in _OPENERS:
                current.tokens.append(_Token("open", self.column(), self.column() + 1, 1))
                self.pos += 1
            elif char in _CLOSERS:
                current.tokens.append(_Token("close", self.column(), self.column() + 1, -1))
                self.pos += 1
            else:
                self._word(current)
        lines.append(current)
        return lines

    def _new_line(self) -> _Line:
        end = self.source.find("\n", self.pos)
        end = len(self.source) if end == -1 else end
        return _Line(self.line_number, self.source[self.pos : end])

    def _equals(self, current: _Line) -> None:
        start = self.column()
        previous = self.source[self.pos - 1] if self.pos > 0 else ""
        pair_after = self.source[self.pos : self.pos + 2]
        if pair_after in _EQUAL_OPERATORS or previous + "=" in _EQUAL_OPERATORS:
            current.tokens.append(_Token("other", start, start + 1))
        else:
            current.tokens.append(_Token("assign", start, start + 1))
        self.pos += 1

    def _word(self, current: _Line) -> None:
        start = self.column()
        if self.source[self.pos] in "!<>" and self.source[self.pos + 1 : self.pos + 2] == "=":
            self.pos += 1  # the `=` of `!=`, `<=`, `>=` is consumed by _equals
        while self.pos < len(self.source) and _WORD.match(self.source[self.pos]):
            if self.source.startswith(("//", "/*"), self.pos):
                break
            self.pos += 1
        if self.column() == start:
            self.pos += 1  # a character no other rule takes, such as `,`
        current.tokens.append(_Token("other", start, self.column()))

    def _block_comment(self, current: _Line) -> None:
        start = self.column()
        end = self.source.find("*/", self.pos)
        end = len(self.source) if end == -1 else end + 2
        newlines = self.source.count("\n", self.pos, end)
        if newlines:
            self.line_number += newlines
            self.line_start = self.source.rfind("\n", 0, end) + 1
        self.pos = end
        current.tokens.append(_Token("comment", start, self.column()))

    def _skip_string(self) -> None:
        """Move past a quoted string, including interpolations with nested strings."""
        self.pos += 1
        depth = 0
        while self.pos < len(self.source):
            char = self.source[self.pos]
            if char == "\\":
                self.pos += 2
                continue
            if char == "\n":
                self.problems.append(LayoutProblem(self.line_number, "unterminated string"))
                return
            if depth == 0 and self.source.startswith(("$${", "%%{"), self.pos):
                self.pos += 3
                continue
            if self.source.startswith(("${", "%{"), self.pos):
                depth += 1
                self.pos += 2
                continue
            if depth > 0 and char == "{":
                depth += 1
            elif depth > 0 and char == "}":
                depth -= 1
            elif char == '"' and depth > 0:
                self._skip_string()
                continue
            elif char == '"':
                self.pos += 1
                return
            self.pos += 1

    def _heredoc(self, current: _Line) -> None:
        """Take a heredoc as one token: its body belongs to the line it opens on."""
        match = _HEREDOC_START.match(self.source, self.pos)
        if match is None:  # pragma: no cover - the caller matched already
            return
        start = self.column()
        marker = match.group(2)
        self.pos = match.end()
        self.line_number += 1
        self.line_start = self.pos
        while self.pos < len(self.source):
            end = self.source.find("\n", self.pos)
            end = len(self.source) if end == -1 else end
            body_line = self.source[self.pos : end]
            if body_line.strip() == marker:
                self.pos = end
                current.tokens.append(_Token("heredoc", start, start + len(match.group(0))))
                return
            self.pos = end + 1
            self.line_number += 1
            self.line_start = self.pos
        self.problems.append(LayoutProblem(current.number, f"heredoc {marker} is never closed"))


def _assign_index(line: _Line) -> int | None:
    """Where the line's `=` opens an assign cell, as hclwrite's linesForFormat decides."""
    tokens = _content_tokens(line)
    for index, token in enumerate(tokens):
        if index > 0 and token.kind == "assign":
            rest = sum(t.brackets for t in tokens[index:])
            return index if rest == 0 else None
    return None


def _content_tokens(line: _Line) -> list[_Token]:
    """The line's tokens without a trailing comment."""
    if len(line.tokens) > 1 and line.tokens[-1].kind == "comment":
        return line.tokens[:-1]
    return line.tokens


def _check_indent(lines: list[_Line]) -> list[LayoutProblem]:
    problems: list[LayoutProblem] = []
    indents: list[int] = []
    for line in lines:
        if not line.tokens:
            continue
        net = sum(token.brackets for token in line.tokens)
        if net < 0:
            closed = -net
            while closed > 0 and indents:
                if closed >= indents[-1]:
                    closed -= indents.pop()
                else:
                    indents[-1] -= closed
                    closed = 0
        expected = 2 * len(indents)
        actual = line.tokens[0].start
        if actual != expected:
            problems.append(
                LayoutProblem(line.number, f"indented {actual} spaces, expected {expected}")
            )
        if net > 0:
            indents.append(net)
    return problems


def _check_assign_chains(lines: list[_Line]) -> list[LayoutProblem]:
    problems: list[LayoutProblem] = []
    chain: list[tuple[_Line, int]] = []

    def close_chain() -> None:
        if not chain:
            return
        widest = max(_content_tokens(line)[index - 1].end for line, index in chain)
        for line, index in chain:
            column = _content_tokens(line)[index].start
            if column != widest + 1:
                problems.append(
                    LayoutProblem(
                        line.number,
                        f"'=' at column {column + 1}, expected column {widest + 2} "
                        "(aligned one space after the longest name of its group)",
                    )
                )
        chain.clear()

    for line in lines:
        index = _assign_index(line)
        if index is None:
            close_chain()
        else:
            chain.append((line, index))
    close_chain()
    return problems


def _check_equals_spacing(lines: list[_Line]) -> list[LayoutProblem]:
    problems: list[LayoutProblem] = []
    for line in lines:
        tokens = _content_tokens(line)
        chained = _assign_index(line)
        for index, token in enumerate(tokens):
            if token.kind != "assign":
                continue
            following = tokens[index + 1] if index + 1 < len(tokens) else None
            if following is not None and following.start != token.end + 1:
                problems.append(LayoutProblem(line.number, "expected one space after '='"))
            if index != chained and index > 0 and token.start != tokens[index - 1].end + 1:
                problems.append(LayoutProblem(line.number, "expected one space before '='"))
    return problems


def _check_comment_chains(lines: list[_Line]) -> list[LayoutProblem]:
    problems: list[LayoutProblem] = []
    chain: list[_Line] = []

    def close_chain() -> None:
        if not chain:
            return
        widest = max(line.tokens[-2].end for line in chain)
        problems.extend(
            LayoutProblem(line.number, "trailing comment not aligned with its neighbours")
            for line in chain
            if line.tokens[-1].start != widest + 1
        )
        chain.clear()

    for line in lines:
        if len(line.tokens) > 1 and line.tokens[-1].kind == "comment":
            chain.append(line)
        else:
            close_chain()
    close_chain()
    return problems


def _check_trailing_whitespace(lines: list[_Line]) -> list[LayoutProblem]:
    return [
        LayoutProblem(line.number, "trailing whitespace")
        for line in lines
        if line.text != line.text.rstrip(" \t\r")
    ]


def layout_problems(source: str) -> list[LayoutProblem]:
    """Every place where `source` departs from the layout `nomad fmt` writes."""
    scanner = _Scanner(source)
    lines = scanner.scan()
    problems = [
        *scanner.problems,
        *_check_indent(lines),
        *_check_assign_chains(lines),
        *_check_equals_spacing(lines),
        *_check_comment_chains(lines),
        *_check_trailing_whitespace(lines),
    ]
    return sorted(problems, key=lambda problem: problem.line)
