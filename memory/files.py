"""Files on a device's disk: where its state lives, and writes that leave no half-written file.

No torch and no numpy here: the chat app and the CLI's parser import this at start-up.
"""

from __future__ import annotations

import os
from pathlib import Path


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
