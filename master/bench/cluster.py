"""`edgetp bench --local-nodes`: a local cluster's speed and memory for several node counts.

Each node count gets ms/token, time to first token, the allreduce latency per sum next to a raw
ZeroMQ and a plain TCP round trip of the same payload, and every node's loader and memory
figures; with more than one node, how fast this machine's cores stream memory alone and all at
once (master/bench/memory_bus.py), which local nodes share and real devices would not. Node
counts alternate over rounds and medians are kept, as in every benchmark here.

With `--device`, every node runs as an emulated device (master/emulate/) and each run also
reports each device's peak memory (its cgroup's, page cache included), the kernel's memory kills,
how often its CPU quota throttled it and the CPU time its threads spent per decoded token (which,
over its quota, is the least time a token can take there); `--baseline` adds an unconstrained
one-node run with the first device's threads, which the ratios are then taken against.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any

from edgetp.master.bench.cluster_figures import (
    cpu_floor_ms,
    estimate_figures,
    link_figures,
    node_row,
    overlap,
    where_time_goes,
)
from edgetp.master.bench.cluster_report import (
    describe_memory,
    print_devices,
    print_nodes,
    print_overlap,
    print_time,
)
from edgetp.master.bench.greedy import PROMPT, time_greedy
from edgetp.master.bench.long_prompt import (
    check_depth,
    long_prompt_row,
    print_long_prompt,
    prose_tokens,
)
from edgetp.master.bench.memory_bus import stream_rates
from edgetp.master.bench.round_trips import raw_round_trips, raw_tcp_round_trips
from edgetp.master.cluster.figures import percentile
from edgetp.master.cluster.local import local_engine, local_session
from edgetp.master.emulate.devices import emulated
from edgetp.master.emulate.spec import DeviceSpec, device_specs
from edgetp.master.generation.prompts import open_with_tokenizer, prompt_tokens
from edgetp.master.generation.speculate import open_speculator
from edgetp.memory.budget import ALL_RESIDENT, MemoryOptions
from edgetp.memory.files import default_state_dir
from edgetp.models.chat_template import NoChatTemplate
from edgetp.models.dtypes import AUTO
from edgetp.models.layers import Slice
from edgetp.models.source import ModelSource
from edgetp.node.kvcache import KVCache

WARM_UP_TOKENS = 512  # at most, of the timed prompt


def run_cluster_bench(
    model: str | None,
    node_counts: list[int],
    n_tokens: int,
    json_path: str | None,
    context: int | None,
    state_dir: Path | None,
    memory: MemoryOptions = ALL_RESIDENT,
    rss_tokens: int = 0,
    rounds: int = 3,
    devices: list[DeviceSpec] | None = None,
    baseline: bool = False,
    drafts: list[str] | None = None,
    prompt_text: str | None = None,
    draft_dtype: str = AUTO,
    threads: int | None = None,
    prompt_length: int | None = None,
    attentions: list[str] | None = None,
    wires: list[str] | None = None,
) -> dict[str, Any]:
    """ms/token, TTFT, allreduce latency and every node's loader and memory figures, for each
    node count, with a raw ZeroMQ floor. `threads`: each node's BLAS threads (default: its
    share of the cores, or its device's).

    Where nodes stream, each node count also gets its overlap: ms/token against the slowest
    node's reads and its compute (waits excluded) per token, both measured in the same run.
    Streaming hides its reads when ms/token is near the larger of the two.
    `rss_tokens` adds a long generation with each node's memory at its first and last token.
    `drafts` ("off", "lookup", a draft model) times each node count with each, alternating
    (speculation; a draft model's shards at `draft_dtype`); `attentions` ("auto", "split",
    "master": `MemoryOptions.attention`) and `wires` ("float32", "float16":
    `MemoryOptions.wire`) likewise.
    `prompt_length` times a prompt of that many tokens of generated prose instead
    (master/bench/long_prompt.py): prefill tokens/s, decode at that depth, each node's KV.
    """
    if baseline and not devices:
        raise ValueError("--baseline compares emulated devices with one free node: give --device")
    state_dir = state_dir or default_state_dir()
    configs = bench_configs(
        node_counts, devices, baseline, drafts, draft_dtype, threads, attentions, wires
    )
    source, tokenizer = open_with_tokenizer(model)
    if prompt_length is not None:
        if prompt_text is not None:
            raise ValueError("give --prompt or --prompt-tokens, not both")
        # Before any node starts: a prompt past the context is one line, not a run's failure.
        context = check_depth(
            prompt_length, n_tokens, source.config.context_length, context, source.path.name
        )
        prompt = prose_tokens(tokenizer, prompt_length)
    else:
        try:
            prompt = prompt_tokens(tokenizer, prompt_text or PROMPT, raw=False)
        except NoChatTemplate:  # a base model: the prompt as it is
            prompt = prompt_tokens(tokenizer, prompt_text or PROMPT, raw=True)
    hidden = source.config.hidden
    # The floors a token's hops and products are set against; a long prompt's figures are the
    # prompt's, and these took a minute and a half of a loaded 2-core host.
    floors = _floors(hidden, node_counts) if prompt_length is None else {}
    # Node counts alternate for `rounds` rounds and each keeps its median run: these shared
    # machines drift by 20% between minutes, and a ratio of runs taken minutes apart would
    # measure the drift.
    runs: dict[_Config, list[dict[str, Any]]] = {}
    for _round in range(rounds):
        for config in configs:
            runs.setdefault(config, []).append(
                _cluster_run(
                    source,
                    tokenizer,
                    prompt,
                    config,
                    n_tokens,
                    context,
                    state_dir,
                    config.memory(memory),
                )
            )
    rows = []
    # Each round is also taken against the same round's run of the reference (the first device
    # run, or the first node count): rounds are minutes apart, and one plan's token moved 44-69
    # ms within an hour here, more than a ratio of medians can tell from the split's effect.
    reference = configs[1] if baseline else configs[0]
    for kept in runs.values():
        ordered = sorted(kept, key=lambda r: r["ms_per_token"])
        median = ordered[len(ordered) // 2]
        median["rounds_ms_per_token"] = [r["ms_per_token"] for r in kept]
        ratios = [
            r["ms_per_token"] / ref["ms_per_token"]
            for r, ref in zip(kept, runs[reference], strict=True)
        ]
        median["rounds_ratio"] = [round(x, 3) for x in ratios]
        median["ratio_median"] = round(statistics.median(ratios), 3)
        median["rounds_cpu_ms_per_token"] = [
            [d["cpu_ms_per_token"] for d in r["devices"]] for r in kept
        ]
        if prompt_length is not None:
            median["long_prompt"] = long_prompt_row(kept, prompt_length)
        rows.append(median)
    print(f"model {source.path}  prompt {len(prompt)} tokens  {n_tokens} greedy tokens")
    print(f"memory: {describe_memory(memory)}; medians of {rounds} alternating rounds")
    if floors:
        _print_floors(hidden, floors)
    base = rows[0]["ms_per_token"]
    title = "allreduce us (med/p99, decode)"
    print(f"{'nodes':>5}{'ms/token':>9}{'vs first':>9}{'TTFT ms':>9}{title:>33}  devices")
    for r in rows:
        ar = (
            f"{r['allreduce_us_median']:.0f} / {r['allreduce_us_p99']:.0f}"
            if r["allreduce_us_median"] is not None
            else "-"
        )
        print(
            f"{r['nodes']:>5}{r['ms_per_token']:>9}"
            f"{r['ms_per_token'] / base:>9.2f}{r['ttft_ms']:>9}{ar:>33}  {r['label']}"
        )
    if rounds > 1 and len(configs) > 1:
        print(f"each round against that round's {reference.nodes}-node run ({reference.label}):")
        for r in rows:
            ms = ", ".join(f"{x:g}" for x in r["rounds_ms_per_token"])
            ratio_text = ", ".join(f"{x:.3f}" for x in r["rounds_ratio"])
            print(
                f"  {r['nodes']} node(s) {r['label']}: ms/token {ms}; ratios {ratio_text}, "
                f"median {r['ratio_median']:.3f}"
            )
    for r in rows:
        print_nodes(r)
        print_time(r)
        print_devices(r)
        print_overlap(r)
    if prompt_length is not None:
        print(f"a prompt of {prompt_length} tokens of generated prose, medians of {rounds}:")
        print_long_prompt(rows)
    same = all(  # every round of every node count, not just the medians
        r["tokens"] == rows[0]["tokens"] for kept in runs.values() for r in kept
    )
    print(f"greedy tokens identical across node counts: {same}")
    long_runs = []
    if rss_tokens:
        for config in configs:
            long_runs.append(
                _rss_run(
                    source,
                    tokenizer,
                    prompt,
                    config,
                    rss_tokens,
                    context,
                    state_dir,
                    config.memory(memory),
                )  # fmt: skip
            )
    report = {
        "model": str(source.path),
        "tokens": n_tokens,
        "memory": dataclasses.asdict(memory),
        "device_specs": [d.as_json() for d in devices or []],
        **floors,
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "greedy_tokens_identical": same,
        "rss_runs": long_runs,
    }
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _floors(hidden: int, node_counts: list[int]) -> dict[str, Any]:
    """A raw ZeroMQ and a plain TCP round trip of a hidden state, and how fast this machine's
    cores stream memory alone and together, as the report records them."""
    raw = raw_round_trips((1, 1, hidden), 2000)
    tcp = raw_tcp_round_trips(hidden * 4, 2000)
    # As many streams as the largest run has nodes, up to the cores: what N devices' products
    # share here that N real devices would not.
    cores = sorted(os.sched_getaffinity(0))[: max(node_counts)]
    alone, together = stream_rates(cores) if len(cores) > 1 else (None, [])
    return {
        "raw_round_trip_us_median": round(statistics.median(raw) * 1e6, 1),
        "raw_round_trip_us_p99": round(percentile(raw, 0.99) * 1e6, 1),
        "raw_tcp_round_trip_us_median": round(statistics.median(tcp) * 1e6, 1),
        "memory_stream_gb_s": {
            "cores": cores,
            "alone": round(alone, 2) if alone else None,
            "together": [round(x, 2) for x in together],
        },
    }


def _print_floors(hidden: int, floors: dict[str, Any]) -> None:
    print(
        f"raw ZeroMQ round trip, {hidden * 4} B payload: median "
        f"{floors['raw_round_trip_us_median']:.0f} us, p99 {floors['raw_round_trip_us_p99']:.0f} "
        f"us; plain TCP, no ZeroMQ: median {floors['raw_tcp_round_trip_us_median']:.0f} us"
    )
    stream = floors["memory_stream_gb_s"]
    alone, together = stream["alone"], stream["together"]
    if together and alone:
        each = ", ".join(f"{x:.1f}" for x in together)
        print(
            f"memory, shared by this machine's cores: one core streams {alone:.1f} GB/s alone, "
            f"{len(together)} at once {each} GB/s each "
            f"({statistics.mean(together) / alone:.2f} of alone; separate devices: 1.00)"
        )


@dataclasses.dataclass(frozen=True)
class _Config:
    """One cluster to time: `nodes` nodes, each as its device in `specs` (None: free nodes)."""

    nodes: int
    specs: tuple[DeviceSpec, ...] | None
    threads: int | None = None
    draft: str = "off"  # speculation: "off", "lookup" or a draft model
    draft_dtype: str = AUTO
    attention: str = "auto"  # where attention runs (MemoryOptions.attention)
    wire: str = "float32"  # what the sums send (MemoryOptions.wire)

    def memory(self, options: MemoryOptions) -> MemoryOptions:
        """The bench's memory options with this run's attention and wire."""
        return dataclasses.replace(options, attention=self.attention, wire=self.wire)

    @property
    def label(self) -> str:
        if self.specs is None:
            label = f"none, {self.threads} thread(s)" if self.threads else "none"
        else:
            label = " | ".join(s.describe() for s in self.specs)
            label += f", {self.threads} thread(s)" if self.threads else ""
        if self.attention != "auto":
            label += f"; attention {self.attention}"
        if self.wire != "float32":
            label += f"; wire {self.wire}"
        return label if self.draft == "off" else f"{label}; draft {self.draft}"


def bench_configs(
    node_counts: list[int],
    devices: list[DeviceSpec] | None = None,
    baseline: bool = False,
    drafts: list[str] | None = None,
    draft_dtype: str = AUTO,
    threads: int | None = None,
    attentions: list[str] | None = None,
    wires: list[str] | None = None,
) -> list[_Config]:
    """The clusters a bench times, in the order each round runs them; one of each (a node count
    given twice would put two runs a round under one key, and its rounds out of step). One
    node has no attention to place and no sums to send: it runs once."""
    configs = [
        _Config(n, _specs(devices, n), threads, d, draft_dtype, *((a, w) if n > 1 else ()))
        for n in dict.fromkeys(node_counts)
        for d in dict.fromkeys(drafts or ["off"])
        for a in dict.fromkeys(attentions or ["auto"])
        for w in dict.fromkeys(wires or ["float32"])
    ]
    configs = list(dict.fromkeys(configs))
    if baseline:
        assert devices is not None
        configs.insert(0, _Config(1, None, threads=threads or devices[0].threads))
    return configs


def _specs(devices: list[DeviceSpec] | None, nodes: int) -> tuple[DeviceSpec, ...] | None:
    """The devices of an `nodes`-node run: the one spec for all, or the first `nodes` given."""
    if not devices:
        return None
    return tuple(device_specs(devices if len(devices) == 1 else devices[:nodes], nodes))


def _cluster_run(
    source: ModelSource,
    tokenizer: Any,
    prompt: list[int],
    config: _Config,
    n_tokens: int,
    context: int | None,
    state_dir: Path,
    memory: MemoryOptions,
) -> dict[str, Any]:
    nodes = config.nodes
    with (
        emulated(config.specs, nodes, state_dir) as devices,
        local_session(
            source,
            nodes,
            state_dir=state_dir,
            context=context,
            memory=memory,
            threads=config.threads,
            devices=devices,
            standby=False,  # it times the node counts it is given, the split's cost with them
        ) as session,
    ):
        engine = session.engine
        assert engine is not None
        links = [None, *(m.link for m in session.hub.members)] if session.hub else []
        plan = {
            "capacities": [round(c, 3) for c in session.planned_capacities],
            "head_costs": session.planned_head_costs
            and [round(c, 3) for c in session.planned_head_costs],
            "measured": [
                dict[str, float | None](speed_gb_s=c.speed, message_us=round(c.message_s * 1e6, 1))
                | link_figures(link)
                for c, link in zip(session.measured(), links, strict=False)
            ],
            "estimate": estimate_figures(session.split_estimate),
            "attention": session.attention.why,
            # Left to choose (run, serve), the plan would have left these on standby.
            "standby": session.standby_choice,
        }
        # A warm-up pays the first call's costs; of a long prompt, its start: a prompt of 8k
        # tokens prefilled twice would double the run for nothing the timed run does not redo.
        time_greedy(engine, tokenizer, prompt[:WARM_UP_TOKENS], 4)
        members = _clear_figures(engine)
        speculator = open_speculator(config.draft, config.draft_dtype, session, tokenizer)
        cpu_before: list[float] = []  # each device's CPU time as the decode steps start
        prefill_sums: list[int] = []  # and the sums the prompt's steps took

        def mark() -> None:
            if devices:
                cpu_before.extend(devices.cpu_seconds())
            prefill_sums.append(len(engine.remote.allreduce_seconds) if engine.remote else 0)

        ttft, ms, tokens = time_greedy(engine, tokenizer, prompt, n_tokens, speculator, mark)
        cpu_after = devices.cpu_seconds() if devices else []
        cpu_used = [b - a for a, b in zip(cpu_before, cpu_after, strict=True)]
        figures = None
        if speculator is not None:
            figures = speculator.figures()
            speculator.close()
        # A decode step's sums: the prompt's carry all its tokens' hidden states (a 49-token
        # prompt's 800 KB at 300 Mbit/s took 111 ms a sum where a token's took 5), and in a
        # p99 of 120 decode sums its few would be the tail.
        sums = list(engine.remote.allreduce_seconds)[prefill_sums[0] :] if engine.remote else []
        per_node = [node_row("master", engine.history)] + [
            node_row(m.name, m.history) for m in members
        ]
        engine.close()
        device_rows = devices.figures() if devices else []
        for row, used in zip(device_rows, cpu_used, strict=True):
            row["cpu_ms_per_token"] = round(used * 1000 / (len(tokens) - 1), 2)
    return {
        "nodes": nodes,
        "label": config.label,
        "devices": device_rows,
        "ms_per_token": round(ms, 2),
        "cpu_floor_ms": cpu_floor_ms(device_rows),
        "ttft_ms": round(ttft * 1000, 1),
        "tokens": tokens,
        "allreduce_us_median": round(statistics.median(sums) * 1e6, 1) if sums else None,
        "allreduce_us_p99": round(percentile(sums, 0.99) * 1e6, 1) if sums else None,
        "per_node": per_node,
        "overlap": overlap(round(ms, 2), per_node),
        "time": where_time_goes(ms, per_node, sums, n_tokens - 1, figures),
        "speculation": figures,
        "plan": plan,
    }


def _clear_figures(engine: Any) -> list[Any]:
    members = list(engine.remote.members) if engine.remote else []
    if engine.remote:
        engine.remote.allreduce_seconds.clear()
    engine.history.clear()
    for m in members:
        m.history.clear()
    return members


def _rss_run(
    source: ModelSource,
    tokenizer: Any,
    prompt: list[int],
    config: _Config,
    n_tokens: int,
    context: int | None,
    state_dir: Path,
    memory: MemoryOptions,
) -> dict[str, Any]:
    """Each node's RSS after the first decoded token and after the last, with the KV cache
    written meanwhile: streaming must not grow memory beyond the cache."""
    nodes = config.nodes
    with (
        emulated(config.specs, nodes, state_dir) as devices,
        local_engine(
            source,
            nodes,
            state_dir=state_dir,
            context=context,
            memory=memory,
            threads=config.threads,
            devices=devices,
        ) as engine,
    ):
        members = _clear_figures(engine)
        time_greedy(engine, tokenizer, prompt, n_tokens)
        histories = [("master", engine.history)] + [(m.name, m.history) for m in members]
        slices = [engine.slices[0], *(Slice.from_dict(m.slice) for m in members)]
        kv_format = engine.executors[0].cache.kv_format  # "auto" chose it
        kv_per_token = [KVCache.bytes_per_token(engine.config, s, kv_format) for s in slices]
        engine.close()
    print(f"memory over {n_tokens} tokens, {nodes} node(s):")
    print(
        f"  {'node':<10}{'RSS tok 1 MB':>13}{'RSS tok N MB':>13}{'growth MB':>10}"
        f"{'KV written MB':>14}{'peak MB':>9}"
    )
    out = []
    for (name, history), kv in zip(histories, kv_per_token, strict=True):
        steps = list(history)
        first, last = steps[1], steps[-1]
        row = {
            "node": name,
            "rss_first_mb": round(first["rss"] / 1e6, 1),
            "rss_last_mb": round(last["rss"] / 1e6, 1),
            "growth_mb": round((last["rss"] - first["rss"]) / 1e6, 1),
            "kv_written_mb": round(kv * (len(steps) - 2) / 1e6, 1),
            "peak_rss_mb": round(max(s["peak_rss"] for s in steps) / 1e6, 1),
        }
        out.append(row)
        print(
            f"  {name:<10}{row['rss_first_mb']:>13}{row['rss_last_mb']:>13}"
            f"{row['growth_mb']:>10}{row['kv_written_mb']:>14}{row['peak_rss_mb']:>9}"
        )
    return {"nodes": nodes, "tokens": n_tokens, "per_node": out}
