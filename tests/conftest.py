"""Shared fixtures: the bundled model, loaded once per test session."""

from __future__ import annotations

# isort: off
import edgetp.models  # noqa: F401  (before torch: its OpenMP setting, models/__init__.py)

# isort: on
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from gguf_copy import transformers_model
from hypothesis import settings

from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.kernels import CORES_ENV, set_threads
from edgetp.models.source import GGUFSource, ModelSource, open_model
from edgetp.node import children

set_threads()

# The property tests draw the same examples on every run, so a red run is the code's doing, not
# a new draw's, and no example fails for its time on a slow machine. `HYPOTHESIS_PROFILE=explore`
# draws new ones (and more); a failure found so becomes an @example.
settings.register_profile("suite", derandomize=True, deadline=None)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


def pytest_configure(config):
    """One state folder for the whole run, its xdist workers and the nodes they start: what a
    device keeps across clusters (its kernel table) is checked once per run, and nothing is
    written under the home folder.

    With N test processes, each of them and every node it starts gets 1/N of the cores, as N
    nodes of one machine would: BLAS threads beyond the cores spin and slow every process.
    """
    if hasattr(config, "workerinput"):
        return
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:  # the whole suite
        _check_free_disk()
    if "EDGETP_HOME" not in os.environ:
        os.environ["EDGETP_HOME"] = tempfile.mkdtemp(prefix="edgetp-tests-")
        config._edgetp_home = os.environ["EDGETP_HOME"]
    processes = getattr(config.option, "numprocesses", None)
    if CORES_ENV not in os.environ and isinstance(processes, int) and processes > 1:
        os.environ[CORES_ENV] = str(max(1, (os.cpu_count() or 1) // processes))


# Test order: the files that take longest first. The two test processes take files in this
# order (the Makefile turns off xdist's reordering by test count, which put the files of one or
# two long tests last), and a long file taken last leaves one of them working alone at the end.
# The seconds are a real run's, per file (setup, call and teardown of its tests), kept in
# tests/durations.json; the files it does not name yet come after those it names, in their
# folder's order. `make durations` runs the whole suite and writes them anew
# (EDGETP_DURATIONS=write: a run writes what it timed).
TESTS = Path(__file__).parent
DURATIONS = TESTS / "durations.json"
WRITE_DURATIONS = "EDGETP_DURATIONS"


def recorded_durations() -> dict[str, float]:
    """File (relative to tests/) -> seconds, as the last `make durations` measured them."""
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def file_of(item_or_nodeid: pytest.Item | str) -> str:
    """The test file of an item or a report's node id, relative to tests/."""
    if isinstance(item_or_nodeid, str):
        path = Path(item_or_nodeid.split("::", 1)[0])
        return path.name if path.parent.name == TESTS.name else path.as_posix()
    return item_or_nodeid.path.relative_to(TESTS).as_posix()


def pytest_collection_modifyitems(items):
    seconds = recorded_durations()
    items.sort(key=lambda item: -seconds.get(file_of(item), 0.0))  # stable: files stay whole


_timed: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Times every file's tests where the reports arrive: the one test process, or xdist's
    controller (a worker's own reports are also sent there)."""
    if os.environ.get(WRITE_DURATIONS) == "write" and "PYTEST_XDIST_WORKER" not in os.environ:
        file = file_of(report.nodeid)
        _timed[file] = _timed.get(file, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """EDGETP_DURATIONS=write: the files this run timed replace their seconds in
    tests/durations.json; files that are gone leave it."""
    if not _timed or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return  # an interrupted run's times are short of the files' own
    seconds = {f: s for f, s in recorded_durations().items() if (TESTS / f).exists()}
    seconds.update({f: round(t, 1) for f, t in _timed.items()})
    ranked = dict(sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0])))
    DURATIONS.write_text(json.dumps(ranked, indent=1) + "\n")


# What a run holds on disk at its peak (shards of the model in several splits, the test folders
# of the tests running): 3.53 GB, sampled every 3 s over a whole `make test` from a fresh clone,
# which may miss a higher moment: half a GB more, so that a run that starts also ends.
DISK_NEEDED = 4e9


def _check_free_disk() -> None:
    """A disk that fills mid-run fails tests at random and leaves half-written files behind:
    say so before starting instead."""
    temp = tempfile.gettempdir()
    free = shutil.disk_usage(temp).free
    if free < DISK_NEEDED:
        pytest.exit(
            f"the tests need about {DISK_NEEDED / 1e9:.1f} GB free under {temp} (the model's "
            f"shards); {free / 1e9:.1f} GB are free: free some, or set TMPDIR to a larger disk",
            returncode=1,
        )


def pytest_unconfigure(config):
    home = getattr(config, "_edgetp_home", None)
    if home:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> None:
    """A test process starts kernel checks and local workers by the dozen, as a local cluster's
    master does: it forks them from a server that imported the node's code once."""
    children.start_server()


@pytest.fixture(scope="session")
def shared_state() -> Path:
    """A state folder for every test that only reads shards: a plan is split once per run, not
    once per test. Tests that damage shards, or count what ships, keep folders of their own."""
    return Path(os.environ["EDGETP_HOME"]) / "shared-state"


@pytest.fixture(scope="session")
def smollm2() -> ModelSource:
    return open_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer()


@pytest.fixture(scope="session")
def reference_model(smollm2, tmp_path_factory):
    """The transformers implementation of the same GGUF's weights, fp32: the independent
    reference (loaded from a copy without the vocabulary, which the model does not read)."""
    assert isinstance(smollm2, GGUFSource)
    return transformers_model(smollm2.path, tmp_path_factory.mktemp("smollm2-reference"))
