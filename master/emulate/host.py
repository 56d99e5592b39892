"""The machine that hosts emulated devices: what it must have, its cgroups, its tools.

Emulating a device needs root, the cgroup v1 controllers and iproute2 (`check_host` names what is
missing in one line). Here too are the small pieces every part of the emulation uses: a command
started inside cgroups, `ip`/`tc` run with a DeviceError naming what failed, the cgroup files read
back, and the sweep that removes what runs whose process is gone left behind (every name carries
the creating process's id).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from edgetp.master.emulate.spec import DeviceSpec
from edgetp.node.children import alive

log = logging.getLogger(__name__)

CGROUPS = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuset", "memory", "blkio")
_OURS = re.compile(r"edgetp-(\d+)-(\d+)")
_OUR_LINK = re.compile(r"etp(\d+)[bh]\d*")


class DeviceError(RuntimeError):
    """This machine cannot emulate the devices asked for; the message says what is missing."""


def check_host(specs: Sequence[DeviceSpec]) -> None:
    """One DeviceError line naming everything `specs` needs that this machine lacks."""
    if os.geteuid() != 0:
        raise DeviceError(
            "--device needs root (cgroups and network namespaces are root's): run as root, "
            "or leave --device out"
        )
    missing = [
        f"the cgroup v1 {c} controller at {CGROUPS / c}"
        for c in CONTROLLERS
        if not (CGROUPS / c / "cgroup.procs").is_file()
    ]
    if any(s.networked for s in specs):
        tools = [tool for tool in ("ip", "tc") if not shutil.which(tool)]
        missing += [f"the `{tool}` command (iproute2)" for tool in tools]
    if missing:
        raise DeviceError(f"--device needs {'; '.join(missing)}, which this machine lacks")


def own_cgroup(controller: str) -> Path:
    """This process's cgroup folder for a v1 controller."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return CGROUPS / controller / path.lstrip("/")
    return CGROUPS / controller


def in_cgroups(folders: Iterable[Path], cmd: Sequence[str]) -> list[str]:
    """`cmd` started in these cgroups (one per controller) before it runs anything."""
    moves = "; ".join(f"echo $$ > {shlex.quote(str(f / 'cgroup.procs'))}" for f in folders)
    return ["sh", "-c", f'{moves} && exec "$@"', "edgetp-device", *cmd]


def run_tool(*cmd: str, check: bool = True) -> str:
    """`cmd`'s output; a DeviceError naming it and its error output if it fails (`check`)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise DeviceError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def remove_cgroup(folder: Path) -> None:
    """Kills what is left in it and removes it (a cgroup with tasks cannot be removed)."""
    for _ in range(50):
        with contextlib.suppress(OSError, ValueError):
            for pid in (folder / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    log.warning("could not remove %s: processes are still in it", folder)


def remove_leftovers() -> list[str]:
    """Removes the cgroups, namespaces and links of runs whose process is gone; their names."""
    removed = []
    for controller in CONTROLLERS:
        parent = own_cgroup(controller)
        for folder in parent.glob("edgetp-*-*"):
            match = _OURS.fullmatch(folder.name)
            if match and not alive(int(match.group(1))):
                remove_cgroup(folder)
                removed.append(str(folder))
    if shutil.which("ip"):
        for line in run_tool("ip", "netns", "list", check=False).splitlines():
            name = line.split()[0] if line.split() else ""
            match = _OURS.fullmatch(name)
            if match and not alive(int(match.group(1))):
                for pid in run_tool("ip", "netns", "pids", name, check=False).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                run_tool("ip", "netns", "del", name, check=False)
                removed.append(name)
        for line in run_tool("ip", "-o", "link", "show", check=False).splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            match = _OUR_LINK.fullmatch(name)
            if match and not alive(int(match.group(1))):
                run_tool("ip", "link", "del", name, check=False)
                removed.append(name)
    return removed


def block_device(folder: Path) -> str:
    """ "major:minor" of the whole disk holding `folder` (blkio throttles disks, not partitions).
    A folder the run has yet to create will be on its nearest existing parent's disk."""
    st = os.stat(next(p for p in (folder, *folder.parents) if p.exists()))
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not sys_dev.exists():
        raise DeviceError(
            f"disk=: {folder} is on no block device (a tmpfs or overlay?): "
            "give --state-dir a folder on a disk"
        )
    if (sys_dev / "partition").exists():
        sys_dev = sys_dev.resolve().parent
    return (sys_dev / "dev").read_text().strip()


def cpu_list(text: str) -> list[int]:
    """The cores of a cpuset list such as "0-3,6"."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    return cores


def threads_cpu_seconds(tasks: Path) -> float:
    """The CPU time of the threads listed in a cgroup's `tasks` file (a thread gone since it
    was listed counts nothing)."""
    total_ns = 0
    for tid in tasks.read_text().split():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total_ns += int(Path(f"/proc/{tid}/task/{tid}/schedstat").read_text().split()[0])
    return total_ns / 1e9


def keyed(path: Path) -> dict[str, int]:
    """A cgroup file of `key value` lines."""
    values = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            values[key] = int(value)
    return values
