"""A device's table of kernel verdicts: for each (shape, rows, threads), each candidate's result
and time, the kernels that crashed here, and which one is chosen.

`node.device.prepare` fills it and keeps it as a JSON file in the state folder, one per device
fingerprint; `describe` shows it (`edgetp kernels`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgetp.models.dtypes import SHARD_DTYPES
from edgetp.models.kernels import CANDIDATES, ROW_BUCKETS, Candidate, activations

Shape = tuple[str, int, int]  # (dtype name, out, in): one stored matrix


def table_path(cache_dir: Path, device: dict[str, str]) -> Path:
    """The file in `cache_dir` that holds the table of the device `device` describes."""
    key = hashlib.sha256(json.dumps(device, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{key}.json"


def entry_key(shape: Shape, bucket: int, threads: int) -> str:
    """The table's key of `shape` at row bucket `bucket` and `threads` BLAS threads."""
    dtype, out, inp = shape
    low, high = ROW_BUCKETS[bucket]
    rows = (
        str(low)
        if low == high
        else f"{low}+"
        if bucket == len(ROW_BUCKETS) - 1
        else f"{low}-{high}"
    )
    return f"{dtype} {out}x{inp} rows {rows} threads {threads}"


@dataclass
class Table:
    """Every measured (shape, rows, threads): each candidate's verdict and time."""

    device: dict[str, str]
    results: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    crashed: dict[str, str] = field(default_factory=dict)  # candidate -> what happened

    def chosen(self, key: str, among: Iterable[str] | None = None) -> str | None:
        """The fastest candidate that passed (of `among`, when given)."""
        allowed = None if among is None else set(among)
        timed = [
            (r["us"], name)
            for name, r in self.results.get(key, {}).items()
            if r["ok"] and name not in self.crashed and (allowed is None or name in allowed)
        ]
        return min(timed)[1] if timed else None


@dataclass
class Prepared:
    """What `node.device.prepare` did: the table, how many (candidate, shape, rows) it checked
    now (0 when all was cached), and how long the call took."""

    table: Table
    checked: int
    seconds: float


def pick(
    table: Table, key: str, candidates: Sequence[Candidate], activations: str = "exact"
) -> Candidate | None:
    """The fastest candidate of `activations` that passed, else the fastest exact one; a
    fallback only when no other did (never the fastest by a fluke of timing)."""
    usable = [c for c in candidates if c.activations in (activations, "exact")]
    name = (
        table.chosen(
            key, (c.name for c in usable if c.activations == activations and not c.fallback)
        )
        or table.chosen(key, (c.name for c in usable if not c.fallback))
        or table.chosen(key, (c.name for c in usable))
    )
    return next((c for c in candidates if c.name == name), None)


def read_table(path: Path, device: dict[str, str]) -> Table:
    """The table kept at `path`, if it is `device`'s; else an empty one."""
    try:
        d = json.loads(path.read_text())
        if d.get("device") == device:
            return Table(device, d["results"], d["crashed"])
    except (OSError, ValueError, KeyError):
        pass  # absent or unreadable: check again
    return Table(device)


def describe(prepared: Prepared, shapes: Iterable[Shape], threads: int) -> str:
    """The table as text: per dtype, each candidate's time per call or why it was rejected;
    the chosen one is starred."""
    t = prepared.table
    lines = [
        f"device: {t.device['cpu']} (flags {t.device['flags']}), {t.device['machine']}, "
        f"python {t.device['python']}, torch {t.device['torch']}, numpy {t.device['numpy']}; "
        f"BLAS {t.device['blas']}, {threads} thread(s)",
        f"checked and timed now: {prepared.checked} in {prepared.seconds:.1f} s"
        if prepared.checked
        else f"read from the cache in {prepared.seconds * 1000:.0f} ms",
    ]
    for dtype in sorted({s[0] for s in shapes}, key=SHARD_DTYPES.index):
        names = [c.name for c in CANDIDATES[dtype]]
        lines += ["", f"{dtype}: time per call (us); * chosen", f"{'matrix':>12} {'rows':>5}"]
        lines[-1] += "".join(f"{n:>16}" for n in names)
        for shape in sorted(s for s in shapes if s[0] == dtype):
            for b in range(len(ROW_BUCKETS)):
                key = entry_key(shape, b, threads)
                picked = pick(t, key, CANDIDATES[dtype], activations())
                chosen, results = picked and picked.name, t.results.get(key, {})
                row = f"{shape[1]:>6}x{shape[2]:<5} {key.split(' rows ')[1].split()[0]:>5}"
                for n in names:
                    r = results.get(n)
                    if r is None:
                        cell = "crashed" if n in t.crashed else "-"
                    elif r["ok"]:
                        cell = ("*" if n == chosen else "") + f"{r['us']:.0f}"
                    else:
                        cell = "wrong" if r["error"].startswith("wrong") else "crashed"
                    row += f"{cell:>16}"
                lines.append(row)
    for name, what in t.crashed.items():
        lines.append(f"rejected on this device: {name}: {what}")
    lines.append("'-': not a candidate at those rows, or a fallback where another passed")
    return "\n".join(lines)
