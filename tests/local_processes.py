"""Finding a local cluster's worker processes from outside its master."""

from __future__ import annotations

from pathlib import Path

PREFIX = "edgetp-"  # node/children.py names a local worker `edgetp-local-N`


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state, parent pid, ...); [] when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def process_state(pid: int) -> str:
    """A process's state letter ("Z": exited, not yet reaped), "" when it is gone."""
    return (_stat(pid) or [""])[0]


def parent_pid(pid: int) -> int:
    """The process's parent (0 when it is gone)."""
    fields = _stat(pid)
    return int(fields[1]) if fields else 0


def local_workers(pid: int) -> dict[str, int]:
    """The live local workers under process `pid` (its descendants: they are forked by its fork
    server, not by it), name -> pid."""
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:
                continue  # the thread or process ended meanwhile
            for kid in kids:
                todo.append(kid)
                try:
                    name = Path(f"/proc/{kid}/comm").read_text().strip()
                except OSError:
                    continue
                if name.startswith(PREFIX + "local-") and process_state(kid) not in ("Z", ""):
                    found[name.removeprefix(PREFIX)] = kid
    return found
