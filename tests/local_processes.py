"""Finding a local cluster's worker processes from outside its master."""

from __future__ import annotations

from pathlib import Path

PREFIX = "edgetp-"  # node/children.py names a local worker `edgetp-local-N`


def process_state(pid: int) -> str:
    """A process's state letter ("Z": exited, not yet reaped), "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


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
