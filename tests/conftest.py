"""Shared fixtures: the bundled model, loaded once per test session."""

from __future__ import annotations

# isort: off
import edgetp.models  # noqa: F401  (before torch: its OpenMP setting, models/__init__.py)

# isort: on
import json
import os
import shutil
import tempfile
import time
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


# Test order and `make test-fast` come from a real run's seconds, kept in tests/durations.json:
# per test (setup, call and teardown), as pytest-split keeps them, and per shared fixture (the
# setup of a module or session fixture: the model loaded, a synthetic model written, a server
# started). `make durations` runs the whole suite and writes them anew (EDGETP_DURATIONS=write:
# a run writes what it timed).
# - The files that take longest go first. The test processes take files in this order (the
#   Makefile turns off xdist's reordering by test count, which put the files of one or two long
#   tests last), and a long file taken last leaves one of them working alone at the end. Files
#   it does not name yet come after those it names, in their folder's order.
# - A test that took `FAST_TEST_S` or more, or needs a shared fixture that did, is marked slow,
#   as are those that start a cluster or a server, run a model end to end, load a reference or
#   cross-build (marked in their files): `make test-fast` leaves them out. A test not timed yet
#   runs in both.
TESTS = Path(__file__).parent
DURATIONS = TESTS / "durations.json"
WRITE_DURATIONS = "EDGETP_DURATIONS"
FAST_TEST_S = 0.5
SHARED_SCOPES = ("module", "package", "session")


def recorded_durations() -> dict[str, dict[str, float]]:
    """{"tests": test id -> seconds, "fixtures": fixture key -> seconds}, as the last `make
    durations` measured them (ids and keys name files relative to tests/)."""
    try:
        recorded = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        recorded = {}
    return {"tests": recorded.get("tests", {}), "fixtures": recorded.get("fixtures", {})}


def short_id(nodeid: str) -> str:
    """A test's node id with its file relative to tests/, wherever pytest was started."""
    path, _, rest = nodeid.partition("::")
    file = Path(path)
    name = file.name if file.parent.name == TESTS.name else file.as_posix()
    return f"{name}::{rest}"


def fixture_key(where: str, name: str) -> str:
    """A fixture by the file that defines it (`where`: a node id's file part, or a folder for
    a conftest's fixture) and its name."""
    return f"{Path(where).name if where.endswith('.py') else 'conftest'}::{name}"


def pytest_collection_modifyitems(items):
    recorded = recorded_durations()
    seconds, fixtures = recorded["tests"], recorded["fixtures"]
    per_file: dict[str, float] = {}
    for test, s in seconds.items():
        file = test.split("::", 1)[0]
        per_file[file] = per_file.get(file, 0.0) + s
    for item in items:
        file = item.nodeid.partition("::")[0]
        shared = [
            fixtures.get(fixture_key(file, name), fixtures.get(fixture_key("", name), 0.0))
            for name in item.fixturenames
        ]
        if max([seconds.get(short_id(item.nodeid), 0.0), *shared]) >= FAST_TEST_S:
            item.add_marker(pytest.mark.slow)
    # stable: files stay whole, their tests in their order
    items.sort(key=lambda item: -per_file.get(short_id(item.nodeid).split("::", 1)[0], 0.0))


_timed: dict[str, float] = {}
_fixtures_timed: dict[str, float] = {}
_fixtures_set_up: list[tuple[str, float]] = []  # in a test process, until its test's report


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if os.environ.get(WRITE_DURATIONS) != "write" or fixturedef.scope not in SHARED_SCOPES:
        return (yield)
    started = time.perf_counter()
    try:
        return (yield)
    finally:
        key = fixture_key(fixturedef.baseid, fixturedef.argname)
        _fixtures_set_up.append((key, time.perf_counter() - started))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The shared fixtures a test's setup made travel with its report (to xdist's controller)."""
    report = yield
    if call.when == "setup" and _fixtures_set_up:
        report.user_properties += [("fixture_s", key, s) for key, s in _fixtures_set_up]
        _fixtures_set_up.clear()
    return report


def pytest_runtest_logreport(report):
    """Times every test where the reports arrive: the one test process, or xdist's controller
    (a worker's own reports are also sent there)."""
    if os.environ.get(WRITE_DURATIONS) == "write" and "PYTEST_XDIST_WORKER" not in os.environ:
        test = short_id(report.nodeid)
        _timed[test] = _timed.get(test, 0.0) + report.duration
        for kind, *rest in report.user_properties:
            if kind == "fixture_s":
                key, s = rest
                _fixtures_timed[key] = max(_fixtures_timed.get(key, 0.0), s)


def pytest_sessionfinish(session, exitstatus):
    """EDGETP_DURATIONS=write: the tests and fixtures this run timed replace their seconds in
    tests/durations.json; those whose file is gone leave it."""
    if not _timed or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return  # an interrupted run's times are short of the tests' own
    recorded = recorded_durations()
    kept = {}
    for kind, timed in (("tests", _timed), ("fixtures", _fixtures_timed)):
        seconds = {
            k: s
            for k, s in recorded[kind].items()
            if k.startswith("conftest::") or (TESTS / k.split("::", 1)[0]).exists()
        }
        for k, s in timed.items():
            # A shared fixture keeps the most any run saw: its setup may hold a first import
            # (transformers: 5-8 s) that, in a whole run, another file's tests paid for.
            keep = max(s, seconds.get(k, 0.0)) if kind == "fixtures" else s
            seconds[k] = round(keep, 2)
        kept[kind] = dict(sorted(seconds.items()))
    DURATIONS.write_text(json.dumps(kept, indent=1) + "\n")


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
