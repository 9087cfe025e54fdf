"""docs/nomad-consul-facts.md and the citations of it stay in step.

Code, tests, ADRs and docs cite a fact by its id (the word "facts" followed
by N7, C4-C6, P1...). Every cited id must exist in the facts file, every fact
there must be cited somewhere and link its public source, and citations in
the numbering used before the file existed are not added again.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FACTS = ROOT / "docs" / "nomad-consul-facts.md"
THIS_FILE = Path(__file__).resolve()

SCANNED_SUFFIXES = frozenset({".py", ".md", ".hcl", ".tf", ".yaml", ".yml", ".toml", ".sh"})
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "build", "dist"})

_HEADING = re.compile(r"^### ([NCP])(\d+)\. (.+)$", re.MULTILINE)
_ID = r"[NCP]\d+"
_CITATION = re.compile(rf"\bfacts\s+({_ID}(?:(?:\s*[-\u2013]\s*|\s*,\s*|\s+and\s+){_ID})*)")
_RANGE = re.compile(r"([NCP])(\d+)\s*[-\u2013]\s*([NCP])(\d+)")
_OLD_CITATION = re.compile(r"\bfacts\s+([A-G]\.\d+(?:\s*[-\u2013,]\s*[A-G]?\.?\d+)*|[A-G]\b)")
_OLD_ID = re.compile(r"[A-G]\.\d+")
_FACTS_PATH = re.compile(r"[\w./-]*nomad-consul-facts\.md")
_INLINE_LINK = re.compile(r"\]\((https://[^)\s]+)\)")
_REFERENCE_USE = re.compile(r"\]\[([\w-]+)\]")
_REFERENCE_DEF = re.compile(r"^\[([\w-]+)\]: (https://\S+)$", re.MULTILINE)
_LEGACY_ROW = re.compile(r"^\| ([A-G](?:\.\d+)?) \| ([NCP]\d+(?:, [NCP]\d+)*) \|$", re.MULTILINE)
SOURCE_HOSTS = (
    "https://github.com/hashicorp/",
    "https://developer.hashicorp.com/",
    "https://github.com/jrxFive/python-nomad",
    "https://github.com/criteo/py-consul",
)

# Files allowed to cite the old numbering (each old id maps through the
# "Earlier numbering" table): none any more.
PENDING_OLD_CITATIONS: frozenset[str] = frozenset()


def facts_text() -> str:
    return FACTS.read_text(encoding="utf-8")


def fact_sections() -> dict[str, str]:
    """Fact id -> the text of its section (heading included)."""
    text = facts_text()
    headings = list(_HEADING.finditer(text))
    sections: dict[str, str] = {}
    for number, match in enumerate(headings):
        end = headings[number + 1].start() if number + 1 < len(headings) else len(text)
        # A section ends at the next heading of any level.
        body = text[match.start() : end]
        next_heading = re.search(r"^#{1,3} ", body[match.end() - match.start() :], re.MULTILINE)
        if next_heading is not None:
            body = body[: match.end() - match.start() + next_heading.start()]
        sections[f"{match.group(1)}{match.group(2)}"] = body
    return sections


def scanned_files() -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*")):
        relative = path.relative_to(ROOT)
        if any(part.startswith(".") or part in SKIPPED_DIRS for part in relative.parts):
            continue
        if any(part.endswith(".egg-info") for part in relative.parts):
            continue
        if path.suffix not in SCANNED_SUFFIXES or not path.is_file():
            continue
        if path in (FACTS, THIS_FILE):
            continue
        yield path


def expand(citation: str) -> list[str]:
    """`N2, N6-N8` -> N2, N6, N7, N8 (a range with mixed prefixes stays as written)."""
    ids: list[str] = []
    for item in re.split(r"\s*,\s*|\s+and\s+", citation.strip()):
        bounds = _RANGE.fullmatch(item)
        if bounds is None:
            ids.append(item)
        elif bounds.group(1) != bounds.group(3) or int(bounds.group(2)) > int(bounds.group(4)):
            ids.append(item)  # reported as unknown: not a valid range
        else:
            first, last = int(bounds.group(2)), int(bounds.group(4))
            ids.extend(f"{bounds.group(1)}{n}" for n in range(first, last + 1))
    return ids


def citations() -> list[tuple[str, str]]:
    """(file:line, fact id) for every citation outside the facts file."""
    found: list[tuple[str, str]] = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in _CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            found.extend((where, fact_id) for fact_id in expand(match.group(1)))
    return found


def test_fact_ids_are_unique_and_numbered_without_gaps():
    """Each prefix numbers its facts 1, 2, 3... once each, so ids stay stable."""
    numbers: dict[str, list[int]] = {"N": [], "C": [], "P": []}
    for match in _HEADING.finditer(facts_text()):
        numbers[match.group(1)].append(int(match.group(2)))
    assert {prefix: list(range(1, len(found) + 1)) for prefix, found in numbers.items()} == numbers
    assert all(numbers.values())


def test_every_fact_links_a_public_source():
    """Each fact names where it was read: a HashiCorp doc or source file, or the client's repo."""
    text = facts_text()
    references = dict(_REFERENCE_DEF.findall(text))
    unlinked = []
    for fact_id, section in fact_sections().items():
        urls = _INLINE_LINK.findall(section)
        urls += [references.get(name, "") for name in _REFERENCE_USE.findall(section)]
        if not any(url.startswith(SOURCE_HOSTS) for url in urls):
            unlinked.append(fact_id)
    assert [] == unlinked


def test_reference_links_are_all_defined():
    """Every `[text][name]` link in the facts file has its `[name]: url` line."""
    text = facts_text()
    defined = {name for name, _ in _REFERENCE_DEF.findall(text)}
    assert set() == set(_REFERENCE_USE.findall(text)) - defined


def test_every_cited_fact_exists():
    """A citation names a fact of docs/nomad-consul-facts.md (listed: file:line and id)."""
    known = set(fact_sections())
    missing = [f"{where}: {fact_id}" for where, fact_id in citations() if fact_id not in known]
    assert [] == missing


def test_every_fact_is_cited():
    """No fact is written down that nothing relies on (listed: the uncited ids)."""
    cited = {fact_id for _, fact_id in citations()}
    withdrawn = {i for i, section in fact_sections().items() if "(withdrawn)" in section}
    assert [] == [i for i in fact_sections() if i not in cited and i not in withdrawn]


def test_old_numbering_is_not_cited_again():
    """`facts A.x`-style citations only remain where the lead rewrites them, and all map."""
    legacy = dict(_LEGACY_ROW.findall(facts_text()))
    stale, unmapped = [], []
    for path in scanned_files():
        relative = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in _OLD_CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            if relative not in PENDING_OLD_CITATIONS:
                stale.append(f"{relative}:{line}: {match.group(0)}")
            old_ids = _OLD_ID.findall(match.group(1)) or [match.group(1)]
            unmapped += [f"{relative}:{line}: {o}" for o in old_ids if o not in legacy]
    assert ([], []) == (stale, unmapped)


def test_paths_to_the_facts_file_resolve():
    """Every mention of the facts file's path names a file that exists."""
    broken = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in _FACTS_PATH.finditer(text):
            written = match.group(0).lstrip("./")
            candidates = (ROOT / written, path.parent / match.group(0))
            if not any(candidate.resolve() == FACTS for candidate in candidates):
                line = text.count("\n", 0, match.start()) + 1
                broken.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert [] == broken


def test_citation_parsing():
    """The citation grammar: single ids, lists and ranges."""
    assert ["N2", "N6", "N7", "N8"] == expand("N2, N6-N8")
    assert ["C8", "C9", "C10"] == expand("C8-C10")
    assert ["N1", "C3"] == expand("N1 and C3")
    assert ["N3-C1"] == expand("N3-C1")
