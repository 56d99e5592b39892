"""Models by name: `owner/repo[:QUANT]` on the Hugging Face hub, fetched into huggingface_hub's
cache (HF_HOME, HF_HUB_CACHE) and opened from there.

A GGUF repository holds several quantizations of one model; the quant picks a file by its name,
as llama.cpp's `-hf` does: the tag, case-insensitive, standing alone in the file's path (`Q4_K`
does not take `Q4_K_M`). No quant: Q4_K_M if there is one, else the first GGUF file by name.
Projector files (`mmproj`) are never the model. A split GGUF (`-00001-of-00003.gguf`) is fetched
whole and named by its first part (models/gguf_file.py reads its parts as one). A repository
without GGUF files is an HF folder: its config.json, tokenizer and chat template files and its
safetensors weights, the top level only.

huggingface_hub downloads each file to a temporary `.incomplete` file and renames it into place
when its size is right, so a cut-off file never looks complete; edgetp then checks the bytes of
every file it fetched against the hub's checksum (an LFS file's sha256, a small file's git blob
id), which huggingface_hub does not. A name is resolved from the cache without asking the hub
when the cache holds every file the name needs (HF_HUB_OFFLINE: never asks).

huggingface_hub is imported by what reaches the hub or its cache, when it is called: the command
line names a model by path far more often than by name, and a path never imports it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from edgetp.models.errors import HubUnreachable, ModelError
from edgetp.models.ranges import SIDECAR

log = logging.getLogger(__name__)

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's default for `-hf REPO`
# owner/repo[:QUANT], as the hub spells repository names
_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?$")
_SPLIT = re.compile(r"-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# a quantization's tag in a file name: Q4_K_M, IQ4_XS, UD-Q4_K_XL, Q8_0, F16, BF16, MXFP4...
_QUANT_TAG = re.compile(
    r"(?<![a-z0-9])((?:ud-)?i?q\d(?:_[a-z0-9]+)*|bf16|f16|f32|mxfp4(?:_moe)?)(?![a-z0-9])",
    re.IGNORECASE,
)
# what a safetensors repository's model is made of, at its top level
_HF_SUFFIXES = (".json", ".safetensors", ".model", ".jinja", ".txt", ".tiktoken")
_MODEL_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin")  # a path, not a name
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class Name:
    """A model on the hub: a repository and, for a GGUF one, the quant that picks its file."""

    repo: str
    quant: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


@dataclass(frozen=True)
class Selection:
    """The files of a repository one name needs, fetched in this order, and the one edgetp opens
    (a GGUF's first part; "" for an HF folder: the snapshot itself)."""

    files: tuple[str, ...]
    main: str
    format: str  # "gguf" or "safetensors"


@dataclass(frozen=True)
class LocalModel:
    """A model in the cache, or a mirror of one read by byte ranges (`size`: the bytes it holds
    on disk), as `edgetp models` lists it."""

    name: str
    size: int
    format: str
    family: str
    quant: str
    path: Path
    whole: int = 0  # a mirror's: the bytes of the files it mirrors


def parse_name(spec: str) -> Name | None:
    """`owner/repo[:QUANT]` if `spec` is written as a hub name and is no path on this machine."""
    match = _NAME.match(spec)
    if match is None or Path(spec).expanduser().exists():
        return None
    if spec.lower().endswith(_MODEL_SUFFIXES):  # a mistyped file path, not a repository
        return None
    return Name(match["repo"], match["quant"])


def resolve_model(spec: str | None, mirrors: Path | None = None) -> str | None:
    """The local path of the model `--model` names: a path (or a bundled name, or None for the
    default) as it is; `owner/repo[:QUANT]` from the cache when it holds the whole model; else,
    given `mirrors`, a sparse mirror there, whose bytes each device fetches as it reads them
    (`mirror`), or the one kept from before where the hub cannot be reached or is not to be
    asked (HF_HUB_OFFLINE); else pulled from the hub first."""
    if spec is None:
        return None
    name = parse_name(spec)
    if name is None:
        return spec
    from huggingface_hub import constants

    local = cached(name)
    # no quant: the cache's first GGUF is the name's only if it is the default one, or if the
    # hub, which may hold the default, is not to be asked
    if local is not None and (name.quant or _is_default(local) or constants.HF_HUB_OFFLINE):
        return str(local)
    if mirrors is not None:
        if constants.HF_HUB_OFFLINE:
            mirrored = kept_mirror(name, mirrors)
        else:
            try:
                mirrored = mirror(name, mirrors)
            except HubUnreachable:
                if (mirrored := kept_mirror(name, mirrors)) is None:
                    raise
                log.warning("the hub cannot be reached: %s is read from its mirror, %s (what "
                            "it holds: a plan that needs more fails)", name, mirrored)  # fmt: skip
        if mirrored is not None:
            return str(mirrored)
    return str(pull(name))


def kept_mirror(name: Name, folder: Path) -> Path | None:
    """The newest mirror in `folder` of what `name` means, as a model is opened (a GGUF file,
    a split's first part, an HF folder), for a start without the hub: it reads what it holds."""
    kept = [m for m in mirrored_models(folder) if _mirrors(m, name)]
    if not kept:
        return None
    newest = max(kept, key=lambda m: m.path.stat().st_mtime)
    if newest.path.is_dir() and newest.format.startswith("gguf"):
        return min(p for p in newest.path.iterdir() if p.name.endswith(".gguf"))
    return newest.path


def _mirrors(model: LocalModel, name: Name) -> bool:
    repo, _, quant = model.name.partition(":")
    wanted = name.quant or (DEFAULT_QUANT if quant else "")
    return repo == name.repo and quant.lower() == wanted.lower()


def mirror(name: Name, folder: Path) -> Path | None:
    """A sparse mirror in `folder` of what `name` means, read by byte ranges (models/ranges.py):
    a GGUF file (each part of a split one), or an HF folder (its small files whole, its
    safetensors sparse); only headers are fetched here, each device fetches the bytes of its own
    slices. None, said in the log, where that cannot be: a hub that answers no byte ranges."""
    from huggingface_hub import HfApi, constants, hf_hub_url

    from edgetp.models.gguf_file import fetch_header
    from edgetp.models.ranges import (
        Remote,
        RemoteFile,
        fetch_safetensors_header,
        hub_headers,
        write_whole,
    )

    with _hub_errors(name):
        info = HfApi(endpoint=constants.ENDPOINT).model_info(name.repo, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        selection = select(siblings, name)
        weights = [f for f in selection.files if f.endswith((".gguf", ".safetensors"))]
        checksums = {f: _checksum(siblings[f]) for f in selection.files}
        if info.sha is None or any(
            (c := checksums[f]) is None or c[0] != "sha256" or not siblings[f].size for f in weights
        ):
            return None
        headers = hub_headers()

        def url(f: str) -> str:
            return hf_hub_url(name.repo, f, revision=info.sha, endpoint=constants.ENDPOINT)

        import httpx2

        probe = httpx2.get(url(weights[0]), headers={**headers, "Range": "bytes=0-3"},
                           follow_redirects=True, timeout=30.0)  # fmt: skip
        if probe.status_code != 206:
            log.warning(
                "the hub answered HTTP %d to a byte-range request for %s: pulled whole, each "
                "device's slices shipped by the master", probe.status_code, name,
            )  # fmt: skip
            return None
        remotes = {f: Remote(url(f), siblings[f].size or 0, checksums[f][1], headers)  # type: ignore[index]
                   for f in weights}  # fmt: skip
        if selection.format == "gguf":  # one file, or a split's parts side by side
            first = remotes[selection.main].etag
            local = folder / f"{first}.gguf" if len(weights) == 1 else folder / first[:24]
            for f, remote in remotes.items():
                at = local if len(weights) == 1 else local / PurePosixPath(f).name
                mirrored = RemoteFile(remote, at)  # its record names the file: `open_model`
                fetch_header(mirrored)  # reads it by ranges; its header is read at once
                mirrored.save()
            return local if len(weights) == 1 else local / PurePosixPath(selection.main).name
        local = folder / f"{name.repo.replace('/', '--')}-{info.sha[:12]}"
        for f in selection.files:  # the config, tokenizer and index files whole
            if f not in remotes and not (local / f).is_file():
                response = httpx2.get(url(f), headers=headers, follow_redirects=True, timeout=60.0)
                response.raise_for_status()
                _check_bytes(name, f, response.content, checksums[f])
                write_whole(local / f, response.content)
        for f, remote in remotes.items():
            mirrored = RemoteFile(remote, local / f)
            fetch_safetensors_header(mirrored)
            mirrored.save()
        return local


def _check_bytes(name: Name, filename: str, data: bytes, expected: tuple[str, str] | None) -> None:
    """A small file's bytes against the hub's checksum (its git blob id, or sha256)."""
    if expected is None:
        return
    kind, want = expected
    h = _hasher(kind, len(data))
    h.update(data)
    got = h.hexdigest()
    if got != want:
        raise ModelError(
            f"{filename} of {name.repo} arrived with bytes that do not match the hub's checksum "
            f"({got[:12]}, expected {want[:12]}): nothing was kept; try again"
        )


def _is_default(path: Path) -> bool:
    return path.is_dir() or _quant_matches(path.name, DEFAULT_QUANT)


def quant_of(filename: str) -> str:
    """The quantization a GGUF file's name says, upper-case ("" if it says none)."""
    tags = _QUANT_TAG.findall(PurePosixPath(filename).name)
    return tags[-1].upper() if tags else ""


def _quant_matches(path: str, quant: str) -> bool:
    pattern = rf"(?<![a-z0-9]){re.escape(quant.lower())}(?![a-z0-9_])"
    return re.search(pattern, path.lower()) is not None


def _ggufs(files: Iterable[str]) -> list[str]:
    return sorted(
        f
        for f in files
        if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower()
    )


def _parts(first: str, files: Iterable[str]) -> tuple[str, ...]:
    """A GGUF file and, if it is a split's part, every part of that split listed in `files`."""
    match = _SPLIT.search(first)
    if match is None:
        return (first,)
    stem = first[: match.start()]
    return tuple(sorted(f for f in files if f.startswith(stem) and _SPLIT.search(f[len(stem) :])))


def select(files: Iterable[str], name: Name) -> Selection:
    """Which of a repository's files `name` means (its quant matched as llama.cpp's `-hf`)."""
    files = sorted(files)
    ggufs = _ggufs(files)
    if ggufs:
        if name.quant:
            matching = [f for f in ggufs if _quant_matches(f, name.quant)]
            if not matching:
                raise ModelError(
                    f"{name.repo} has no {name.quant} GGUF file; its quants: "
                    f"{', '.join(quants(files)) or '(none named)'}"
                )
        else:
            matching = [f for f in ggufs if _quant_matches(f, DEFAULT_QUANT)] or ggufs
        first = matching[0]
        if (match := _SPLIT.search(first)) is not None and int(match["part"]) != 1:
            first = _parts(first, ggufs)[0]
        return Selection(_parts(first, ggufs), first, "gguf")
    if name.quant:
        raise ModelError(
            f"{name.repo} holds no GGUF files, so it has no quants: name it without :{name.quant}"
        )
    top = [f for f in files if "/" not in f and f.lower().endswith(_HF_SUFFIXES)]
    if "config.json" not in top:
        raise ModelError(
            f"{name.repo} holds neither GGUF files nor an HF model (config.json): "
            "edgetp cannot run it"
        )
    weights = [f for f in top if f.endswith(".safetensors")]
    if not weights:
        raise ModelError(
            f"{name.repo} has no safetensors weights (edgetp does not read PyTorch .bin files)"
        )
    rest = [f for f in top if not f.endswith(".safetensors")]
    # the small files first, the index before the weights: an interrupted pull is then never
    # taken for a whole one by `_complete`
    ordered = sorted(rest, key=lambda f: f.endswith(".index.json")) + weights
    return Selection(tuple(ordered), "", "safetensors")


def quants(files: Iterable[str]) -> list[str]:
    """The quants a repository's GGUF files are named by, each once."""
    return sorted({q for f in _ggufs(files) if (q := quant_of(f))})


def model_files(path: Path) -> list[Path]:
    """A local model's files: an HF folder's, or a GGUF file and its split's other parts."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    names = [p.name for p in path.parent.iterdir()]
    return [path.parent / n for n in _parts(path.name, names)]


def _complete(selection: Selection, folder: Path) -> bool:
    """Whether `folder` holds every file `selection` needs (a split's every part, an HF
    folder's every indexed weight file)."""
    present = {f for f in selection.files if (folder / f).is_file()}
    if selection.format == "gguf":
        match = _SPLIT.search(selection.main)
        return len(present) == (int(match["count"]) if match else 1)
    if "config.json" not in present or not any(f.endswith(".safetensors") for f in present):
        return False
    for index in (f for f in present if f.endswith(".safetensors.index.json")):
        try:
            weight_map = json.loads((folder / index).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if not all((folder / f).is_file() for f in set(weight_map.values())):
            return False
    return present == set(selection.files)


# -- the cache -------------------------------------------------------------------------------


def _cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _storage(repo: str) -> Path:
    return _cache_dir() / ("models--" + repo.replace("/", "--"))


def _snapshot_files(snapshot: Path) -> list[str]:
    return sorted(
        p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()
    )  # is_file follows the link: a pointer whose blob is gone is not there


def cached(name: Name) -> Path | None:
    """The model's path in the cache (main's snapshot), if the cache holds all of it."""
    storage = _storage(name.repo)
    try:
        commit = (storage / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = storage / "snapshots" / commit
    try:
        selection = select(_snapshot_files(snapshot), name)
    except ModelError:  # not there, or a quant the cache lacks: the hub says which it has
        return None
    if not _complete(selection, snapshot):
        return None
    return snapshot / selection.main if selection.main else snapshot


# -- pulling ---------------------------------------------------------------------------------


def pull(name: Name) -> Path:
    """Fetch what `name` needs from the hub into the cache (what is there already is kept) and
    return its path; huggingface_hub draws a progress bar a file."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.utils.logging import disable_propagation

    disable_propagation()  # its warnings (a download resumed) once, by its own handler
    if constants.HF_HUB_OFFLINE:
        local = cached(name)
        if local is not None:
            return local
        raise ModelError(
            f"{name} is not in the cache ({_cache_dir()}) and HF_HUB_OFFLINE is set: pull it "
            "while online, or give --model a local path"
        )
    with _hub_errors(name):
        # the endpoint and cache as huggingface_hub has them now (HF_ENDPOINT, HF_HUB_CACHE),
        # not as its URL template took them at import
        info = HfApi(endpoint=constants.ENDPOINT).model_info(name.repo, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        selection = select(siblings, name)
        commit = info.sha
        if commit is None:
            raise ModelError(f"the hub gave no commit for {name.repo}")
        storage = _storage(name.repo)
        expected = {f: _checksum(siblings[f]) for f in selection.files}
        _check_room(name, storage, {f: siblings[f].size or 0 for f in selection.files}, expected)
        for filename in selection.files:
            fetched = not _has_blob(storage, expected[filename])
            path = Path(
                hf_hub_download(
                    name.repo,
                    filename,
                    revision=commit,
                    cache_dir=_cache_dir(),
                    endpoint=constants.ENDPOINT,
                )
            )
            if fetched:
                _verify(name, filename, path, expected[filename])
    refs = storage / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main.tmp").write_text(commit)
    os.replace(refs / "main.tmp", refs / "main")  # the name now resolves here, offline too
    snapshot = storage / "snapshots" / commit
    return snapshot / selection.main if selection.main else snapshot


def _checksum(sibling: Any) -> tuple[str, str] | None:
    """("sha256", hex) for an LFS file, ("git", blob id) for a small one; None if the hub gave
    neither."""
    if sibling.lfs is not None and sibling.lfs.sha256:
        return "sha256", sibling.lfs.sha256
    if sibling.blob_id:
        return "git", sibling.blob_id
    return None


def _has_blob(storage: Path, checksum: tuple[str, str] | None) -> bool:
    """Whether the cache holds a file's bytes already (blobs are named by the hub's etag: an LFS
    file's sha256, a small file's git blob id)."""
    return checksum is not None and (storage / "blobs" / checksum[1]).exists()


def _hasher(kind: str, size: int) -> Any:
    """The hash the hub's checksum of `kind` is, for a file of `size` bytes."""
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1()
    if kind == "git":  # git's blob id: sha1 of a header and the bytes
        h.update(b"blob %d\0" % size)
    return h


def _digest(path: Path, kind: str) -> str:
    h = _hasher(kind, path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verify(name: Name, filename: str, path: Path, expected: tuple[str, str] | None) -> None:
    """Check a fetched file's bytes against the hub's checksum; a file that fails is removed
    (its blob and its pointer), so neither this nor a later run opens it."""
    if expected is None:
        return
    kind, want = expected
    got = _digest(path, kind)
    if got == want:
        return
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    raise ModelError(
        f"{filename} of {name.repo} downloaded with bytes that do not match the hub's "
        f"{'sha256' if kind == 'sha256' else 'git blob id'} ({got[:12]}, expected {want[:12]}); "
        "it was removed: pull again (a proxy or a mirror may be altering it)"
    )


def _check_room(
    name: Name,
    storage: Path,
    sizes: dict[str, int],
    expected: dict[str, tuple[str, str] | None],
) -> None:
    """Refuse, before a byte is fetched, a pull that the cache's disk cannot hold."""
    needed = sum(size for f, size in sizes.items() if not _has_blob(storage, expected[f]))
    at = storage
    while not at.exists():
        at = at.parent
    free = shutil.disk_usage(at).free
    if needed > free:
        raise ModelError(
            f"{name} needs {needed / 1e9:.1f} GB and {at} has {free / 1e9:.1f} GB free: "
            "make room (`edgetp rm`), or set HF_HUB_CACHE to a bigger disk"
        )


@contextlib.contextmanager
def _hub_errors(name: Name) -> Iterator[None]:
    """huggingface_hub's and httpx's errors as one line that says what to do."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = constants.ENDPOINT
    unreachable = (
        f"the hub at {hub} cannot be reached while pulling {name}: check the network, set "
        "HF_ENDPOINT to a mirror that can be, or give --model a local path"
    )
    try:
        yield
    except GatedRepoError:
        raise ModelError(
            f"{name.repo} is gated: accept its terms on {hub}/{name.repo} and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"no model {name.repo} on the hub ({hub}), nor a local path of that name: check "
            "the name (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelError(f"{name.repo} has no main branch on the hub ({hub})") from None
    except OfflineModeIsEnabled:
        raise ModelError(
            f"{name} is not in the cache and HF_HUB_OFFLINE is set: pull it while online"
        ) from None
    except (httpx2.TransportError, LocalEntryNotFoundError):
        raise HubUnreachable(unreachable) from None
    except httpx2.HTTPStatusError as exc:
        raise ModelError(
            f"the hub at {hub} answered HTTP {exc.response.status_code} while fetching {name}"
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise ModelError(f"the hub at {hub} answered HTTP {status} while pulling {name}") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ModelError(
                f"the disk of {_cache_dir()} filled up while pulling {name}; nothing half-written "
                "was kept: make room (`edgetp rm`), or set HF_HUB_CACHE to a bigger disk"
            ) from None
        if "Consistency check failed" in str(exc):  # huggingface_hub's size check
            raise ModelError(
                f"a file of {name} arrived with the wrong size and was not kept: pull again"
            ) from None
        raise


# -- what is local ---------------------------------------------------------------------------


def _gguf_architecture(path: Path) -> str:
    """A GGUF file's `general.architecture`, read from its first keys (no tensor is read)."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return "?"
    if head[:4] != b"GGUF":
        return "?"
    at = 24  # magic, version, tensor count, key count
    try:
        (n_kv,) = struct.unpack_from("<Q", head, 16)
        for _ in range(min(n_kv, 64)):
            (n,) = struct.unpack_from("<Q", head, at)
            key = head[at + 8 : at + 8 + n].decode()
            at += 8 + n
            (kind,) = struct.unpack_from("<I", head, at)
            at += 4
            if kind == 8:  # a string
                (n,) = struct.unpack_from("<Q", head, at)
                if key == "general.architecture":
                    return head[at + 8 : at + 8 + n].decode()
                at += 8 + n
            elif kind in sizes:
                at += sizes[kind]
            else:  # an array: the architecture comes before the vocabulary's
                return "?"
    except (struct.error, UnicodeDecodeError):
        pass
    return "?"


def _hf_family(folder: Path) -> tuple[str, str]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "?", "?"
    text = config.get("text_config") or {}
    dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "?"
    return str(config.get("model_type", "?")), str(dtype).upper().replace("FLOAT", "F")


def local_models() -> list[LocalModel]:
    """Every model in the cache: each quant of a GGUF repository, each HF folder."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(_cache_dir())
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: -r.last_modified):
            if not revision.files:  # what a refused download left: no model
                continue
            sizes = {f.file_path.relative_to(revision.snapshot_path).as_posix(): f.size_on_disk
                     for f in revision.files}  # fmt: skip
            found += _models_of(repo.repo_id, revision.snapshot_path, sizes)
            break  # the newest revision: older ones are what `edgetp rm` removes with it
    return found


def _models_of(repo: str, snapshot: Path, sizes: dict[str, int]) -> list[LocalModel]:
    ggufs = _ggufs(sizes)
    if not ggufs:
        family, dtype = _hf_family(snapshot)
        fmt = "safetensors" if "config.json" in sizes else "other"
        return [LocalModel(repo, sum(sizes.values()), fmt, family, dtype, snapshot)]
    models, seen = [], set()
    for f in ggufs:
        parts = _parts(f, ggufs)
        if parts[0] in seen:
            continue
        seen.add(parts[0])
        quant = quant_of(parts[0])
        models.append(
            LocalModel(
                f"{repo}:{quant}" if quant else repo,
                sum(sizes[p] for p in parts),
                "gguf" + (f" ({len(parts)} parts)" if len(parts) > 1 else ""),
                _gguf_architecture(snapshot / parts[0]),
                quant or "?",
                snapshot / parts[0],
            )
        )
    return models


_MIRRORED_URL = re.compile(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)$")


def mirrored_models(folder: Path) -> list[LocalModel]:
    """The sparse mirrors in `folder` (`mirror`, or a worker's of its share): a GGUF file, or a
    folder of a split GGUF's parts or of an HF model's files; each named as the hub names it,
    with the bytes it holds."""
    found = []
    for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
        files = sorted(entry.iterdir()) if entry.is_dir() else [entry]
        records = {f: _mirror_record(f) for f in files if not f.name.endswith(SIDECAR)}
        mirrored = [(f, r) for f, r in records.items() if r is not None]
        if not mirrored:
            continue
        _, (repo, file, _, _) = mirrored[0]
        # the fetched bytes, and the files kept whole (an HF model's config, its records)
        held = sum(r[3] for _, r in mirrored)
        held += sum(f.stat().st_size for f in files if f in records and records[f] is None)
        whole = sum(r[2] for _, r in mirrored)
        if file.endswith(".gguf"):
            quant = quant_of(PurePosixPath(file).name)
            parts = f", {len(mirrored)} parts" if len(mirrored) > 1 else ""
            first = min(f for f, _ in mirrored)
            found.append(LocalModel(f"{repo}:{quant}" if quant else repo, held,
                                    f"gguf (byte ranges{parts})", _gguf_architecture(first),
                                    quant or "?", entry, whole))  # fmt: skip
        else:
            family, dtype = _hf_family(entry)
            found.append(LocalModel(repo, held, "safetensors (byte ranges)", family, dtype, entry,
                                    whole))  # fmt: skip
    return found


def _mirror_record(path: Path) -> tuple[str, str, int, int] | None:
    """A mirror's repository, file, size and bytes present, from its record; None for a file
    that is no mirror."""
    sidecar = path.with_name(path.name + SIDECAR)
    try:
        record = json.loads(sidecar.read_text())
        found = _MIRRORED_URL.search(str(record["url"]))
        present = sum(int(b) - int(a) for a, b in record["present"])
        size = int(record["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (found[1], found[2], size, present) if found else None


def remove_mirrors(name: Name, folder: Path) -> int:
    """Remove the mirrors in `folder` of what `name` means (a quant; without one, every mirror
    of the repository). Returns the bytes they held."""
    freed = 0
    for model in mirrored_models(folder):
        if model.name.partition(":")[0] == name.repo and (
            name.quant is None or _mirrors(model, name)
        ):
            freed += model.size
            if model.path.is_dir():
                shutil.rmtree(model.path)
            else:
                model.path.with_name(model.path.name + SIDECAR).unlink(missing_ok=True)
                model.path.unlink()
    return freed


def remove(name: Name, mirrors: Path | None = None) -> int:
    """Remove a model from the cache: with a quant, that quant's files (the blobs no other
    snapshot points to); without, the whole repository, every revision. Its mirrors in
    `mirrors` go too. Returns bytes freed."""
    freed = remove_mirrors(name, mirrors) if mirrors is not None else 0
    try:
        return freed + _remove_cached(name)
    except ModelError:
        if freed:  # the name was mirrored here, not cached
            return freed
        raise


def _remove_cached(name: Name) -> int:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(_cache_dir())
    except CacheNotFound:
        info = None
    repo = next(
        (r for r in (info.repos if info else ()) if r.repo_type == "model"
         and r.repo_id == name.repo),
        None,
    )  # fmt: skip
    if repo is None or info is None:
        raise ModelError(f"{name.repo} is not in the cache ({_cache_dir()}): see `edgetp models`")
    if name.quant is None:
        strategy = info.delete_revisions(*(r.commit_hash for r in repo.revisions))
        strategy.execute()
        return strategy.expected_freed_size
    doomed: set[Path] = set()
    for revision in repo.revisions:
        names = [f.file_path.relative_to(revision.snapshot_path).as_posix() for f in revision.files]
        try:
            chosen = select(names, name)
        except ModelError:
            continue
        doomed |= {revision.snapshot_path / f for f in chosen.files}
    if not doomed:
        raise ModelError(
            f"{name} is not in the cache; there are: "
            f"{', '.join(m.name for m in _models_of_repo(repo)) or 'none'}"
        )
    blobs = {p.resolve() for p in doomed}
    for p in doomed:
        p.unlink()
    kept = {p.resolve() for p in Path(repo.repo_path, "snapshots").rglob("*") if p.is_symlink()}
    freed = 0
    for blob in blobs - kept:
        freed += blob.stat().st_size
        blob.unlink()
    if not any(_ggufs(_snapshot_files(Path(repo.repo_path, "snapshots")))):
        shutil.rmtree(repo.repo_path)  # nothing of the model is left: no empty husk either
    return freed


def _models_of_repo(repo: Any) -> list[LocalModel]:
    found: list[LocalModel] = []
    for revision in repo.revisions:
        sizes = {f.file_path.relative_to(revision.snapshot_path).as_posix(): f.size_on_disk
                 for f in revision.files}  # fmt: skip
        found += _models_of(repo.repo_id, revision.snapshot_path, sizes)
    return found
