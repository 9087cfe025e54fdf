"""Fuzzing profile documents (YAML, JSON): the codec, the scheduler's checks, `caravan validate`."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_strategies import (
    byte_damage,
    fuzz_settings,
    hostile_json,
    json_objects,
    outcome,
    texts,
)
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st

from caravan_llm.cli.main import main
from caravan_llm.common.contract import ProfileDocumentError, decode_profile_document
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.model_service import SubmissionRejectedError, validate_submission
from caravan_llm.scheduler.profiles import ProfileError, parse_profile_text

pytestmark = pytest.mark.fuzz

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "profiles").glob("*.yaml"))
EXAMPLE_TEXTS = [path.read_text(encoding="utf-8") for path in EXAMPLES]
# YAML forms whose constructors or resolvers refuse, or that build odd values.
YAML_SCALARS = st.sampled_from(
    [
        "2024-02-30",
        "2024-01-01 25:00:00",
        "!!float x",
        "!!int 0x",
        "!!binary xx=",
        "!!timestamp x",
        "!!bool x",
        "!!int ''",
        "!!float ''",
        "!!python/object:os.system x",
        "&a [*a]",
        "*undefined",
        "<<: 5",
        "? [1]\n: 2",
        "1" * 5000,
        "1e99999",
        ".nan",
        "-.inf",
        "0o17",
        "0b101",
        "1_000",
        "~",
        "yes",
        "'",
        '"\\ud800"',
        "\t",
        "{a: 1, a: 2}",
        "[" * 2000,
        "- " * 500,
        "\ufeff",
    ]
)


@st.composite
def profile_documents(draw: st.DrawFn) -> bytes:
    """An example profile with lines replaced by odd YAML, or hostile JSON, perhaps damaged."""
    if draw(st.integers(0, 3)) == 0:
        return draw(hostile_json(json_objects))
    lines = draw(st.sampled_from(EXAMPLE_TEXTS)).splitlines()
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(lines)))
        odd = draw(YAML_SCALARS | texts)
        if at < len(lines) and ":" in lines[at] and draw(st.booleans()):
            key = lines[at].split(":", 1)[0]
            lines[at] = f"{key}: {odd}"
        else:
            lines.insert(at, odd)
    return draw(byte_damage("\n".join(lines).encode("utf-8", "surrogatepass")))


@fuzz_settings()
@given(profile_documents() | st.binary(max_size=200))
@example(b"name: m\nmodel: 2024-02-30\n")
@example(b"a: !!float x\n")
@example(b"a: !!int 0x\n")
@example(b"a: " + b"1" * 5000 + b"\n")
@example(b"[" * 100_000)
@example(b"\x00")
@example(b"a: !!timestamp x\n")
@example(b"a: !!bool x\n")
@example(b"a: !!int ''\n")
def test_any_bytes_are_a_mapping_or_the_profile_document_error(raw: bytes) -> None:
    """The profile codec returns a mapping or raises ProfileDocumentError naming the source."""
    document, refused = outcome(
        lambda: decode_profile_document(raw, source="fuzz.yaml"), ProfileDocumentError
    )
    if refused is not None:
        assert "fuzz.yaml" == refused.source
        assert refused.problem
        assert "\n" not in refused.problem
    else:
        assert isinstance(document, dict)


@fuzz_settings()
@given(profile_documents())
@example(b"name: m\nmodel: 2024-02-30\n")
def test_the_schedulers_validation_refuses_with_problems_never_raises(raw: bytes) -> None:
    """Parsing and the whole submission check: a profile, or their typed errors with problems."""
    _, invalid = outcome(lambda: parse_profile_text(raw, "fuzz.yaml"), ProfileError)
    assert invalid is None or invalid.problems
    _, rejected = outcome(
        lambda: validate_submission([("fuzz.yaml", raw)], ClusterConfig()), SubmissionRejectedError
    )
    assert rejected is None or rejected.problems


@fuzz_settings(0.3, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=profile_documents() | st.binary(max_size=200))
@example(raw=b"\xff\xfe name: x")
@example(raw=b"name: x\nmodel: 2024-02-30\n")
@example(raw=b"\x00")
@example(raw=b'{"\\r": null}')
def test_caravan_validate_answers_in_lines_never_with_a_traceback(
    raw: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`caravan validate` on any file: exit 0 or 1 and its problems, one line each, no traceback."""
    path = tmp_path / "profile.yaml"
    path.write_bytes(raw)

    code = main(["validate", str(path)])

    out, err = capsys.readouterr()
    assert code in {0, 1}
    assert "Traceback" not in out + err
    if code == 1:
        assert err.strip()
        assert all(line.startswith(str(path)) for line in err.strip().splitlines())
