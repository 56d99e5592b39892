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
import logging
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

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf_copy import transformers_tokenizer
from hypothesis import example, given
from hypothesis import strategies as st
from test_hf_source import write_hf_folder

from edgetp.master.bench.greedy import time_greedy
from edgetp.master.cluster.local import local_engine, local_session
from edgetp.master.cluster.plan import head_rows, plan_slices
from edgetp.master.emulate import host
from edgetp.master.emulate.devices import emulated
from edgetp.master.emulate.spec import DeviceSpec
from edgetp.memory.budget import format_size
from edgetp.memory.shards import ShardStore
from edgetp.memory.splitter import split_model, split_node
from edgetp.models.bundled import model_path
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.errors import ModelError
from edgetp.models.families import family_of
from edgetp.models.gguf_file import DEFAULT_ALIGNMENT, GGUFFile, _Cursor
from edgetp.models.hub import Name, cached, mirror, pull, quants, resolve_model, select
from edgetp.models.layers import slice_parts
from edgetp.models.ranges import RemoteFile, join, merge
from edgetp.models.source import GGUFSource, open_model, open_remote
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
    no_ranges: bool = False  # a server that answers a Range with the whole file
    etags: dict[str, str] = field(default_factory=dict)  # a file's ETag, if not its checksum's

    def data(self, name: str) -> bytes:
        content = self.files[name]
        if isinstance(content, Path):  # read once: a ranged request reads a few bytes of it
            content = self.files[name] = content.read_bytes()
        return content


@dataclass
class Hub:
    url: str
    repos: dict[str, Repo]
    requests: list[tuple[str, str, str | None]]  # method, path, Range
    served: dict[str, int] = field(default_factory=dict)  # a file's bytes sent, by its path
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, path: str, n: int) -> None:
        with self.lock:
            self.served[path] = self.served.get(path, 0) + n


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


class _Checksums(dict):
    """Each repository's `_checksums`, taken when first asked for (a whole model's sha256 is
    seconds: the tests that ask for one repository pay for that one only)."""

    def __init__(self, repos: dict[str, Repo]) -> None:
        super().__init__()
        self.repos = repos
        self.lock = threading.Lock()

    def __missing__(self, name: str) -> dict[str, tuple[int, str, str]]:
        with self.lock:
            if name not in self:
                self[name] = _checksums(self.repos[name])
            return self[name]


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
            wanted = self.headers.get("Range") if body and not repo.no_ranges else None
            if name in repo.etags:  # another version of the file now
                sha = git = repo.etags[name]
            runs = _ranges(wanted, size) if wanted else []
            if len(runs) > 1:  # several ranges: one multipart/byteranges answer, as RFC 9110
                return self._multipart(path, data, runs, size, sha if name.endswith(LFS) else git)
            start = runs[0][0] if runs else 0
            end = runs[0][1] if runs else size
            if runs:
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("ETag", f'"{sha if name.endswith(LFS) else git}"')
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if not body:
                return
            if name in repo.cut_once and start == 0:
                repo.cut_once.discard(name)
                self.wfile.write(data[: size * 7 // 8])  # past huggingface_hub's first chunk
                self.close_connection = True
                return
            hub.count(path, end - start)
            self.wfile.write(data[start:end])

        def _multipart(
            self, path: str, data: bytes, runs: list[tuple[int, int]], size: int, etag: str
        ) -> None:
            boundary = "3d6b6a416f9b5"
            pieces = []
            for a, b in runs:
                pieces += [(f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n"
                            f"Content-Range: bytes {a}-{b - 1}/{size}\r\n\r\n").encode(),
                           data[a:b]]  # fmt: skip
                hub.count(path, b - a)
            body = b"".join(pieces) + f"\r\n--{boundary}--\r\n".encode()
            self.send_response(206)
            self.send_header("Content-Type", f"multipart/byteranges; boundary={boundary}")
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

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


def _ranges(header: str, size: int) -> list[tuple[int, int]]:
    """A Range header's runs, [start, end): `bytes=a-b,c-d` or `bytes=a-`."""
    runs = []
    for spec in header.removeprefix("bytes=").split(","):
        a, b = spec.strip().split("-")
        runs.append((int(a), int(b) + 1 if b else size))
    return runs


def split_gguf(path: Path, stem: str, count: int) -> dict[str, bytes]:
    """The GGUF file at `path` as llama.cpp's gguf-split writes it in `count` files: the first
    with every key, each with the split's keys and its run of the tensors."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    def key(name: str, kind: int, fmt: str, value: int) -> bytes:
        return string(name) + struct.pack("<I", kind) + struct.pack(fmt, value)

    whole = GGUFFile(path)
    data = path.read_bytes()
    (version,) = struct.unpack_from("<I", data, 4)
    (n_keys,) = struct.unpack_from("<Q", data, 16)
    cursor = _Cursor(data)  # type: ignore[arg-type]
    cursor.pos = 24
    for _ in range(n_keys):
        cursor.string()
        cursor.value(cursor.scalar("<I"))
    keys = data[24 : cursor.pos]
    assert whole.metadata.get("general.alignment", DEFAULT_ALIGNMENT) == DEFAULT_ALIGNMENT
    infos = [whole.info(n) for n in whole.tensor_names()]
    runs = np.array_split(np.arange(len(infos)), count)
    files = {}
    for no, run in enumerate(runs):
        table, body = b"", b""
        for t in (infos[i] for i in run):
            body += b"\0" * (-len(body) % DEFAULT_ALIGNMENT)
            dims = tuple(reversed(t.shape))
            table += string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                                  int(t.tensor_type), len(body))  # fmt: skip
            body += data[t.data_offset : t.data_offset + t.n_bytes]
        split_keys = (key("split.no", 2, "<H", no) + key("split.count", 2, "<H", count)
                      + key("split.tensors.count", 5, "<i", len(infos)))  # fmt: skip
        own = (keys if no == 0 else b"") + split_keys
        head = b"GGUF" + struct.pack("<IQQ", version, len(run), (n_keys if no == 0 else 0) + 3)
        head += own + table
        head += b"\0" * (-len(head) % DEFAULT_ALIGNMENT)
        files[f"{stem}-{no + 1:05d}-of-{count:05d}.gguf"] = head + body
    return files


SPLIT = [f"Q4_K_M/Big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
WEIGHTS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory) -> Path:
    """SmolLM2 as an HF folder (its weights dequantized to float32, in two safetensors files,
    with transformers' tokenizer of its GGUF file)."""
    folder = tmp_path_factory.mktemp("smollm2-hf")
    write_hf_folder(open_model(DEFAULT_MODEL), folder, 2)
    transformers_tokenizer(model_path()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hub(smollm2_hf) -> Iterator[Hub]:
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
        "test/Whole-GGUF": Repo(
            {"Whole-Q4_K_M.gguf": tiny_gguf("llama", "whole")}, no_ranges=True
        ),  # fmt: skip
        "test/SmolSplit-GGUF": Repo(split_gguf(model_path(), "SmolLM2-135M-Q4_1", 3)),
        "test/SmolLM2-HF": Repo({p.name: p for p in smollm2_hf.iterdir() if p.is_file()}),
        "test/Changing-GGUF": Repo({"Changing-Q4_K_M.gguf": tiny_gguf("llama", "v1")}),
    }
    sums = _Checksums(repos)
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


RUNS = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)).map(lambda r: (r[0], sum(r))))


@given(RUNS, RUNS)
@example([(5, 10)], [(0, 5)])  # touching the next one
@example([(0, 3), (6, 9)], [(3, 6), (12, 12)])  # bridging two; an empty one
@example([(0, 20)], [(5, 6), (19, 25)])  # nested; overlapping
def test_a_fetch_s_runs_join_those_present_as_merging_them_all_again_does(present, new):
    """`join` (a mirror's runs present, after each fetch) equals the plain merge of both lists,
    runs that touch, overlap, nest or are empty included."""
    present = merge(present)
    assert join(present, new) == merge(present + new)


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


def test_models_lists_the_mirrors_read_by_byte_ranges_and_rm_removes_them(
    at_hub, tmp_path, capsys, monkeypatch
):
    """A name read by byte ranges leaves a sparse mirror in STATE_DIR/remote (only the bytes
    read so far): `edgetp models` lists it beside the cache's models, with what it holds of the
    file, and `edgetp rm` removes it, its record too; other mirrors stay."""
    monkeypatch.setenv("EDGETP_HOME", str(tmp_path / "home"))
    remote = tmp_path / "home" / "remote"
    single = Path(resolve_model("test/SmolLM2-GGUF:Q4_1", remote) or "")
    split = Path(resolve_model("test/SmolSplit-GGUF:Q4_1", remote) or "")
    assert single.parent == remote and split.parent.parent == remote
    code, out, err = edgetp(capsys, "models")
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    size = model_path().stat().st_size
    held = sum(b - a for a, b in json.loads((remote / f"{single.name}.ranges.json").read_text())
               ["present"])  # fmt: skip
    assert 0 < held < size / 10  # its header
    listed = lines["test/SmolLM2-GGUF:Q4_1"].split()
    assert listed[1:] == [*format_size(held).split(), "of", *format_size(size).split(), "gguf",
                          "(byte", "ranges)", "llama", "Q4_1"], listed  # fmt: skip
    assert "gguf (byte ranges, 3 parts)" in lines["test/SmolSplit-GGUF:Q4_1"]
    code, out, err = edgetp(capsys, "rm", "test/SmolLM2-GGUF:Q4_1")
    assert code == 0 and f"removed test/SmolLM2-GGUF:Q4_1 ({format_size(held)} freed)" in err
    assert sorted(p.name for p in remote.iterdir()) == [split.parent.name]  # record gone too
    code, out, err = edgetp(capsys, "models")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["test/SmolSplit-GGUF:Q4_1"]
    print(out)


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


# -- each device its own slices' bytes -------------------------------------------------------


def _share_bytes(source, s, node: int, heads) -> int:
    """The file bytes a node's share holds: each layer's parts (rows, and where cut, the
    bytes or blocks of their columns), and its rows of the lm_head (a worker, where split;
    SmolLM2's head is its embedding)."""

    def row_bytes(layer: int | None, name: str, cols) -> tuple[int, int]:  # (rows, row bytes)
        if isinstance(source, GGUFSource):
            info = source.file.info(source._name(layer, name))
            n_rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
            block, size = GGML_QUANT_SIZES[info.tensor_type]
            width = (-(-cols[1] // block) - cols[0] // block) * size if cols else None
            return n_rows, width or info.n_bytes // n_rows
        shape = source.shape(layer, name)  # an HF folder of float32
        n_rows = shape[0] if len(shape) > 1 else 1
        width = (cols[1] - cols[0]) if cols else int(np.prod(shape)) // n_rows
        return n_rows, 4 * width

    config, total = source.config, 0
    for i in range(config.n_layers):
        for parts in slice_parts(*family_of(config).layer_view(config, s, i), i).values():
            for p in parts:
                n_rows, row = row_bytes(i, p.source, p.cols)
                total += (p.n_rows if n_rows > 1 else 1) * row
    if node > 0 and heads:
        total += (heads[node][1] - heads[node][0]) * row_bytes(None, "embedding", None)[1]
    return total


def _header_bytes(source) -> int:
    """The bytes before the tensors: a GGUF's header, or each safetensors file's."""
    if isinstance(source, GGUFSource):  # each part's, if split
        infos = [source.file.info(n) for n in source.file.tensor_names()]
        return sum(min(t.data_offset for t in infos if t.part == k)
                   for k in range(len(source.file.paths)))  # fmt: skip
    return sum(8 + struct.unpack("<Q", f.read_bytes()[:8])[0] for f in source.weight_files())


@pytest.mark.parametrize(
    "repo", ["test/SmolLM2-GGUF:Q4_1", "test/SmolSplit-GGUF:Q4_1", "test/SmolLM2-HF"]
)
def test_each_device_fetches_only_its_slices_bytes_and_splits_what_the_whole_file_gives(
    at_hub, smollm2_hf, tmp_path, repo
):
    """Three devices (the master and two workers) split their shares of SmolLM2 from the hub
    by byte ranges, each into a mirror of its own (a GGUF file, one split in three files, and
    an HF folder of two safetensors files): each share's shards are, byte for byte (sha256), the
    ones a split of the files by path writes; the server counts what each fetched: a worker at
    most 1.1x its slice's bytes with the headers, the master at most the headers plus its own
    tensors; no device fetches the whole model."""
    gguf = repo.endswith("Q4_1")
    local_path = model_path() if gguf else smollm2_hf
    if "Split" in repo:  # the very files the hub serves
        for file, data in at_hub.repos[repo.split(":")[0]].files.items():
            (tmp_path / "split").mkdir(exist_ok=True)
            (tmp_path / "split" / file).write_bytes(data)  # type: ignore[arg-type]
        local_path = min((tmp_path / "split").iterdir())
    local = open_model(str(local_path))
    config, dtype = local.config, "auto" if gguf else "f32"
    slices = plan_slices(config, [1.0, 1.0, 1.0], local.ffn_align(dtype))
    heads = head_rows(config, slices, [1.0, 1.0, 1.0])
    whole = split_model(local, slices, ShardStore(tmp_path / "whole"), dtype=dtype, head_rows=heads)
    name = Name(*repo.split(":")) if gguf else Name(repo)
    mirror_path = mirror(name, tmp_path / "master")
    assert mirror_path is not None
    header, size = _header_bytes(local), sum(f.stat().st_size for f in local.weight_files())
    for node in range(3):
        at_hub.served.clear()
        if node == 0:
            source = open_model(str(mirror_path))  # the master's, as `--model NAME` opens it
        else:  # a worker's: what SPLIT tells it
            assert (remote := open_model(str(mirror_path)).remote()) is not None
            source, _ = open_remote(remote, tmp_path / f"device{node}")
        share = split_node(source, slices, node, ShardStore(tmp_path / f"store{node}"), dtype,
                           heads)  # fmt: skip
        assert share.layers == whole.nodes[node]
        assert share.extra == (whole.globals if node == 0 else whole.heads[node - 1])
        served, own = sum(at_hub.served.values()), _share_bytes(local, slices[node], node, heads)
        if node == 0:
            bound = (
                header
                + own
                + sum(  # its globals: the embedding, the final norm
                    int(np.prod(local.shape(None, n))) * (4 if not gguf else 0)
                    + (local.file.info(local._name(None, n)).n_bytes if gguf else 0)
                    for n in ("embedding", "final_norm")
                )
            )
        else:
            bound = 1.1 * (header + own)
        print(f"{repo} node {node}: served {served} bytes, its share {own} (+ headers {header}),"
              f" bound {bound:.0f}, of {size} bytes")  # fmt: skip
        assert served <= bound and served < size


def test_a_cluster_runs_a_model_by_name_from_its_devices_slices_as_the_file_by_path(
    at_hub, tmp_path
):
    """`edgetp run --local-nodes 3 --model NAME` with the model in no cache: the master and two
    worker processes each split their share from the hub by byte ranges (SPLIT), and the
    answer is the one the file gives by its path; no device fetched the whole file, and the
    hub's cache holds none of it. Then, the hub out of reach, the same from the mirrors."""
    args = ("run", "--raw", "--max-tokens", "6", "--local-nodes", "3", "--state-dir")
    by_path = edgetp_process(tmp_path / "a", at_hub.url, *args, str(tmp_path / "a"),
                             "--model", str(model_path()), "Paris is")  # fmt: skip
    assert by_path.returncode == 0, by_path.stderr
    at_hub.served.clear()
    by_name = edgetp_process(tmp_path / "b", at_hub.url, "-v", *args, str(tmp_path / "b"),
                             "--model", "test/SmolLM2-GGUF:Q4_1", "Paris is")  # fmt: skip
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == by_path.stdout and by_name.stdout.strip()
    split = re.findall(r"node (\S+) split its share: (\d+) bytes", by_name.stderr)
    assert len(split) == 2, by_name.stderr  # each worker, as the master's log says
    size = model_path().stat().st_size
    assert all(int(n) < size / 2 for _, n in split), split
    assert not list((tmp_path / "b").glob("hub/models--*/blobs/*"))  # nothing pulled whole
    print(f"served {sum(at_hub.served.values())} bytes in all; workers: {split}")
    # The hub out of reach (HF_ENDPOINT refused): the name is read from the mirrors the run
    # left, each device's, and answers the same with nothing fetched.
    at_hub.served.clear()
    refused = f"http://127.0.0.1:{_closed_port()}"
    gone = edgetp_process(tmp_path / "b", refused, *args, str(tmp_path / "b"),
                          "--model", "test/SmolLM2-GGUF:Q4_1", "Paris is")  # fmt: skip
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout == by_path.stdout and "is read from its mirror" in gone.stderr, gone.stderr
    assert sum(at_hub.served.values()) == 0


def test_a_worker_that_cannot_reach_the_hub_gets_its_share_from_the_master(
    at_hub, tmp_path, smollm2, smollm2_tokenizer, shared_state, caplog
):
    """A worker in a network namespace of its own (an emulated device, its one way out a relay
    to the master) cannot reach the hub: it says so at SPLIT, the master splits that share by
    byte ranges itself and ships it, and two nodes by name answer as one node by path."""
    host.check_host([DeviceSpec(rtt=0.001)])
    prompt = smollm2_tokenizer.encode("The capital of France is")
    with local_engine(smollm2, 1, state_dir=shared_state, context=64) as engine:
        *_, alone = time_greedy(engine, smollm2_tokenizer, prompt, 6)
    by_name = mirror(Name("test/SmolLM2-GGUF", "Q4_1"), tmp_path / "remote")
    assert by_name is not None
    devices_at = tmp_path / "devices"
    with (
        emulated([DeviceSpec(), DeviceSpec(rtt=0.0005)], 2, devices_at) as devices,
        caplog.at_level(logging.INFO, "edgetp.master.cluster.hub"),
        local_session(
            open_model(str(by_name)),
            2,
            state_dir=tmp_path / "state",
            context=64,
            devices=devices,
            standby=False,
        ) as session,  # fmt: skip
    ):
        assert session.engine is not None and session.nodes == 2
        *_, split = time_greedy(session.engine, smollm2_tokenizer, prompt, 6)
    assert split == alone
    assert "cannot reach the hub" in caplog.text and "the master splits its share" in caplog.text
    assert "split its share:" not in caplog.text  # no worker split one
    print(f"tokens {split}; {sum(at_hub.served.values())} bytes served, all to the master")


def test_a_hub_without_byte_ranges_is_pulled_whole_and_a_changed_file_is_refused(
    at_hub, tmp_path, caplog
):
    """A hub that answers a byte range with the whole file: the model is pulled whole into the
    cache, as before, and the log says why. A file that changed on the hub after its mirror
    was made: a range of the new version is refused in one line, nothing of it kept."""
    path = resolve_model("test/Whole-GGUF", tmp_path / "remote")
    assert path is not None and "models--test--Whole-GGUF" in path  # the cache's, whole
    assert "answered HTTP 200 to a byte-range request" in caplog.text
    mirrored = resolve_model("test/Changing-GGUF", tmp_path / "remote")
    assert mirrored is not None and Path(mirrored).parent == tmp_path / "remote"
    reopened = RemoteFile.reopen(Path(mirrored))  # as `open_model` finds it
    assert reopened is not None and reopened.present  # its header, fetched
    remote = reopened.remote
    at_hub.repos["test/Changing-GGUF"].etags["Changing-Q4_K_M.gguf"] = "f" * 64
    file = RemoteFile(remote, tmp_path / "worker.gguf")
    with pytest.raises(ModelError, match="served bytes of another version") as refused:
        file.ensure([(0, 8)])
    assert "\n" not in str(refused.value) and file.present == []


def test_a_split_gguf_pulled_by_name_answers_as_the_file_it_was_split_from(
    at_hub, tmp_path, capsys
):
    """A GGUF split in three files (as gguf-split writes it) is pulled whole and read as one
    model: its every tensor's bytes are the unsplit file's, and `run` by its name answers as
    `run` of the unsplit file by its path."""
    code, out, err = edgetp(capsys, "pull", "test/SmolSplit-GGUF:Q4_1")
    assert code == 0 and out.strip().endswith("-00001-of-00003.gguf"), err
    split, whole = GGUFFile(Path(out.strip())), GGUFFile(model_path())
    assert len(split.paths) == 3 and split.metadata["general.architecture"] == "llama"
    assert sorted(split.tensor_names()) == sorted(whole.tensor_names())
    for name in whole.tensor_names():
        rows = whole.info(name).shape[0] if len(whole.info(name).shape) > 1 else 1
        assert np.array_equal(split.stored_rows(name, 0, rows), whole.stored_rows(name, 0, rows))
    args = ("run", "--raw", "--max-tokens", "6", "--model")
    by_path = edgetp_process(tmp_path, at_hub.url, *args, str(model_path()), "Paris is")
    by_name = edgetp_process(tmp_path, at_hub.url, *args, "test/SmolSplit-GGUF:Q4_1", "Paris is")
    assert by_path.returncode == 0 and by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == by_path.stdout and by_name.stdout.strip()


def test_a_safetensors_repository_pulled_by_name_answers_as_its_folder_by_path(
    at_hub, smollm2_hf, tmp_path, capsys
):
    """An HF repository (config, tokenizer, two safetensors files and their index) is pulled
    whole, file for file the folder it was made from, and `run` by its name answers as `run` of
    that folder by its path."""
    code, out, err = edgetp(capsys, "pull", "test/SmolLM2-HF")
    assert code == 0, err
    pulled = Path(out.strip())
    made = sorted(p.name for p in smollm2_hf.iterdir())
    assert sorted(p.name for p in pulled.iterdir()) == made
    assert all(filecmp.cmp(pulled / n, smollm2_hf / n, shallow=False) for n in made)

    def run(model: str, state: str) -> subprocess.CompletedProcess[str]:  # its own shards
        args = ("--state-dir", str(tmp_path / state), "--model", model, "Paris is")
        return edgetp_process(tmp_path, at_hub.url, "run", "--raw", "--max-tokens", "4", *args)

    by_path, by_name = run(str(smollm2_hf), "a"), run("test/SmolLM2-HF", "b")
    assert by_path.returncode == 0 and by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == by_path.stdout and by_name.stdout.strip()
