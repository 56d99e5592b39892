"""Files on a device's disk: where its state lives, and writes that leave no half-written file.

No torch and no numpy here: the chat app and the CLI's parser import this at start-up.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import time
from pathlib import Path

DISK_PROBE_BYTES = 16 << 20  # the probe's file, read again from its start as long as it takes
# A read-rate limit lets a first burst through (blkio's throttle one slice of 100 ms of its rate,
# a drive its cache): the probe counts nothing in its first DISK_BURST_SECONDS. Counting from the
# start, a 16 MB probe under a 100 MB/s limit read 120-322 MB/s, the first probe of a device the
# most. Then it reads windows of DISK_WINDOW_SECONDS until two in a row agree within
# DISK_WINDOWS_AGREE, at most DISK_WINDOWS of them: a disk shared with other work stalls at moments
# (a window read 7.5 MB/s at a 100 MB/s limit while other processes wrote), and a throttle lets
# what it held back through after a stall (173 MB/s in the next one).
DISK_BURST_SECONDS = 0.1
DISK_WINDOW_SECONDS = 0.3
DISK_WINDOWS = 4
DISK_WINDOWS_AGREE = 0.15


def default_state_dir() -> Path:
    """Where this device keeps its keys, shards, kernel table and conversations."""
    return Path(os.environ.get("EDGETP_HOME", Path.home() / ".cache" / "edgetp"))


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` so that `path` is either absent or whole, created with `mode`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # local nodes of one device may race
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def measure_disk_read(folder: Path, size: int = DISK_PROBE_BYTES) -> float | None:
    """GB/s this device reads from the disk holding `folder`, past the page cache (O_DIRECT):
    what a streaming node's reads cost it, in the steady state after any first burst. Writes a
    probe file of `size` bytes there and removes it. None where that cannot be measured (a
    tmpfs, a file system without O_DIRECT)."""
    chunk = 1 << 20
    probe = folder / f".disk-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        data = os.urandom(chunk)  # not zeros: some disks and file systems compress them
        with open(probe, "wb") as f:
            for _ in range(size // chunk):
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            with mmap.mmap(-1, chunk) as buffer:  # page-aligned, as O_DIRECT asks
                rate = _steady_rate(fd, buffer)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):  # a probe that was never written, or a read-only disk
            probe.unlink()
    return rate / 1e9 if rate > 0 else None


def _steady_rate(fd: int, buffer: mmap.mmap) -> float:
    """Bytes/s read from `fd` past the burst: the mean of the first two windows in a row that
    agree, or where none do, the median of the windows (past a stall and what followed it).

    A window's rate is the slope of bytes against time: a throttle hands its rate out in clumps
    (blkio: ~10 MB at once every 100 ms at 100 MB/s), and the bytes between a first and a last
    read counted one clump more or less as it fell (98-141 MB/s at 100)."""
    rates: list[float] = []
    started = time.perf_counter()
    read, window = 0, []  # (seconds, bytes read by then) in this window
    while len(rates) < DISK_WINDOWS:
        if not (n := os.readv(fd, [buffer])):
            os.lseek(fd, 0, os.SEEK_SET)
            continue
        now, read = time.perf_counter(), read + n
        if now - started < DISK_BURST_SECONDS:
            continue
        window.append((now, read))
        if now - window[0][0] < DISK_WINDOW_SECONDS:
            continue
        rates.append(statistics.linear_regression(*zip(*window, strict=True)).slope)
        window = [(now, read)]  # the next window starts where this one ended
        if len(rates) >= 2 and abs(rates[-1] - rates[-2]) <= DISK_WINDOWS_AGREE * max(rates[-2:]):
            return statistics.fmean(rates[-2:])
    return statistics.median(rates)
