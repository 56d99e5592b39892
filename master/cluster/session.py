"""A master's cluster for its whole life (`Session`), and the planning and loading it does."""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path

import msgspec

from edgetp.master.cluster.engine import Engine, context_size
from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.membership import Failed, Member
from edgetp.master.cluster.plan import (
    ATTENTION_MATRICES,
    AttentionChoice,
    SplitEstimate,
    choose_attention,
    head_row_cost,
    head_rows,
    kept_token_s,
    layers_size,
    plan_slices,
    split_estimate,
    with_disk_reads,
    with_messages,
    workers_to_plan,
)
from edgetp.master.cluster.transport import ClusterError
from edgetp.memory.budget import (
    ALL_RESIDENT,
    BudgetError,
    MemoryOptions,
    MemoryPlan,
    device_memory_budget,
    plan_memory,
)
from edgetp.memory.files import atomic_write, default_state_dir
from edgetp.memory.shards import Manifest, ShardStore
from edgetp.memory.splitter import model_identity, split_model
from edgetp.memory.window import keep_imports_out_of_collections, return_freed_memory
from edgetp.models.config import ModelConfig
from edgetp.models.errors import ModelError
from edgetp.models.kernels import blas_threads, set_activations
from edgetp.models.layers import Slice
from edgetp.models.source import ModelSource, model_activations
from edgetp.node import messages as M
from edgetp.node.device import plan_shapes, prepare
from edgetp.node.kvcache import KVCache, LinearStates
from edgetp.node.messages import Capacity
from edgetp.node.probes import measure_capacity, measure_speed

log = logging.getLogger(__name__)


# Measured speeds move from one start to the next (node.probes): a cpu=0.5 device measured
# 6.2-7.4 GB/s alone and 4.2-4.7 while another core streamed beside it. The last measured plan
# (same model, dtype and node count) is kept, and with it the split, unless by this start's
# figures a new plan would make a token this much faster: re-splitting a 70B model costs far
# more than a node a fifth off its share.
REPLAN_GAIN = 0.5
# What the kept plans' records are named by: changed with the rules that turn measured figures
# into capacities (3: the lm_head split by vocabulary, the sums' messages counted; 4: every
# node's speed measured at one moment before a plan; 5: head rows by each link, kept with it).
PLAN_RULES = "rules5"


def keep_last_plan(
    record: Path, capacities: Sequence[float], head_costs: Sequence[float] | None = None
) -> tuple[list[float], list[float]]:
    """`capacities` and `head_costs` (what a head row costs each node, `head_row_cost`; 1 for
    all by default), or the last ones recorded at `record` while a plan made from
    `capacities` would not be REPLAN_GAIN faster and no head cost moved by REPLAN_GAIN. A
    plan's token takes its slowest node's share over that node's capacity; the plan made from
    `capacities` takes 1 / sum(capacities) on every node. What is returned is recorded for the
    next start."""
    costs = list(head_costs) if head_costs is not None else [1.0] * len(capacities)
    try:
        kept = json.loads(record.read_text())
        last = [float(c) for c in kept["capacities"]]
        last_costs = [float(c) for c in kept["head_costs"]]
    except (OSError, ValueError, TypeError, KeyError):
        last, last_costs = [], []
    if len(last) == len(capacities) == len(last_costs) and all(c > 0 for c in last + last_costs):
        slowest = max(c / sum(last) / now for c, now in zip(last, capacities, strict=True))
        steady = all(
            max(a, b) / min(a, b) <= 1 + REPLAN_GAIN for a, b in zip(last_costs, costs, strict=True)
        )
        if slowest <= (1 + REPLAN_GAIN) / sum(capacities) and steady:
            return last, last_costs
    text = json.dumps({"capacities": list(capacities), "head_costs": costs})
    atomic_write(record, text.encode())
    return list(capacities), costs


def _master_globals(config: ModelConfig, manifest: Manifest) -> str:
    """What the master's globals hold besides the norms, as its memory plan names them."""
    if config.tied_embeddings:
        return "the embedding (its lm_head too)"
    return "the embedding and " + ("its rows of the lm_head" if manifest.head_rows else "lm_head")


def _cluster_engine(
    source: ModelSource,
    hub: Hub | None,
    capacities: Sequence[float],
    state_dir: Path,
    max_context: int | None = None,
    slots: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
    memory: MemoryOptions = ALL_RESIDENT,
    head_costs: Sequence[float] | None = None,
    one_device: bool = False,
    first_plan: bool = True,
    attention_first: bool = False,
) -> Engine:
    """Plan for the master and the joined workers, split, ship, and build the master's engine.

    `capacities` has one entry per node, the master first. Without a hub, the master alone
    runs the whole model from its shards (streamed through a window if the memory says so).
    `one_device`: the workers are processes of this machine, as this device: they share its
    kernel table, so every node's kernels are checked here, in one child, before they are
    shipped (each worker would otherwise check its own, one after another), and its memory
    (`memory_plans`). A worker too small for its share fails a `first_plan` and the workers are
    told why; a re-plan goes on without it. `attention_first`: the master holds every head
    of attention (`plan_slices`).
    """
    context = context_size(source.config, max_context)
    # before any kernel is chosen and the workers are told
    set_activations(model_activations(source, memory.dtype, memory.activations))
    slices = plan_slices(source.config, capacities, source.ffn_align(memory.dtype), attention_first)
    # With workers, each node multiplies its rows of the lm_head: not the master alone, serially
    heads = (
        head_rows(source.config, slices, capacities, head_costs) if hub and hub.members else None
    )
    if one_device and heads is not None:
        prepare(plan_shapes(source, slices, memory.dtype, heads), install=False)
    store = ShardStore(state_dir / "shards")
    split_progress = (lambda d, t: progress("splitting", d, t)) if progress else None
    workers = None
    remote = source.remote()
    if hub is not None and hub.members and remote is not None:  # each its own slices' bytes
        files = {n: M.RemoteFile(r.url, r.size, r.etag, r.headers) for n, r in remote.files.items()}
        model = M.RemoteModel(files, remote.small)
        workers = partial(hub.split_shares, model, slices, memory.dtype, heads)
    manifest = split_model(source, slices, store, split_progress, memory.dtype, heads, workers)
    try:
        kv_format, plans = kv_format_plans(manifest, hub, context, slots, memory, one_device)
    except ModelError as exc:  # tell the workers why, or they only see the master go
        if hub is not None and not (isinstance(exc, WorkerTooSmall) and not first_plan):
            hub.close(reason=f"the master cannot run this plan: {exc}")
        raise  # a re-plan goes on without a worker that cannot hold its share
    context = min(p.context for p in plans)
    if hub is not None:
        hub.ship(
            manifest, store, context, slots, windows=[p.window for p in plans],
            kv_format=kv_format,
        )  # fmt: skip
    return Engine.from_manifest(
        manifest, store, context, slots, hub, plans[0].window, memory.drop_cache, kv_format
    )


# `--kv-cache auto`: the first of these whose cache holds the context asked for on every node.
KV_AUTO_FORMATS = ("f32", "f16", "q8_0")


def kv_format_plans(
    manifest: Manifest,
    hub: Hub | None,
    context: int,
    slots: int,
    memory: MemoryOptions,
    one_device: bool = False,
) -> tuple[str, list[MemoryPlan]]:
    """The KV cache's format and each node's plan (`memory_plans`): the format given, or for
    "auto" the first of KV_AUTO_FORMATS whose cache holds `context` on every node under its
    budget, else the one that holds the most; a format other than f32 is said at start."""
    if memory.kv_cache != "auto":
        return memory.kv_cache, memory_plans(manifest, hub, context, slots, memory, one_device)
    held: list[tuple[int, str, list[MemoryPlan]]] = []
    for kv_format in KV_AUTO_FORMATS:
        try:
            plans = memory_plans(
                manifest, hub, context, slots, replace(memory, kv_cache=kv_format), one_device
            )
        except ModelError:  # a budget too small even for a token's cache: a smaller format?
            if kv_format == KV_AUTO_FORMATS[-1] and not held:
                raise
            continue
        held.append((min(p.context for p in plans), kv_format, plans))
        if held[-1][0] >= context:
            break
    tokens, kv_format, plans = max(held, key=lambda h: h[0])  # the first of the most
    if kv_format != KV_AUTO_FORMATS[0]:
        f32 = next((f"f32 would hold {t}" for t, f, _ in held if f == "f32"), "f32 does not fit")
        log.warning(
            "KV cache %s, for %d tokens of context of the %d asked for (%s)",
            kv_format, tokens, context, f32,
        )  # fmt: skip
    return kv_format, plans


def memory_plans(
    manifest: Manifest,
    hub: Hub | None,
    context: int,
    slots: int,
    memory: MemoryOptions,
    one_device: bool = False,
) -> list[MemoryPlan]:
    """Each node's window and context under its budget (the master's from `memory`, the
    workers' from their HELLO), all with the smallest context any of them can hold.

    `one_device`: the workers are processes of this machine, in its memory cgroup. Without a
    budget given, each read the limit less what the cgroup held as its own, and all of them
    planned to fill the same memory: `edgetp run --local-nodes 2` in a 500 MB cgroup planned
    the master 2 layers and its worker all 30, and the kernel killed the master, with no word
    said. There, what the limit leaves when the master plans is split evenly between the nodes.

    Decided here, on the master, because only the master knows every node's slice size; a
    budget too small for some node is an error naming it.
    """
    config = ModelConfig.from_dict(manifest.config)
    members = hub.members if hub is not None else []
    names = ["the master", *(f"node {m.name}" for m in members)]
    own = memory.budget if memory.budget is not None else device_memory_budget()
    budgets = [own, *(m.capacity.memory_budget for m in members)]
    if one_device and memory.budget is None and own is not None:  # one limit for them all
        budgets = [own // len(budgets)] * len(budgets)
    windows = [memory.window, *(m.capacity.window for m in members)]

    def plan(k: int, ctx: int) -> MemoryPlan:
        try:
            return plan_node(k, ctx)
        except BudgetError as exc:
            if k == 0:
                raise ModelError(str(exc)) from exc
            raise WorkerTooSmall(members[k - 1], str(exc)) from exc

    def plan_node(k: int, ctx: int) -> MemoryPlan:
        s = Slice.from_dict(manifest.slices[k])
        # Each sequence's, whatever the context: the local layers' rings, a linear attention's state
        fixed = KVCache.window_bytes(config, s, memory.kv_cache) * slots
        state = LinearStates.slot_bytes(config, s) * slots
        return plan_memory(
            budgets[k],
            max(r.size for r in manifest.nodes[k]),
            config.n_layers,
            KVCache.bytes_per_token(config, s, memory.kv_cache) * slots,
            ctx,
            fixed_bytes=fixed + (manifest.globals.size if k == 0 else manifest.head_size(k)),
            window=windows[k],
            who=names[k],
            fixed_what=" and ".join(
                ([_master_globals(config, manifest)] if k == 0 else [])
                + (["its rows of the lm_head"] if k and manifest.head_size(k) else [])
                + (["the local layers' KV rings"] if fixed > state else [])
                + (["the gated DeltaNet layers' state"] if state else [])
            ),
        )

    layers = manifest.nodes[0]
    first = [plan(k, context) for k in range(len(names))]
    smallest = min(p.context for p in first)
    plans = [plan(k, smallest) for k in range(len(names))]
    for name, p in zip(names, plans, strict=True):
        log.info(
            "%s: %d of %d layers in memory, context %d", name, p.window, len(layers), p.context
        )
    return plans


class WorkerTooSmall(ModelError):
    """A worker's memory budget cannot hold its share of the plan (the message says what
    would); a re-plan goes on without it."""

    def __init__(self, member: Member, message: str) -> None:
        super().__init__(message)
        self.member = member


class Session:
    """The master's cluster for its whole life: the hub and who has joined, the plan, the
    shards and the engine.

    Every front runs through one (`edgetp run`, `master`, `serve` and so the chat, local
    clusters, the tests), and re-planning happens here alone, between steps only: when nodes
    joined or left (`replan_if_changed`, called while no request runs) or after a node failed
    mid-step (`replan`). Without a hub the master runs alone for good.
    """

    def __init__(
        self,
        source: ModelSource,
        hub: Hub | None = None,
        state_dir: Path | None = None,
        context: int | None = None,
        slots: int = 1,
        memory: MemoryOptions = ALL_RESIDENT,
        capacities: Sequence[float] | None = None,
        equal_shares: bool = False,
        progress: Callable[[str, int, int], None] | None = None,
        standby: bool = True,
        one_device: bool = False,
    ) -> None:
        """`capacities` (the master first) hold while the node count matches them; otherwise
        the shares are equal (`equal_shares`: processes of one machine) or measured per device,
        and then a device whose link would slow every token is left on standby (unless not
        `standby`: a benchmark of node counts times the split it asked for). With
        `one_device` (workers that are processes of this machine as this device) each plan
        checks every node's kernels in the master and splits the device's memory limit.
        """
        self.source = source
        self.hub = hub
        if hub is not None:
            hub.transport.wire = memory.wire
        self.state_dir = state_dir or default_state_dir()
        self.context = context
        self.slots = slots
        self.memory = memory
        self.given_capacities = list(capacities) if capacities else None
        self.equal_shares = equal_shares
        self.progress = progress
        self.standby = standby
        self.one_device = one_device
        self.engine: Engine | None = None
        self.max_context = context_size(source.config, context)  # the plan's, once planned
        self._master_capacity: Capacity | None = None
        self.planned_capacities = [1.0]  # what the current plan split by, the master first
        self.planned_head_costs: list[float] | None = None  # and its head rows by, if measured
        self.split_estimate: SplitEstimate | None = None  # what the probes said of the split
        self.attention = AttentionChoice(False, "split: one device")  # the plan's, and why
        # The workers the last measured plan left on standby, or (not free to: `standby`
        # False) would have: names, for the record.
        self.standby_choice: list[str] = []
        self._planned = False  # a plan was made: a worker too small for a later one is left out
        # Out of the collections of its re-plans, which hold the GIL and with it the heartbeats
        # (`return_freed_memory`): what it holds now. `close` puts it back in.
        keep_imports_out_of_collections()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def config(self) -> ModelConfig:
        return self.source.config

    @property
    def nodes(self) -> int:
        """The master and the workers of the current plan."""
        return 1 + (len(self.hub.members) if self.hub else 0)

    @property
    def can_replan(self) -> bool:
        return self.hub is not None

    def start(
        self, workers: int = 0, timeout: float = 600.0, check: Callable[[], None] | None = None
    ) -> Engine:
        """Wait until `workers` have joined (0: plan for whoever is here), then plan and load.
        `check` raises when a worker can no longer join (a local worker that died)."""
        if self.hub is None and workers:
            raise ValueError("workers join a session through its hub: this one has none")
        if self.hub is not None and workers:
            self.hub.wait_for_workers(workers, timeout, check)
        return self._plan()

    def replan_if_changed(self, wait: float = 0.0) -> bool:
        """Between requests: take in joins and leaves (waiting up to `wait` s) and re-plan if
        the members changed. True when the engine was rebuilt."""
        if self.hub is None or not self.hub.watch_membership(wait):
            return False
        before = self.hub.shipped_bytes
        self.replan()
        shipped = self.hub.shipped_bytes - before
        log.warning("re-planned for %d node(s); shipped %d bytes", self.nodes, shipped)
        return True

    def answer_joins(self) -> bool:
        """While requests run: tell devices that say HELLO they are in (they give up on a
        master silent for 30 s). True when the plan no longer matches the members: the caller
        re-plans at its next step boundary."""
        return self.hub is not None and self.hub.watch_membership(0.0)

    def replan(self) -> Engine:
        """Plan again for the nodes here now (after a failure, or joins and leaves). A node
        lost during the re-plan itself (another kill, a link down while shards load) is left
        out of the next try, until the master alone is left to fail."""
        if self.hub is None:
            raise ClusterError("this master runs alone: there are no nodes to re-plan for")
        for tries_left in range(self.nodes + len(self.hub.pending) - 1, -1, -1):
            self._close_engine()  # before the new one loads: a device cannot hold both
            return_freed_memory()
            try:
                return self._plan()
            except WorkerTooSmall as exc:  # told so, and not asked to join again
                if not tries_left:
                    raise
                self.hub.apply(exc.member, Failed(str(exc), rejoin=False))
                log.error("%s; re-planning without it", exc)
            except ClusterError as exc:
                if not tries_left:
                    raise
                log.error("re-planning failed: %s; re-planning again without it", exc)
        raise AssertionError("unreachable: the last try raises")

    def plan_shares(self) -> tuple[list[float], list[float] | None]:
        """Each node's weight in the split, the master first, and, where the devices were
        measured, what a row of the lm_head costs each (`head_row_cost`: a worker's logits
        cross its link). Measured: every node's speed and link are probed now
        (`_measure_devices`), the members whose links would slow every token go on standby
        (`_leave_out_slow_links`: the weights are then the others'), and the plan is kept in
        the state folder for the next start (`keep_last_plan`)."""
        members = self.hub.members if self.hub else []
        if self.given_capacities and len(self.given_capacities) == 1 + len(members):
            return list(self.given_capacities), None
        if self.hub is None or self.equal_shares or not members:
            return [1.0] * (1 + len(members)), None
        devices = self._measure_devices(self.hub)
        config = self.config
        size, weights = layers_size(self.source, self.memory.dtype)
        speeds = [c.score() for c in devices]
        if any(c.disk for c in devices):  # some may stream their slice: their disks count
            speeds = with_disk_reads(
                speeds,
                [c.disk for c in devices],
                [c.memory_budget for c in devices],
                [c.window is not None and c.window < config.n_layers for c in devices],
                size,
                weights,
            )
        model_gb = (weights + config.vocab_size * config.hidden) * 4 / 1e9  # float32, as speeds
        sums = 2 * config.n_layers + 1
        timed = [m.link.rtt_s for m in self.hub.members if m.link is not None]
        self.split_estimate = split_estimate(speeds, model_gb, sums, timed) if timed else None
        budgets = [c.memory_budget for c in devices]
        kept = self._leave_out_slow_links(speeds, budgets, size, model_gb, sums)
        if len(kept) < len(devices) - 1:
            if not kept:
                return [1.0], None
            devices = [devices[0], *(devices[1 + k] for k in kept)]
            speeds = [speeds[0], *(speeds[1 + k] for k in kept)]
        elif self.split_estimate and self.split_estimate.split_s > self.split_estimate.alone_s:
            e = self.split_estimate
            log.warning(
                "the sums cost ~%.0f ms a token (%d at the slowest worker's round trip, %.0f us), "
                "more than the split saves (~%.0f ms of compute a token on the master alone, "
                "~%.0f split): tokens will likely come slower than on the master alone; nearer "
                "or faster links, or fewer devices, would help",
                e.sums_s * 1e3, sums, max(timed) * 1e6, e.alone_s * 1e3, e.compute_s * 1e3,
            )  # fmt: skip
        if self.memory.attention == "auto" and len(devices) > 1:
            planned = [timed[k] for k in kept] if len(timed) == len(members) else timed
            # a sum: the slowest worker's round trip, and the master's messages to each
            sum_s = max(planned, default=0.0) + 2 * (len(devices) - 1) * devices[0].message_s
            attention_bytes = layers_size(self.source, self.memory.dtype, ATTENTION_MATRICES)[0]
            self.attention = choose_attention(
                config, speeds, sum_s, attention_bytes, devices[0].memory_budget
            )
        if self.attention.on_master:
            sums = config.n_layers + 1
        speeds = with_messages(speeds, [c.message_s for c in devices], model_gb, sums)
        head_dtype = self.source.head_dtype(self.memory.dtype)
        head_costs = [1.0] + [
            head_row_cost(config, m.capacity.speed, m.link.bytes_per_s, head_dtype)
            if m.link is not None
            else 1.0
            for m in self.hub.members
        ]
        # Named by PLAN_RULES, so a plan kept under other rules is not kept under these.
        record = f"{model_identity(self.source)}-{self.memory.dtype}-{len(speeds)}-{PLAN_RULES}"
        return keep_last_plan(self.state_dir / "plans" / f"{record}.json", speeds, head_costs)

    def _attention_asked(self) -> AttentionChoice:
        """Where attention goes before the devices are measured: as `--attention` says, split
        for auto (`plan_shares` chooses once it has the figures), and for one device."""
        if self.nodes == 1:
            return AttentionChoice(False, "split: one device")
        if self.memory.attention == "split":
            return AttentionChoice(False, "split: --attention split")
        if self.memory.attention == "master":
            return AttentionChoice(True, "master: --attention master")
        unmeasured = "the devices were not measured (equal or given shares): no link cost"
        return AttentionChoice(False, f"split: {unmeasured}")

    def _measure_devices(self, hub: Hub) -> list[Capacity]:
        """Every node's capacity, the master first, with its speed measured again, all at one
        moment (`Hub.measure_speeds` says why), and every member's link timed."""
        speed = hub.measure_speeds(lambda: measure_speed(blas_threads()))
        hub.measure_links(self.config.hidden * 4)  # a sum's message, one sequence
        if self._master_capacity is None:
            own = self.memory
            self._master_capacity = measure_capacity(
                blas_threads(), own.budget, own.window, self.state_dir, speed
            )
        self._master_capacity = msgspec.structs.replace(self._master_capacity, speed=speed)
        return [self._master_capacity, *(m.capacity for m in hub.members)]

    def _leave_out_slow_links(
        self, speeds: list[float], budgets: list[int], layers_bytes: int, model_gb: float, sums: int
    ) -> list[int]:
        """The members (indices) this plan takes, after putting on standby those whose links
        would slow every token (`workers_to_plan`). Only where the plan may choose: every link
        timed, and no node streaming by a window it was given (whose speed the probes do not
        tell)."""
        members = list(self.hub.members) if self.hub else []
        everyone = list(range(len(members)))
        forced = self.memory.window is not None or any(m.capacity.window for m in members)
        if forced or any(m.link is None for m in members):
            return everyone
        config = self.config
        # The layers, and the embedding and the lm_head as float32 at most (tied or not).
        weights_bytes = layers_bytes + 2 * config.vocab_size * config.hidden * 4
        rtts = [m.link.rtt_s for m in members if m.link is not None]
        kept = workers_to_plan(speeds, rtts, budgets, weights_bytes, model_gb, sums)
        self.standby_choice = [m.name for k, m in enumerate(members) if k not in kept]
        if len(kept) == len(members) or not self.standby:
            return everyone
        without = kept_token_s(speeds, rtts, kept, model_gb, sums)
        assert self.split_estimate is not None  # every link was timed
        for k in sorted(set(everyone) - set(kept)):
            reason = (
                f"its link ({rtts[k] * 1e6:.0f} us a round trip, {sums} of them a token) would "
                f"slow every token: the probes put one at ~{self.split_estimate.split_s * 1e3:.0f}"
                f" ms with it and ~{without * 1e3:.0f} ms without; a nearer or faster link "
                "would bring it in at the next re-plan"
            )
            assert self.hub is not None  # members came from it
            self.hub.leave_out([members[k]], reason)
        return kept

    def measured(self) -> list[Capacity]:
        """What each node measured of itself, the master first: empty where the plan measured
        nothing (equal or given shares)."""
        if self._master_capacity is None or self.hub is None:
            return []
        return [self._master_capacity, *(m.capacity for m in self.hub.members)]

    def close(self, reason: str = "master shutting down") -> None:
        """Let go of the engine and say BYE to the workers; safe to call twice."""
        self._close_engine()
        if self.hub is not None:
            self.hub.close(reason)
        gc.unfreeze()  # what became garbage since the start is collected again

    def _plan(self) -> Engine:
        if self.hub is not None:
            self.hub.take_in()  # the joined, those on standby, the plan's alive: all weighed
        self.planned_capacities, self.planned_head_costs = [1.0], None
        self.standby_choice = []
        self.attention = self._attention_asked()
        if self.nodes > 1 or self.memory.streaming:
            # (the shares may leave every worker on standby: the master then runs alone)
            self.planned_capacities, self.planned_head_costs = self.plan_shares()
        if self.nodes == 1 and not self.memory.streaming:
            # Alone with every weight resident: read straight from the model, no shards.
            kv_format = self.memory.kv_cache
            if kv_format == "auto":  # no budget: the first format holds the whole context
                kv_format = KV_AUTO_FORMATS[0]
            engine = Engine.local(
                self.source, max_context=self.context, slots=self.slots, kv_format=kv_format
            )
        else:
            engine = _cluster_engine(
                self.source,
                self.hub,
                self.planned_capacities,
                self.state_dir,
                self.context,
                self.slots,
                self.progress,
                self.memory,
                self.planned_head_costs,
                self.one_device,
                first_plan=not self._planned,
                attention_first=self.attention.on_master and self.nodes > 1,
            )
        self._planned = True
        self.engine = engine
        self.max_context = engine.max_context
        return engine

    def _close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
