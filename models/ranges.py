"""A model file on the hub read by byte ranges: each device fetches only the bytes it reads.

The file is mirrored in a sparse local file of its full size, where only the fetched runs hold
data (on disk too: the holes take no blocks), beside a record of which runs those are, so a
restart or a re-plan fetches only what it lacks. A GGUF's header and a row-parallel slice of a
matrix are a few contiguous runs of its bytes; `GGUFFile` asks for the runs a read needs before
it reads them, so a device that splits its own share never holds the rest of the file.

Runs go out several to a request (`Range: bytes=a-b,c-d`, answered as multipart/byteranges);
a server that answers a multi-range request with one range or the whole file is asked one run a
request from then on. Every answer must carry the file's ETag (on the hub, an LFS file's sha256)
and the exact range asked: bytes of another version of the file, or of another range, are
refused. The hub holds no checksum of a part of a file, so a slice is verified as the named
version's bytes at the named offsets, not by a hash of its own; its shard's sha256 is then what
the device reports and later loads are checked against.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetp.models.errors import HubUnreachable, ModelError

if TYPE_CHECKING:  # a model by path never imports the HTTP client
    import httpx2

RANGES_A_REQUEST = 200  # a Range header of 200 runs is ~5 KB, under common servers' 8 KB
REQUESTS_AT_ONCE = 4
TIMEOUT = 60.0
RECORD_EVERY = 2.0  # s between writes of the record of present runs
SIDECAR = ".ranges.json"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

Run = tuple[int, int]  # [start, end) in the file


@dataclass(frozen=True)
class Remote:
    """Where a file is and which version of it: what a device needs to fetch its runs."""

    url: str
    size: int
    etag: str  # the version's ETag, unquoted (an LFS file's sha256)
    headers: dict[str, str] = field(default_factory=dict)  # an Authorization, if any


@dataclass(frozen=True)
class RemoteModel:
    """A model on the hub as a device needs it to split its share: each weight file read by
    ranges (a GGUF's one file; an HF folder's safetensors), by its name in the model's folder,
    and the folder's other files whole (config.json, tokenizer files; none for a GGUF)."""

    files: dict[str, Remote]
    small: dict[str, bytes] = field(default_factory=dict)

    def key(self) -> str:
        """A name for its mirror on a device: the same for the same file versions."""
        return hashlib.sha256(
            "".join(sorted(r.etag for r in self.files.values())).encode()
        ).hexdigest()[:24]


def hub_headers() -> dict[str, str]:
    """What a request to the hub carries: its user agent, and HF_TOKEN's credentials if set."""
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers()


def write_whole(path: Path, data: bytes) -> None:
    """A mirror's small file (config, tokenizer), whole or absent: written aside, renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def fetch_safetensors_header(remote: RemoteFile) -> tuple[int, dict[str, Any]]:
    """Fetch a safetensors file's header, its length (8 bytes) then its JSON; returns where
    its data starts and each tensor's entry (dtype, shape, data_offsets)."""
    remote.ensure([(0, 8)])
    with open(remote.local, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    if 8 + length > remote.remote.size:
        raise ModelError(f"{remote.remote.url} is not a safetensors file ({length} B header)")
    remote.ensure([(0, 8 + length)])
    with open(remote.local, "rb") as f:  # opened again: a buffer read before holds zeros
        f.seek(8)
        return 8 + length, json.loads(f.read(length))


def tensor_runs(
    offset: int, row_bytes: int, rows: tuple[int, int], columns: tuple[int, int] | None
) -> list[Run]:
    """The runs of rows [rows) of a row-major tensor at `offset`: one run, or where a reader
    takes only bytes `columns` of each row, one run a row."""
    first, last = offset + rows[0] * row_bytes, offset + rows[1] * row_bytes
    if columns is None:
        return [(first, last)]
    a, b = columns
    return [(at + a, at + b) for at in range(first, last, row_bytes)]


def merge(runs: Iterable[Run]) -> list[Run]:
    """Runs sorted, with those that touch or overlap made one."""
    out: list[Run] = []
    for a, b in sorted(runs):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def join(present: list[Run], new: Iterable[Run]) -> list[Run]:
    """`merge(present + new)` for `present` sorted and merged already, as `merge` gives: the
    stretches of `present` between the new runs are copied whole, so a call costs its new runs
    rather than the runs present. A device's share of a matrix cut by columns is a run a row:
    a 70B model's are a million runs, and merging them all again at every tensor fetched took
    0.64 us a run present (2.4 s for 30 matrices of 8,192 rows, growing with their square)."""
    out: list[Run] = []
    j = 0
    for a, b in merge(new):
        i = bisect.bisect_left(present, (a, b), lo=j)
        out.extend(present[j:i])
        j = i
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
        while j < len(present) and present[j][0] <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], present[j][1]))
            j += 1
    out.extend(present[j:])
    return out


def missing(wanted: Iterable[Run], present: Sequence[Run]) -> list[Run]:
    """The parts of `wanted` that `present` (sorted and merged, as `merge` gives) lacks."""
    starts = [p for p, _ in present]
    out = []
    for a, b in merge(wanted):
        j = max(bisect.bisect_right(starts, a) - 1, 0)
        while j < len(present) and present[j][0] < b:
            p, q = present[j]
            if q > a:
                if p > a:
                    out.append((a, p))
                a = max(a, q)
                if a >= b:
                    break
            j += 1
        if a < b:
            out.append((a, b))
    return out


class RemoteFile:
    """A sparse local mirror of a remote file, filled a run at a time. `fetched` counts the
    bytes this process fetched; `requests` the requests it sent."""

    def __init__(self, remote: Remote, local: Path) -> None:
        self.remote = remote
        self.local = local
        self._sidecar = local.with_name(local.name + SIDECAR)
        self._lock = threading.Lock()
        self.fetched = 0
        self.requests = 0
        self._multi = True  # until the server answers a multi-range request otherwise
        self._client: httpx2.Client | None = None  # one, kept: its connections are reused
        self._recorded = 0.0
        self.present = self._read_record()
        local.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(local, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != remote.size:
                os.ftruncate(fd, remote.size)  # holes: no block is written
        finally:
            os.close(fd)
        if not self._sidecar.is_file():
            self._write_record()  # the mirror names its file from the start

    def _read_record(self) -> list[Run]:
        try:
            record = json.loads(self._sidecar.read_text())
        except (OSError, ValueError):
            return []
        if record.get("etag") != self.remote.etag or not self.local.is_file():
            return []  # another version's bytes: none of them count
        return merge((int(a), int(b)) for a, b in record.get("present", []))

    @classmethod
    def reopen(cls, local: Path) -> RemoteFile | None:
        """The mirror at `local` as its record names its file, with the hub's headers of this
        process (credentials are not kept on disk); None where `local` is no mirror."""
        sidecar = local.with_name(local.name + SIDECAR)
        if not sidecar.is_file():
            return None
        try:
            record = json.loads(sidecar.read_text())
            remote = Remote(str(record["url"]), int(record["size"]), str(record["etag"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cls(replace(remote, headers=hub_headers()), local)

    def _write_record(self) -> None:
        r = self.remote
        record = {"url": r.url, "size": r.size, "etag": r.etag, "present": self.present}
        write_whole(self._sidecar, json.dumps(record).encode())

    def ensure(self, runs: Iterable[Run]) -> None:
        """Fetch whatever of `runs` the mirror lacks, and record it as present once written
        and synced: a run cut off by a failure is fetched again, never read as zeros."""
        todo = missing(runs, self.present)
        if not todo:
            return
        for a, b in todo:
            if a < 0 or b > self.remote.size:
                raise ModelError(f"bytes {a}-{b} lie outside {self.remote.url}")
        groups = [todo[i : i + RANGES_A_REQUEST] for i in range(0, len(todo), RANGES_A_REQUEST)]
        import httpx2

        if self._client is None:
            self._client = httpx2.Client(timeout=TIMEOUT, follow_redirects=True)
        client = self._client
        fd = os.open(self.local, os.O_RDWR)
        try:
            if len(groups) == 1:
                done = [self._fetch(client, fd, groups[0])]
            else:
                with ThreadPoolExecutor(REQUESTS_AT_ONCE) as pool:
                    done = list(pool.map(lambda g: self._fetch(client, fd, g), groups))
            os.fsync(fd)
        except httpx2.HTTPError as exc:
            raise HubUnreachable(
                f"fetching {self.remote.url} by byte ranges failed ({exc}): check the network, "
                "or pull the whole model first (`edgetp pull`)"
            ) from None
        finally:
            os.close(fd)
        with self._lock:
            self.present = join(self.present, (r for g in done for r in g))
            if time.monotonic() - self._recorded > RECORD_EVERY:
                self.save()

    def save(self) -> None:
        """Record which runs are present (every RECORD_EVERY seconds of fetching, and when a
        split is done): a run fetched but not yet recorded is only fetched again."""
        self._write_record()
        self._recorded = time.monotonic()

    def _fetch(self, client: httpx2.Client, fd: int, group: list[Run]) -> list[Run]:
        if len(group) > 1 and self._multi:
            parts = self._get(client, group)
            if parts is not None:
                for (a, _), data in zip(group, parts, strict=True):
                    os.pwrite(fd, data, a)
                return group
            self._multi = False  # this server takes one range a request
        for run in group:
            for data in self._get(client, [run]) or ():  # one run: its bytes, always
                os.pwrite(fd, data, run[0])
        return group

    def _get(self, client: httpx2.Client, runs: list[Run]) -> list[bytes] | None:
        """The bytes of `runs`, in order; None when a multi-range ask was answered otherwise."""
        spec = ",".join(f"{a}-{b - 1}" for a, b in runs)
        response = client.get(
            self.remote.url, headers={**self.remote.headers, "Range": f"bytes={spec}"}
        )
        with self._lock:
            self.requests += 1
        if response.status_code != 206:
            raise ModelError(
                f"{self.remote.url} answered HTTP {response.status_code} to a byte-range "
                "request: pull the whole model first (`edgetp pull`)"
            )
        self._check_version(response)
        kind = response.headers.get("content-type", "")
        if len(runs) == 1:
            self._check_part(runs[0], response.headers.get("content-range", ""), response.content)
            return [response.content]
        if not kind.startswith("multipart/byteranges"):
            return None
        parts = _multipart(response.content, kind)
        if len(parts) != len(runs):
            raise ModelError(f"{self.remote.url} answered {len(parts)} ranges of {len(runs)} asked")
        for run, (content_range, data) in zip(runs, parts, strict=True):
            self._check_part(run, content_range, data)
        return [data for _, data in parts]

    def _check_version(self, response: httpx2.Response) -> None:
        headers, history = response.headers, response.history
        # the hub names the file's version on its own answer (a redirect's X-Linked-Etag)
        named = [h.headers.get("x-linked-etag") for h in history] + [headers.get("etag")]
        tags = [t.removeprefix("W/").strip('"') for t in named if t]
        if tags and self.remote.etag not in tags:
            raise ModelError(
                f"{self.remote.url} served bytes of another version ({tags[-1][:12]}, expected "
                f"{self.remote.etag[:12]}): the model changed on the hub; start again"
            )

    def _check_part(self, run: Run, content_range: str, data: bytes) -> None:
        match = _CONTENT_RANGE.fullmatch(content_range.strip())
        a, b = run
        if (
            match is None
            or (int(match[1]), int(match[2]) + 1) != run
            or len(data) != b - a
            or (match[3] != "*" and int(match[3]) != self.remote.size)
        ):
            raise ModelError(
                f"{self.remote.url} sent bytes that do not match the range asked ({a}-{b - 1}; "
                f"it said {content_range!r} with {len(data)} bytes): nothing of it was kept"
            )
        with self._lock:
            self.fetched += len(data)


def _multipart(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """A multipart/byteranges body's parts: each one's Content-Range and bytes."""
    match = re.search(r'boundary="?([^";]+)"?', content_type)
    if match is None:
        raise ModelError("a multipart/byteranges answer without its boundary")
    delimiter = b"--" + match[1].encode()
    parts = []
    at = body.find(delimiter)
    while at >= 0:
        at += len(delimiter)
        if body[at : at + 2] == b"--":
            break
        head_end = body.find(b"\r\n\r\n", at)
        if head_end < 0:
            raise ModelError("a multipart/byteranges part without its headers' end")
        head = body[at:head_end].decode("latin-1")
        found = re.search(r"(?im)^content-range:\s*(.+?)\s*$", head)
        content_range = str(found[1]) if found else ""
        range_match = _CONTENT_RANGE.fullmatch(content_range)
        if range_match is None:
            raise ModelError(f"a multipart/byteranges part with Content-Range {content_range!r}")
        start = head_end + 4
        end = start + int(range_match[2]) + 1 - int(range_match[1])
        parts.append((content_range, body[start:end]))
        at = body.find(delimiter, end)
    return parts
