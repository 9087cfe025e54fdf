"""Options shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from tls_material import TlsMaterial, make_tls_material

from caravan_llm.devcluster.tiny_tokenizer import write_tokenizer

# Properties check behaviour, not speed: on a loaded 2-core CI machine one
# example can take longer than hypothesis's default 200 ms deadline, which
# would fail a correct property as flaky.
settings.register_profile("caravan", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("caravan")
# `make fuzz-long` (--hypothesis-profile=fuzz-long -m fuzz): the fuzz targets
# (tests/fuzz_strategies.py `fuzz_settings`) with 50 times the examples of the
# suite's run, for the recorded longer run (docs/fuzzing.md).
settings.register_profile(
    "fuzz-long",
    parent=settings.get_profile("caravan"),
    max_examples=5_000,
    print_blob=True,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite golden files from the current output instead of comparing",
    )


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def tls_material(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    """PEM files for TLS settings tests (a certificate and its key, and bad ones)."""
    return make_tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny models' tokenizer.json and tokenizer_config.json (ChatML)."""
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tokenizer(out)
    return out
