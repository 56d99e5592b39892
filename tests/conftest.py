"""Shared fixtures: the bundled model, loaded once per test session."""

from __future__ import annotations

# isort: off
import edgetp.models  # noqa: F401  (before torch: its OpenMP setting, models/__init__.py)

# isort: on
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


# The files that take longest (18-146 s each in a whole run at 2 x 2 processes on a Zen 3 core
# pair, 2026-11-27), longest first: the two test processes take files in this order (the
# Makefile turns off xdist's reordering by test count, which put the files of one or two long
# tests last), and a long file taken last leaves one of them working alone at the end (62 s of
# a 13-minute run).
LONGEST_FIRST = (
    "test_cluster.py",
    "test_chat_app.py",
    "test_grammar.py",
    "test_bridge_clients.py",
    "test_window.py",
    "test_speculate.py",
    "test_emulate.py",
    "test_lan_fronts.py",
    "test_gemma3.py",
    "test_soak.py",
    "test_cli.py",
    "test_bridge_fuzz.py",
    "test_reference.py",
    "test_embeddings.py",
    "test_bridge_batcher.py",
    "test_membership.py",
    "test_kernels.py",
    "test_bridge_server.py",
    "test_families.py",
    "test_tokenizer.py",
    "test_synth.py",
    "test_sampling.py",
    "test_wire.py",
    "test_hf_source.py",
    "test_discovery.py",
)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


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
