"""Memory sizes as people write them (`2GB`, `512MiB`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes in `text`, e.g. "2GB", "1.5 GiB", "800m"; a clear ValueError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 2GB, 512MiB or 800MB")
    return int(float(match.group(1)) * _UNITS[unit])


UNLIMITED = 1 << 62  # a cgroup v1 memory limit at or above this is none


RESERVE_BYTES = 64 * 2**20  # the least a limited device keeps for its work beside weights


def device_memory_budget() -> int | None:
    """What this process may still fill with weights and KV cache when a cgroup limits its
    memory (a container, an emulated device): the limit, less what the cgroup holds that the
    kernel cannot give back (its anonymous and shared memory) and a tenth of the limit (at
    least RESERVE_BYTES) for the rest of the work; None without a limit.

    What the cgroup holds, not what this process holds: the limit binds the cgroup, other
    processes in it included, and a process that entered it after it started (an emulated
    master) left what it held then charged outside it, where the limit does not bind. The page
    cache counts toward the limit too, but the kernel gives it back before it kills.
    """
    found = _memory_cgroup()
    if found is None:
        return None
    limit, held = found
    return max(0, limit - held - max(RESERVE_BYTES, limit // 10))


def machine_memory_budget() -> int | None:
    """What this process may fill: `device_memory_budget` under a cgroup limit, else the
    memory the kernel says is available (MemAvailable) less a tenth of it; None where neither
    can be read."""
    limited = device_memory_budget()
    if limited is not None:
        return limited
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                return available - available // 10
    except (OSError, ValueError, IndexError):
        pass
    return None


# Per cgroup version: its memory controller's root, its limit's file, the memory.stat keys of
# what the kernel cannot reclaim (anonymous and shared memory, the cgroup's subtree in), and the
# file that counts its out-of-memory kills.
_CGROUP_V1 = (
    Path("/sys/fs/cgroup/memory"),
    "memory.limit_in_bytes",
    ("total_rss", "total_shmem"),
    "memory.oom_control",
)
_CGROUP_V2 = (Path("/sys/fs/cgroup"), "memory.max", ("anon", "shmem"), "memory.events")


def _memory_cgroups() -> Iterator[tuple[Path, tuple[Path, str, tuple[str, ...], str]]]:
    """This process's memory cgroup folder, with its version's files (`_CGROUP_V1`, `_V2`)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            version = _CGROUP_V1
        elif controllers == "":
            version = _CGROUP_V2
        else:
            continue
        yield version[0] / path.lstrip("/"), version


def _memory_cgroup() -> tuple[int, int] | None:
    """This process's memory cgroup limit and what the cgroup holds that cannot be reclaimed,
    bytes; None if no cgroup limits it."""
    for folder, (_, limit_file, held_keys, _) in _memory_cgroups():
        try:
            limit = (folder / limit_file).read_text().strip()
            stat = dict(row.split() for row in (folder / "memory.stat").read_text().splitlines())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < UNLIMITED:
            return int(limit), sum(int(stat.get(key, 0)) for key in held_keys)
    return None


def oom_kills() -> int | None:
    """How many processes the out-of-memory killer has ended in this process's memory cgroup
    (a container, the machine's session), or None where that is not counted."""
    for folder, (*_, events_file) in _memory_cgroups():
        try:
            events = dict(row.split() for row in (folder / events_file).read_text().splitlines())
            return int(events["oom_kill"])
        except (OSError, ValueError, KeyError):
            continue
    return None


class BudgetError(ValueError):
    """A memory budget too small for the work."""


MIN_CONTEXT = 64  # tokens: below this a node is of no use, and the budget is an error


def format_size(n: float) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryPlan:
    """What a node keeps in memory: `window` layers of its slice and a KV cache of `context`."""

    window: int
    context: int


def plan_memory(
    budget: int | None,
    layer_bytes: int,
    n_layers: int,
    kv_bytes_per_token: int,
    context: int,
    fixed_bytes: int = 0,
    window: int | None = None,
    who: str = "this node",
    fixed_what: str = "the embedding and lm_head",
) -> MemoryPlan:
    """The window and context a memory budget allows.

    The budget covers what edgetp allocates: the window's layer buffers, the KV cache and what
    is held whatever the window and context (`fixed_bytes`, named by `fixed_what`: on the
    master the embedding and lm_head; local layers' KV rings; a gated DeltaNet's state per
    sequence); not the Python runtime. The
    window takes what the full KV cache leaves; if that is under two layers (one computing, one
    loading), the context shrinks instead, down to MIN_CONTEXT. A forced `window` is kept and
    the context fits around it.
    """
    if budget is None:
        return MemoryPlan(min(window or n_layers, n_layers), context)
    free = budget - fixed_bytes
    if window is not None:
        w = min(window, n_layers)
    else:
        w = max(2, min(n_layers, (free - kv_bytes_per_token * context) // max(layer_bytes, 1)))
        w = min(w, n_layers)
    fits = (free - w * layer_bytes) // max(kv_bytes_per_token, 1)
    if fits < MIN_CONTEXT:
        need = fixed_bytes + w * layer_bytes + kv_bytes_per_token * MIN_CONTEXT
        globals_ = f", {fixed_what} ({format_size(fixed_bytes)})" if fixed_bytes else ""
        raise BudgetError(
            f"{who}: a memory budget of {format_size(budget)} cannot hold {w} layers of its "
            f"slice ({format_size(layer_bytes)} each){globals_} and a KV cache of "
            f"{MIN_CONTEXT} tokens ({format_size(kv_bytes_per_token)} per token): "
            f"give --memory-budget {format_size(need)} or more (under a memory limit, a "
            "container's or --device mem=, a limit that leaves that much beside the process)"
        )
    return MemoryPlan(w, min(context, int(fits)))


@dataclass(frozen=True)
class MemoryOptions:
    """How a node holds its weights, as given on the command line."""

    budget: int | None = None  # bytes; None: no limit
    window: int | None = None  # layers in memory, forced; None: derived from the budget
    dtype: str = "f32"  # shard dtype, chosen at split time (master only)
    drop_cache: bool = False  # drop each shard from the page cache after reading it
    kv_cache: str = "f32"  # how every node stores keys and values (models/kvformat.py), or "auto"
    # how the block products take their input (models/activations.py): "exact", "int8" or
    # "auto" (int8 for a model in 4- to 6-bit blocks), set for the whole process when the
    # master plans, and told to every node
    activations: str = "exact"
    # which device holds attention (master.cluster.plan.choose_attention): "split" across the
    # devices as the FFN is, every head on the "master" (one sum a layer), or "auto" by the
    # measured links and speeds (master only)
    attention: str = "auto"
    # what a sum's messages carry (node.messages.for_the_wire): "float32", or "float16" at half
    # the bytes; the master's choice, the workers answering in kind
    wire: str = "float32"

    @property
    def streaming(self) -> bool:
        """Whether weights must come from shard files rather than straight from the model (how
        the KV cache is stored, the products' input, where attention goes and what the sums
        send have no say in it: one device holds all of it)."""
        kept = replace(
            self,
            kv_cache=ALL_RESIDENT.kv_cache,
            activations=ALL_RESIDENT.activations,
            attention=ALL_RESIDENT.attention,
            wire=ALL_RESIDENT.wire,
        )
        return kept != ALL_RESIDENT

    def node_args(self) -> list[str]:
        """The same options for a local worker's command line."""
        args = []
        if self.budget is not None:
            args += ["--memory-budget", str(self.budget)]
        if self.window is not None:
            args += ["--window", str(self.window)]
        if self.drop_cache:
            args.append("--drop-cache")
        return args


ALL_RESIDENT = MemoryOptions()  # the default: no budget, every layer in memory, float32
# Every layer in memory as the model file stores it (a GGUF's blocks, run by their kernels): what
# `models.source.default_dtype`, the one rule, gives a GGUF file where the C kernels build.
FILE_TYPES = MemoryOptions(dtype="auto")
