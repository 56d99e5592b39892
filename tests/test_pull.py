"""Models by name (`edgetp pull`, `models`, `rm`, `--model OWNER/REPO[:QUANT]`) against a hub.

The hub is the seam: a threaded HTTP server on 127.0.0.1 that answers what huggingface_hub asks
of huggingface.co (a model's info with its files' checksums, HEAD and ranged GET of
`/{repo}/resolve/{commit}/{file}`), over files the tests make. No xet headers: plain HTTP only.
Everything on edgetp's side is real: the `edgetp` command's `main`, with huggingface_hub's cache
in the test's folder and its endpoint at the server, and (to run a model, and to see what a person
sees when the hub is down) the command in a process of its own, with HF_HOME and HF_ENDPOINT.
"""

from __future__ import annotations

import errno
import filecmp
import hashlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from edgetp.models.bundled import model_path
from edgetp.models.errors import ModelError
from edgetp.models.hub import Name, cached, pull, quants, resolve_model, select
from edgetp.tui.cli import main

EDGETP = Path(sys.executable).parent / "edgetp"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS = (".gguf", ".safetensors", ".bin")


def tiny_gguf(architecture: str, salt: str) -> bytes:
    """A GGUF header with no tensors: its architecture key, and bytes of its own."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    keys = string("general.architecture") + struct.pack("<I", 8) + string(architecture)
    keys += string("general.name") + struct.pack("<I", 8) + string(salt)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + keys


@dataclass
class Repo:
    files: dict[str, bytes | Path]
    corrupt: set[str] = field(default_factory=set)  # served with other bytes than its checksum's
    cut_once: set[str] = field(default_factory=set)  # its first GET breaks off near its end

    def data(self, name: str) -> bytes:
        content = self.files[name]
        return content.read_bytes() if isinstance(content, Path) else content


@dataclass
class Hub:
    url: str
    repos: dict[str, Repo]
    requests: list[tuple[str, str, str | None]]  # method, path, Range


def _checksums(repo: Repo) -> dict[str, tuple[int, str, str]]:
    """Each file's size, git blob id and sha256 (the hub's etag: an LFS file's sha256, else its
    git blob id, the only one computed)."""
    out = {}
    for name in repo.files:
        data = repo.data(name)
        if name.endswith(LFS):
            out[name] = (len(data), "", hashlib.sha256(data).hexdigest())
        else:
            out[name] = (len(data), hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), "")
    return out


def _handler(hub: Hub, sums: dict[str, dict[str, tuple[int, str, str]]]) -> type:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _missing(self, code: str) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = self.path.split("?")[0]
            hub.requests.append((self.command, path, self.headers.get("Range")))
            info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
            if info:
                return self._info(info[1])
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
            if resolve is None or resolve[1] not in hub.repos:
                return self._missing("RepoNotFound")
            repo, name = hub.repos[resolve[1]], resolve[2]
            if name not in repo.files:
                return self._missing("EntryNotFound")
            size, git, sha = sums[resolve[1]][name]
            data = repo.data(name) if body else b""
            if name in repo.corrupt:
                data = bytes(b ^ 0xFF for b in data)
            start = 0
            if body and (wanted := self.headers.get("Range")):
                start = int(re.fullmatch(r"bytes=(\d+)-", wanted)[1])  # type: ignore[index]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("ETag", f'"{sha if name.endswith(LFS) else git}"')
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(size - start))
            self.end_headers()
            if not body:
                return
            if name in repo.cut_once and start == 0:
                repo.cut_once.discard(name)
                self.wfile.write(data[: size * 7 // 8])  # past huggingface_hub's first chunk
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def _info(self, repo_id: str) -> None:
            if repo_id not in hub.repos:
                return self._missing("RepoNotFound")
            siblings = []
            for name, (size, git, sha) in sums[repo_id].items():
                sibling: dict[str, object] = {"rfilename": name, "size": size, "blobId": git or sha}
                if name.endswith(LFS):
                    sibling["lfs"] = {"sha256": sha, "size": size, "pointerSize": 134}
                siblings.append(sibling)
            body = json.dumps({"id": repo_id, "sha": COMMIT, "siblings": siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


SPLIT = [f"Q4_K_M/Big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
WEIGHTS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture(scope="module")
def hub() -> Iterator[Hub]:
    index = {"metadata": {}, "weight_map": {"a": WEIGHTS[0], "b": WEIGHTS[1]}}
    repos = {
        "test/Tiny-GGUF": Repo(
            {
                "Tiny-Q4_K_M.gguf": tiny_gguf("llama", "q4km"),
                "Tiny-Q4_K.gguf": tiny_gguf("llama", "q4k"),
                "Tiny-Q8_0.gguf": tiny_gguf("llama", "q80"),
                "mmproj-Tiny-F16.gguf": tiny_gguf("clip", "mmproj"),
                "README.md": b"# tiny\n",
            }
        ),
        "test/Split-GGUF": Repo(
            {
                **{f: tiny_gguf("qwen3", f) + os.urandom(50_000) for f in SPLIT[::2]},
                SPLIT[1]: tiny_gguf("qwen3", "2") + os.urandom(12 << 20),  # > a 10 MiB chunk
                "Big-Q8_0.gguf": tiny_gguf("qwen3", "q8"),
            },
            cut_once={SPLIT[1]},
        ),  # fmt: skip
        "test/Tiny-HF": Repo(
            {
                "config.json": json.dumps(
                    {"model_type": "llama", "torch_dtype": "bfloat16"}
                ).encode(),
                "tokenizer.json": b"{}",
                "tokenizer_config.json": b"{}",
                "model.safetensors.index.json": json.dumps(index).encode(),
                WEIGHTS[0]: os.urandom(3000),
                WEIGHTS[1]: os.urandom(2000),
                "pytorch_model.bin": os.urandom(100),
                "README.md": b"# tiny\n",
                "original/consolidated.pth": os.urandom(100),
            }
        ),
        "test/Corrupt-GGUF": Repo(
            {"Bad-Q4_K_M.gguf": tiny_gguf("llama", "bad") + os.urandom(10_000)},
            corrupt={"Bad-Q4_K_M.gguf"},
        ),
        "test/SmolLM2-GGUF": Repo({"SmolLM2-135M-Instruct.Q4_1.gguf": model_path()}),
    }
    sums = {name: _checksums(repo) for name, repo in repos.items()}
    state = Hub("", repos, [])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state, sums))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def at_hub(hub, tmp_path, monkeypatch):
    """huggingface_hub pointed at the fake hub, its cache in the test's folder: what HF_ENDPOINT
    and HF_HOME do at its import, done to the module this process imported already."""
    from huggingface_hub import constants
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    disable_progress_bars()  # stderr holds only what edgetp says
    yield hub
    enable_progress_bars()


def edgetp(capsys, *args: str) -> tuple[int, str, str]:
    """The `edgetp` command in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("edgetp: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def edgetp_process(home: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(EDGETP)] if EDGETP.exists() else [sys.executable, "-m", "edgetp.tui.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(home), "HF_ENDPOINT": url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=env)


def cache_files(home: Path) -> list[str]:
    return sorted(p.relative_to(home).as_posix() for p in home.rglob("*") if p.is_file())


def models_listed(capsys) -> list[list[str]]:
    code, out, err = edgetp(capsys, "models")
    assert code == 0, err
    return [line.split() for line in out.splitlines()[1:]]


# -- which files a name means: no hub needed ---------------------------------------------------


def test_a_quant_is_a_tag_of_its_own_in_the_file_name_and_q4_k_m_is_the_default():
    files = ["a/M-Q4_K_M.gguf", "M-Q4_K.gguf", "M-IQ4_XS.gguf", "M-q8_0.gguf", "mmproj-F16.gguf"]
    assert select(files, Name("o/r", "q4_k")).main == "M-Q4_K.gguf"  # not Q4_K_M
    assert select(files, Name("o/r", "Q8_0")).files == ("M-q8_0.gguf",)
    assert select(files, Name("o/r")).main == "a/M-Q4_K_M.gguf"
    assert select(["B-Q8_0.gguf", "A-F16.gguf"], Name("o/r")).main == "A-F16.gguf"  # first
    assert quants(files) == ["IQ4_XS", "Q4_K", "Q4_K_M", "Q8_0"]  # the projector is no model
    with pytest.raises(ModelError, match="no Q4_XS GGUF file; its quants: IQ4_XS, Q4_K"):
        select(files, Name("o/r", "Q4_XS"))
    split = [f"M-Q2_K-0000{i}-of-00002.gguf" for i in (2, 1)] + ["M-Q3_K.gguf"]
    assert select(split, Name("o/r", "Q2_K")).files == tuple(sorted(split[:2]))


# -- pull, models, rm ------------------------------------------------------------------------


def test_pull_a_gguf_quant_list_it_and_remove_it(at_hub, tmp_path, capsys):
    code, out, err = edgetp(capsys, "pull", "test/Tiny-GGUF:q8_0")  # case-insensitive
    assert code == 0 and Path(out.strip()).name == "Tiny-Q8_0.gguf", err
    # the bare name means the hub's Q4_K_M, though the cache holds another quant
    assert Path(resolve_model("test/Tiny-GGUF") or "").name == "Tiny-Q4_K_M.gguf"
    assert resolve_model("test/Tiny-GGUF:Q8_0") == out.strip()  # from the cache
    code, out, err = edgetp(capsys, "pull", "test/Tiny-GGUF")
    assert code == 0, err
    path = Path(out.strip())
    assert path.name == "Tiny-Q4_K_M.gguf"
    assert path.read_bytes() == at_hub.repos["test/Tiny-GGUF"].data("Tiny-Q4_K_M.gguf")
    assert not any("mmproj" in f or "README" in f for f in cache_files(tmp_path))
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as offline:  # HF_HUB_OFFLINE: from the cache only
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        offline.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
        code, out, err = edgetp(capsys, "pull", "test/Tiny-GGUF:Q8_0")
        assert code == 0 and Path(out.strip()).name == "Tiny-Q8_0.gguf", err

    code, out, _ = edgetp(capsys, "models")
    assert out.split()[:5] == ["NAME", "SIZE", "FORMAT", "FAMILY", "QUANT"]
    rows = models_listed(capsys)
    assert [r[0] for r in rows] == ["test/Tiny-GGUF:Q4_K_M", "test/Tiny-GGUF:Q8_0"]
    assert all(r[3:] == ["gguf", "llama", r[0].split(":")[1]] for r in rows), rows

    code, _, err = edgetp(capsys, "rm", "test/Tiny-GGUF:Q8_0")
    assert code == 0 and "removed test/Tiny-GGUF:Q8_0" in err, err
    assert [r[0] for r in models_listed(capsys)] == ["test/Tiny-GGUF:Q4_K_M"]
    assert path.is_file()  # the other quant is untouched
    assert edgetp(capsys, "rm", "test/Tiny-GGUF")[0] == 0
    assert "none in the cache" in edgetp(capsys, "models")[2]
    one_line_error(*edgetp(capsys, "rm", "test/Tiny-GGUF")[::2], "not in the cache")


def test_pull_a_split_gguf_whole_resuming_a_broken_download(at_hub, capsys):
    code, out, err = edgetp(capsys, "pull", "test/Split-GGUF:Q4_K_M")
    assert code == 0, err
    first = Path(out.strip())
    assert first.name == "Big-Q4_K_M-00001-of-00003.gguf"
    repo = at_hub.repos["test/Split-GGUF"]
    for name in SPLIT:
        assert (first.parent / Path(name).name).read_bytes() == repo.data(name)
    # the cut-off part was fetched again from where it broke off, not from its start
    resumed = [r for m, p, r in at_hub.requests if m == "GET" and p.endswith(SPLIT[1])]
    assert resumed[0] is None and resumed[1] == "bytes=10485760-", resumed
    (row,) = models_listed(capsys)
    assert row[0] == "test/Split-GGUF:Q4_K_M" and row[3:] == ["gguf", "(3", "parts)", "qwen3",
                                                              "Q4_K_M"], row  # fmt: skip


def test_pull_a_safetensors_repository(at_hub, capsys):
    code, out, err = edgetp(capsys, "pull", "test/Tiny-HF")
    assert code == 0, err
    folder = Path(out.strip())
    wanted = ["config.json", "model.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json", *WEIGHTS]  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == sorted(wanted)
    for name in wanted:
        assert (folder / name).read_bytes() == at_hub.repos["test/Tiny-HF"].data(name)
    assert cached(Name("test/Tiny-HF")) == folder
    (row,) = models_listed(capsys)
    assert row[0] == "test/Tiny-HF" and row[3:] == ["safetensors", "llama", "BF16"], row
    one_line_error(*edgetp(capsys, "pull", "test/Tiny-HF:Q4_K_M")[::2], "no GGUF files")


# -- errors, one line each -------------------------------------------------------------------


def test_hub_errors_are_one_line_that_says_what_to_do(at_hub, tmp_path, capsys, monkeypatch):
    one_line_error(
        *edgetp(capsys, "pull", "test/No-Such-Model")[::2], "no model test/No-Such-Model"
    )
    one_line_error(
        *edgetp(capsys, "pull", "test/Tiny-GGUF:Q5_K_S")[::2],
        "no Q5_K_S GGUF file; its quants: Q4_K, Q4_K_M, Q8_0",
    )
    one_line_error(*edgetp(capsys, "pull", "no-slash")[::2], "OWNER/REPO")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    one_line_error(
        *edgetp(capsys, "pull", "test/Tiny-GGUF")[::2], "not in the cache", "HF_HUB_OFFLINE"
    )
    # the whole command, as a person runs it, with the hub down
    down = f"http://127.0.0.1:{_closed_port()}"
    result = edgetp_process(tmp_path, down, "run", "--model", "test/Tiny-GGUF:Q8_0", "hi")
    assert result.returncode == 1 and result.stdout == "", result
    one_line_error(
        1, result.stderr, f"the hub at {down} cannot be reached", "HF_ENDPOINT", "local path"
    )


def test_bytes_that_do_not_match_the_hubs_sha256_are_refused_and_not_kept(at_hub, tmp_path, capsys):
    code, _, err = edgetp(capsys, "pull", "test/Corrupt-GGUF")
    one_line_error(code, err, "Bad-Q4_K_M.gguf", "do not match the hub's sha256")
    assert not [f for f in cache_files(tmp_path) if "/blobs/" in f or "/snapshots/" in f]
    assert "none in the cache" in edgetp(capsys, "models")[2]


def test_a_full_disk_leaves_nothing_that_looks_complete(at_hub, tmp_path, monkeypatch):
    """huggingface_hub's download made to run out of disk half-way."""
    from huggingface_hub import file_download

    def full(url, temp_file, **kwargs):
        temp_file.write(b"GGUF half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_download, "http_get", full)
    with pytest.raises(ModelError, match="filled up while pulling test/Tiny-GGUF:Q8_0"):
        pull(Name("test/Tiny-GGUF", "Q8_0"))
    assert not [f for f in cache_files(tmp_path) if "/blobs/" in f or "/snapshots/" in f]
    assert cached(Name("test/Tiny-GGUF", "Q8_0")) is None


# -- a name wherever a model path is ---------------------------------------------------------


def test_run_by_name_opens_the_files_bytes_from_the_cache_with_the_hub_gone(
    at_hub, tmp_path, capsys
):
    """Pulled once, the name is the file's very bytes (so it answers as the file by its path
    does); then `run`, one real run, finds it in the cache with the hub gone."""
    code, out, err = edgetp(capsys, "pull", "test/SmolLM2-GGUF:Q4_1")
    assert code == 0, err
    assert filecmp.cmp(out.strip(), model_path(), shallow=False)
    down = f"http://127.0.0.1:{_closed_port()}"
    args = ("run", "--raw", "--max-tokens", "4", "--model", "test/SmolLM2-GGUF:q4_1", "Paris is")
    by_name = edgetp_process(tmp_path, down, *args)
    assert by_name.returncode == 0 and by_name.stdout.strip(), by_name.stderr
