"""Options shared by the whole suite."""

from __future__ import annotations

import pytest
from tls_material import TlsMaterial, make_tls_material


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
