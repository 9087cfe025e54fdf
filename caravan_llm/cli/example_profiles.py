"""Where the example profiles are: in a checkout, `examples/profiles/`; installed, package data.

The wheel carries `examples/profiles/*.yaml` as `caravan_llm/cli/example_profiles_data/`
(pyproject's package-dir mapping), so `caravan demo` finds the same files
from a clone, an editable install and a built wheel.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
INSTALLED = _PACKAGE / "example_profiles_data"
CHECKOUT = _PACKAGE.parents[1] / "examples" / "profiles"


def example_profiles_dir() -> Path:
    """The folder of example profiles: the checkout's when there is one, else the installed copy."""
    if CHECKOUT.is_dir():
        return CHECKOUT
    if INSTALLED.is_dir():
        return INSTALLED
    raise FileNotFoundError(
        f"no example profiles at {CHECKOUT} or {INSTALLED}: "
        "reinstall caravan from a wheel or a clone"
    )
