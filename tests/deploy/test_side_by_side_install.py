"""caravan's wheel installs beside the PyPI projects named like its folders, and both sides work.

`scheduler` (0.8.11, a job scheduler), `devcluster` (1.3.2, Determined AI's)
and `router` (0.1, a Python 2 URL router that cannot import on Python 3) own
those names on PyPI. caravan's distribution is `caravan-llm` and its only
top-level import package is `caravan_llm`, so one venv holds all four: no file
of caravan's is a file of theirs, their code still imports and runs, and so
does caravan's (the CLI, the router and scheduler modules, the demo).

Builds the wheel and installs from PyPI (pip's cache makes reruns quick);
without an index this fails, as CI must.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hcl_documents import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NEIGHBOURS = ["scheduler==0.8.11", "devcluster==1.3.2", "router==0.1"]
DISTRIBUTION = "caravan-llm"

# Each distribution's installed files, relative to site-packages, from its RECORD.
LIST_FILES = """
import importlib.metadata as md, json, sys
print(json.dumps({
    name: sorted(str(f) for f in (md.distribution(name).files or []))
    for name in sys.argv[1:]
}))
"""

# The PyPI `scheduler` package doing its job: a one-off job runs once.
RUN_SCHEDULER = """
import datetime as dt
from scheduler import Scheduler
done = []
schedule = Scheduler()
schedule.once(dt.timedelta(), lambda: done.append(1))
assert schedule.exec_jobs() == 1 and done == [1], done
print("scheduler ok")
"""


@dataclass(frozen=True)
class Venv:
    root: Path

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("CARAVAN_")}
        env.pop("PYTHONPATH", None)
        return subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.root,
            env=env,
        )


def pip(*args: str, timeout: float = 600) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh venv with caravan's wheel (demo extra) and the three neighbours installed."""
    work = tmp_path_factory.mktemp("side-by-side")
    pip("wheel", "--no-deps", "--wheel-dir", str(work / "dist"), str(ROOT))
    (wheel,) = (work / "dist").glob("caravan_llm-*.whl")
    root = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    env = Venv(root)
    installed = env.run(
        env.bin("pip"),
        "install",
        "--quiet",
        "--disable-pip-version-check",
        f"{wheel}[demo]",
        *NEIGHBOURS,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return env


def installed_files(venv: Venv) -> dict[str, list[str]]:
    names = [DISTRIBUTION, *(spec.split("==")[0] for spec in NEIGHBOURS)]
    listed = venv.run(venv.bin("python"), "-c", LIST_FILES, *names)
    assert listed.returncode == 0, listed.stderr
    files: dict[str, list[str]] = json.loads(listed.stdout)
    return files


def test_no_file_of_caravans_is_a_file_of_a_neighbours(venv: Venv) -> None:
    """The four RECORDs share no path, and caravan's files sit under `caravan_llm/` alone."""
    files = installed_files(venv)
    ours = set(files.pop(DISTRIBUTION))

    for name, theirs in files.items():
        assert theirs, f"{name} installed no files"
        assert not ours & set(theirs), name
    top_level = {path.split("/")[0] for path in ours if not path.startswith("..")}
    assert {"caravan_llm", "caravan_llm-0.1.0.dist-info"} == top_level
    scripts = {Path(path).name for path in ours if path.startswith("..")}
    assert {"caravan"} == scripts


def test_the_neighbours_still_import_and_work(venv: Venv) -> None:
    """PyPI's scheduler runs a job; devcluster imports and answers --help; router stays Python 2."""
    scheduler = venv.run(venv.bin("python"), "-c", RUN_SCHEDULER)
    assert (0, "scheduler ok\n") == (scheduler.returncode, scheduler.stdout), scheduler.stderr

    devcluster = venv.run(
        venv.bin("python"), "-c", "import devcluster.config, devcluster.state_machine"
    )
    assert devcluster.returncode == 0, devcluster.stderr
    help_text = venv.run(venv.bin("devcluster"), "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--oneshot" in help_text.stdout

    # router 0.1 is Python 2 source: importing it fails as it does without caravan.
    router = venv.run(venv.bin("python"), "-c", "import router")
    assert router.returncode != 0
    assert "SyntaxError" in router.stderr


def test_caravan_works_beside_them(venv: Venv) -> None:
    """The CLI, the processes' modules and the demo (with caravan's own devcluster) all run."""
    version = venv.run(venv.bin("caravan"), "--version")
    assert (0, "caravan 0.1.0\n") == (version.returncode, version.stdout), version.stderr

    modules = venv.run(
        venv.bin("python"),
        "-c",
        "import caravan_llm.router.wiring.app, caravan_llm.scheduler.app, "
        "caravan_llm.devcluster.cluster, caravan_llm.cli.main",
    )
    assert modules.returncode == 0, modules.stderr

    examples = sorted(str(path) for path in (ROOT / "examples" / "profiles").glob("*.yaml"))
    validated = venv.run(venv.bin("caravan"), "validate", *examples)
    assert validated.returncode == 0, validated.stdout + validated.stderr

    demo = venv.run(venv.bin("caravan"), "demo", "--once", timeout=300)
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-3000:]
