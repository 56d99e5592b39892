"""The cluster bench's report as text: per node count, each node's loader and memory figures,
where a token's time went, the emulated devices and what the plan split by, and the overlap of
streaming with compute. The figures come from `master.bench.cluster_figures`; the JSON report
holds the same rows.
"""

from __future__ import annotations

from typing import Any

from edgetp.memory.budget import MemoryOptions, format_size
from edgetp.models.kernels import activations


def _probe_text(m: dict[str, Any]) -> str:
    """What a device measured of itself (and of its link, a worker), as the bench prints it."""
    text = f"{m['speed_gb_s']:g} GB/s, {m['message_us']:g} us a message"
    if "link_rtt_us" in m:
        rate = f"{m['link_mbit_s']:g} Mbit/s" if m["link_mbit_s"] else "too fast to time"
        text += f", link {m['link_rtt_us']:g} us a round trip, {rate}"
    return text


def print_devices(run: dict[str, Any]) -> None:
    """What the plan split by, and each emulated device's memory, kills, throttling and CPU."""
    plan = run["plan"]
    if plan["measured"]:  # what the plan split by, and what each device measured of itself
        print(
            "  plan: capacities "
            + " | ".join(f"{c:g}" for c in plan["capacities"])
            + " from each device's probe: "
            + " | ".join(_probe_text(m) for m in plan["measured"])
        )
    if plan.get("estimate"):  # what those probes say a token takes, against what it took
        e = plan["estimate"]
        print(
            f"  the probes' estimate: {e['alone_ms']:g} ms a token on the master alone, "
            f"{e['split_ms']:g} split ({e['compute_ms']:g} of compute, {e['sums_ms']:g} of sums)"
        )
    if plan.get("attention") and run["nodes"] > 1:
        print(f"  attention: {plan['attention']}")
    if plan.get("standby"):
        print(
            f"  left to choose (run, serve), the plan would keep {', '.join(plan['standby'])} "
            "on standby: the split is timed here as asked"
        )
    for d in run["devices"]:
        # Devices on one core share its caches and wake each other up: a real device would not.
        sharing = [
            o["node"] for o in run["devices"] if o is not d and set(o["cores"]) & set(d["cores"])
        ]
        shared = f", shared with node {', '.join(map(str, sharing))}" if sharing else ""
        print(
            f"  device of node {d['node']} (core {','.join(map(str, d['cores']))}{shared}): "
            f"peak memory {format_size(d['peak_memory_bytes'])} "
            f"(page cache included), {d['oom_kills']} memory kill(s), CPU quota throttled "
            f"{d['throttled_periods']} of {d['periods']} periods"
        )
        cores = d["device"]["cpu"]
        if cores:  # a quota of q cores: a token takes at least the device's CPU over q
            print(
                f"    its CPU per decoded token: {d['cpu_ms_per_token']} ms, all its threads; "
                f"at cpu={cores:g}, no token can take under {d['cpu_ms_per_token'] / cores:.1f} ms"
            )
    if run.get("cpu_floor_ms"):
        floor, ms = run["cpu_floor_ms"], run["ms_per_token"]
        print(
            f"  a token took {ms} ms where the busiest device's CPU allows {floor:.1f}: "
            f"{ms - floor:.1f} ms ({(ms - floor) / ms:.0%}) of the devices waiting on each other "
            "(messages, an uneven split, the quotas' periods)"
        )


def describe_memory(memory: MemoryOptions) -> str:
    """The memory options a bench ran with, in a line."""
    budget = format_size(memory.budget) if memory.budget else "none"
    window = memory.window or "from the budget"
    return (
        f"dtype {memory.dtype}, activations {activations()}, budget {budget}, window {window}, "
        f"page cache {'dropped after each read' if memory.drop_cache else 'kept'}"
    )


def print_overlap(run: dict[str, Any]) -> None:
    """How well the slowest streaming node hid its reads behind its compute, if any streamed."""
    o = run["overlap"]
    if o is not None:
        print(
            f"overlap, {run['nodes']} node(s): {run['ms_per_token']} ms/token vs node "
            f"{o['node']}'s reads {o['load_ms']} ms and compute {o['compute_ms']} ms per "
            f"token: ratio {o['ratio']}"
        )


def print_time(run: dict[str, Any]) -> None:
    """Where a decoded token's time went, block by block and beyond."""
    t = run["time"]
    if not t:
        return
    nodes = ", ".join(f"{name} {ms}" for name, ms in t["own_compute_ms"].items())
    drafting = f" + its draft model {t['drafting_ms']}" if t.get("drafting_ms") else ""
    print(
        f"  where a token's {t['ms_per_token']} ms go: layers {t['compute_ms']} (the slowest "
        f"node's compute, block by block) + hops {t['hops_ms']} + the lm_head "
        f"{t['lm_head_ms']}{drafting} + its other serial work {t['other_master_ms']} "
        f"(embedding, sampling, the loop); each node's own layer compute: {nodes}"
    )


def print_nodes(run: dict[str, Any]) -> None:
    """Each node's loader and memory figures per decode step, what a sequence costs its memory
    (its state whatever its length, its KV per token, in the slots and context it was given),
    and the drafts' acceptance."""
    spec = run.get("speculation")
    if spec:
        cost = f", {spec['draft_ms']} ms a draft forward" if "draft_ms" in spec else ""
        print(
            f"  draft {spec['draft']}: {spec['accepted']} of "
            f"{spec['drafted']} drafted tokens accepted ({spec['acceptance']}), "
            f"{spec['tokens_per_step']} tokens per step{cost}"
        )
    per = "decode step (one token each)" if not spec else "decode step"
    print(f"per node, {run['nodes']} node(s), averaged per {per}:")
    print(
        f"  {'node':<10}{'window':>7}{'MB read':>9}{'load ms':>9}{'wait ms':>9}"
        f"{'buffers MB':>11}{'RSS MB':>9}{'peak RSS MB':>12}"
        f"{'state MB/seq':>13}{'KV KB/token':>12}{'slots x ctx':>12}"
    )
    for r in run["per_node"]:
        if "window" not in r:
            continue
        sequences = f"{r['slots']} x {r['context']}"
        print(
            f"  {r['node']:<10}{r['window']:>7}{r['mb_read_per_token']:>9}"
            f"{r['load_ms_per_token']:>9}{r['wait_ms_per_token']:>9}{r['buffer_mb']:>11}"
            f"{r['rss_mb']:>9}{r['peak_rss_mb']:>12}{r['state_mb_per_sequence']:>13}"
            f"{r['kv_kb_per_token']:>12}{sequences:>12}"
        )
        if "expert_hit_rate" in r:  # a mixture's experts, streamed through a pool
            print(
                f"  {'':<10}experts: cache hit rate {r['expert_hit_rate']}, "
                f"{r['expert_mb_read_per_token']} MB read of {r['expert_mb_chosen_per_token']} "
                f"MB chosen per token, {r['expert_read_hidden_ms_per_token']} ms of its reads "
                f"hidden behind compute ({r['expert_slots']} slots a layer)"
            )
