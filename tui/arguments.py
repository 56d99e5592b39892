"""The `edgetp` command line: its subcommands, their options, and the checks on their values.

Only argparse and torch-free modules are imported: the parser is built on every command, the
chat app's included, which must start without loading torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgetp.master.emulate.spec import DeviceSpec, parse_device
from edgetp.master.generation.params import CHUNK_STEP_S
from edgetp.memory.budget import MemoryOptions, parse_size
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.dtypes import AUTO, DTYPE_CHOICES
from edgetp.node.protocol import DEFAULT_PORT, WIRES
from edgetp.tui.chat.command import add_arguments as add_chat_arguments


def _add_model_args(p: argparse.ArgumentParser, several: bool = False) -> None:
    p.add_argument(
        "--model",
        default=None,
        action="append" if several else "store",
        help="a .gguf file, an HF folder, a bundled name, or OWNER/REPO[:QUANT] on the Hugging "
        f"Face hub, pulled on first use (default: {DEFAULT_MODEL})"
        + ("; repeatable: the first is loaded at start, a request naming another switches "
           "to it" if several else ""),
    )  # fmt: skip
    p.add_argument(
        "--context", type=int, default=None, help="tokens of context to allocate (default 2048)"
    )
    p.add_argument(
        "--threads", type=_positive, default=None, help="BLAS threads (default: all cores)"
    )


def _add_cluster_args(p: argparse.ArgumentParser, lan: bool = False) -> None:
    p.add_argument(
        "--local-nodes",
        type=_positive,
        default=None if lan else 1,
        help="nodes on this machine, the master included: K-1 worker processes join it"
        + (" (instead of devices joining over the LAN)" if lan else ""),
    )
    p.add_argument(
        "--capacities",
        type=_capacities,
        default=None,
        help="relative node capacities for the split, master first (e.g. 1,2,3)",
    )
    p.add_argument("--state-dir", type=Path, default=None, help="shard cache and node state")


def _add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        type=_device,
        action="append",
        default=None,
        help="run each local node as an emulated device (root, cgroups v1): one spec for all "
        "or one per node, master first, e.g. cpu=0.5,mem=1GB,disk=200MB/s,link=100Mbit,rtt=2ms",
    )


def _device(text: str) -> DeviceSpec:
    try:
        return parse_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_lan_args(p: argparse.ArgumentParser, flag: str, workers: int) -> None:
    """Where devices join the master (`flag` names the address options) and how it is found."""
    p.add_argument(
        f"--{flag}bind", dest="lan_bind", default="0.0.0.0", help="address devices join on"
    )
    p.add_argument(
        f"--{flag}port",
        dest="lan_port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"port devices join on (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=workers,
        help=f"devices to wait for before the first answer (default {workers}); more may join "
        "at any time and get a share between requests",
    )
    p.add_argument("--join-timeout", type=float, default=600.0, help="s to wait for them")
    p.add_argument(
        "--new-token", action="store_true", help="rotate the join token: old tokens stop working"
    )
    p.add_argument("--cluster", default=None, help="cluster name to announce (default: host)")
    p.add_argument("--interface", default=None, help="IPv4 address to announce mDNS on")
    p.add_argument("--no-announce", action="store_true", help="do not announce on the LAN")
    p.add_argument(
        "--every-device",
        action="store_true",
        help="plan in every device that joins (default: one whose link would slow every token "
        "waits on standby)",
    )


def _add_memory_args(p: argparse.ArgumentParser, master: bool = True, bench: bool = False) -> None:
    if master:
        p.add_argument(
            "--dtype",
            choices=DTYPE_CHOICES,
            default=None,
            help="how the shards store the weights (int8: per-channel scales; q8_0, q5_1, "
            "q5_0, q4_1, q4_0, mxfp4: GGUF's blocks of 32; auto: as the model file stores each "
            "one, K-quants and IQ4_XS included; default: auto for a .gguf file, f32 for an HF "
            "folder)",
        )
        p.add_argument(
            "--memory-budget", default=None, help="memory for weights and KV cache, e.g. 2GB"
        )
        p.add_argument(
            "--activations",
            choices=("exact", "int8", "auto"),
            default="exact",
            help="how the block formats' products take their input: exact (float32, default) "
            "or int8 (rounded to int8 a block of 32, the K-quants' a block of 256, as llama.cpp "
            "does; integer dot products: 0.7x the decode time); auto: int8 for a model in 4- to "
            "6-bit blocks, exact otherwise; every node follows the master",
        )
        p.add_argument(
            "--kv-cache",
            choices=("f32", "f16", "q8_0", "auto"),
            default="f32",
            help="how every node stores keys and values (f16: half the memory of f32; q8_0: "
            "GGUF's blocks of 32, 0.27x; auto: f32, or the first of f16 and q8_0 whose cache "
            "holds the context under every node's memory budget); attention computes in "
            "float32 either way (default f32)",
        )
        _plan_choice(
            p, "--attention", ("auto", "split", "master"), "auto", bench,
            "Where attention runs: split across the devices as the FFN is (two sums a layer), or "
            "every head on the master (one sum a layer; the workers wait while it computes); "
            "auto: the master where the measured links make the saved sum cost more than "
            "attention there, else split (/v1/cluster says which and why)",
        )  # fmt: skip
        _plan_choice(
            p, "--wire", WIRES, "float32", bench,
            "What each sum's messages carry, the hidden state out and the partials back: "
            "float32, or float16 at half the bytes (a message with a value past float16's range "
            "goes as float32); greedy output may differ from one node's where a token's top two "
            "logits are nearly tied",
        )  # fmt: skip
    p.add_argument(
        "--window", type=_positive, default=None, help="layers of the slice in memory (forced)"
    )
    p.add_argument(
        "--drop-cache",
        action="store_true",
        help="drop each shard from the page cache after reading it (cold-disk benchmarks)",
    )


def _plan_choice(
    p: argparse.ArgumentParser,
    flag: str,
    choices: tuple[str, ...],
    default: str,
    bench: bool,
    what: str,
) -> None:
    """A choice the master's plan makes for the whole cluster; bench takes it more than once and
    times each node count with each, alternating."""
    again = "with --local-nodes: time each node count with each (repeatable, alternating). "
    p.add_argument(
        flag,
        choices=choices,
        action="append" if bench else "store",
        default=None if bench else default,
        help=(again if bench else "") + f"{what} (default {default})",
    )


def _add_draft_arg(p: argparse.ArgumentParser, bench: bool = False) -> None:
    p.add_argument(
        "--draft",
        metavar="lookup|off|MODEL",
        action="append" if bench else "store",
        default=None if bench else "off",
        help=(
            "with --local-nodes: time decoding with these drafts (repeatable and alternating, "
            "e.g. --draft off --draft lookup; default off). "
            if bench
            else "speculative decoding, checked in one cluster step (fewer round trips a "
            "token; the output is the same): "
        )
        + "'lookup' drafts tokens from the prompt and the text so far; MODEL (a .gguf file, "
        "an HF folder or a bundled model name) is a draft model of the same vocabulary, run "
        "whole on the master; default off",
    )
    p.add_argument(
        "--draft-dtype",
        choices=DTYPE_CHOICES,
        default=AUTO,
        help="how the draft model's shards store its weights (default auto: as its file does)",
    )


def _port(text: str) -> int:
    """A TCP port to listen on, 0 for any free one: checked here, since ZeroMQ and the LAN
    announcement take a wrong one only to fail with a traceback."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 1..65535, or 0 for any")
    return int(text)


def _milliseconds(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of milliseconds")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _speed(text: str) -> float:
    try:
        speed = float(text)
    except ValueError:
        speed = 0.0
    if not 0 < speed < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a speed in GB/s above 0")
    return speed


def _dtype(args: argparse.Namespace) -> str:
    """The shard dtype asked for, else the model's default; f32 for a command that splits
    nothing (a worker is told the master's)."""
    if not hasattr(args, "dtype"):
        return "f32"
    from edgetp.models.source import default_dtype  # torch: not for `--help`

    return args.dtype or default_dtype(getattr(args, "model", None))


def memory_options(args: argparse.Namespace) -> MemoryOptions:
    """The memory options given on the command line."""
    budget = getattr(args, "memory_budget", None)
    return MemoryOptions(
        budget=parse_size(budget) if budget else None,
        window=getattr(args, "window", None),
        dtype=_dtype(args),
        drop_cache=getattr(args, "drop_cache", False),
        kv_cache=getattr(args, "kv_cache", "f32"),
        activations=getattr(args, "activations", "exact"),  # a worker: what its master says
        attention=attention
        if isinstance(attention := getattr(args, "attention", None), str)
        else "auto",  # a bench's list: each run's own (master.bench.cluster)
        wire=wire if isinstance(wire := getattr(args, "wire", None), str) else "float32",
    )


def _node_counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of counts like 1,2,3") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("node counts must be at least 1")
    return values


def _capacities(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers like 1,2,3") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("capacities must be positive")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The `edgetp` command line: every subcommand and its options."""
    parser = argparse.ArgumentParser(
        prog="edgetp", description="Run a language model tensor-parallel across small devices."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="complete one prompt and stream it to stdout")
    _add_model_args(run)
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--repetition-penalty", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--system", default=None, help="system prompt for the chat template")
    run.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    run.add_argument(
        "--no-think",
        dest="enable_thinking",
        action="store_const",
        const=False,
        default=None,
        help="render the chat template with its thinking block off (Qwen3: enable_thinking)",
    )
    _add_cluster_args(run)
    _add_device_arg(run)
    _add_memory_args(run)
    _add_draft_arg(run)
    run.add_argument("prompt", help="the prompt")

    master = sub.add_parser(
        "master",
        help="start a master that devices join; prompts from a terminal, else a service",
    )
    _add_model_args(master)
    _add_lan_args(master, "", workers=1)
    master.add_argument("--capacities", type=_capacities, default=None)
    master.add_argument("--state-dir", type=Path, default=None)
    master.add_argument("--max-tokens", type=int, default=256)
    _add_memory_args(master)

    for name in ("join", "node"):
        join = sub.add_parser(name, help="join a master as a worker")
        join.add_argument(
            "master", nargs="?", default=None, help="HOST[:PORT] of the master (default: find it)"
        )
        join.add_argument("--cluster", default=None, help="with several masters: which one")
        join.add_argument("--interface", default=None, help="IPv4 address to browse mDNS on")
        join.add_argument("--threads", type=_positive, default=None)
        join.add_argument(
            "--memory-budget",
            default=None,
            help="for weights and KV cache, e.g. 2GB (default: RAM)",
        )
        _add_memory_args(join, master=False)
        join.add_argument(
            "--speed",
            type=_speed,
            default=None,
            help="GB/s this device streams weights at, as measured before (default: probe it "
            "at start; the master measures every node again before a plan that weighs them)",
        )
        join.add_argument("--name", default=None, help="this node's name (default: host-random)")
        join.add_argument("--model", default=None, help="refuse a master running another model")
        join.add_argument("--state-dir", type=Path, default=None)
        join.add_argument(
            "--token",
            default=None,
            help="the join token the master printed (or set EDGETP_TOKEN; remembered after "
            "a successful join)",
        )

    bench = sub.add_parser("bench", help="measure ms/token against the reference implementation")
    _add_model_args(bench)
    bench.add_argument("--tokens", type=int, default=64, help="greedy tokens to time")
    bench.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians kept")
    bench.add_argument("--json", default=None, help="also write the results to this file")
    bench.add_argument(
        "--local-nodes",
        type=_node_counts,
        default=None,
        help="node counts to compare, e.g. 1,2,3 (instead of the transformers comparison)",
    )
    bench.add_argument("--state-dir", type=Path, default=None)
    _add_device_arg(bench)
    bench.add_argument(
        "--baseline",
        action="store_true",
        help="with --device: also time one node with no device limits and the first device's "
        "threads; ratios are taken against it",
    )
    _add_memory_args(bench, bench=True)
    _add_draft_arg(bench, bench=True)
    bench.add_argument("--prompt", default=None, help="with --local-nodes: the prompt to time")
    bench.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="time a prompt of N tokens of generated prose: prefill tokens/s, decode at that "
        "depth, each node's KV (local nodes: 1 unless --local-nodes says)",
    )
    bench.add_argument(
        "--rss-tokens",
        type=int,
        default=0,
        help="with --local-nodes: also generate this many "
        "tokens and report each node's memory along the way",
    )

    serve = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible REST API; devices may join"
    )
    _add_model_args(serve, several=True)
    _add_cluster_args(serve, lan=True)
    _add_lan_args(serve, "cluster-", workers=0)
    _add_device_arg(serve)
    _add_memory_args(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--unload-after",
        type=float,
        default=None,
        metavar="S",
        help="unload the model after S seconds without a request (the next one loads it "
        "again; default: never)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (or set EDGETP_API_KEY)",
    )
    serve.add_argument(
        "--max-batch", type=int, default=8, help="requests generated at once (KV-cache slots)"
    )
    serve.add_argument(
        "--no-prompt-reuse",
        dest="prompt_reuse",
        action="store_false",
        help="prefill every request whole, instead of starting from the KV cache a finished "
        "request left that begins with the same tokens (to measure reuse, or rule it out)",
    )
    serve.add_argument(
        "--prefill-chunk-ms",
        type=_milliseconds,
        default=round(CHUNK_STEP_S * 1000),
        metavar="MS",
        help="while other requests decode, a long prompt prefills in chunks whose steps take "
        "about MS ms (or 2 decode steps if longer), a decode step of the others between two: "
        "their streams pause that long instead of for the whole prompt; 0 prefills a prompt "
        "whole, the others waiting (default %(default)s)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from ORIGIN (e.g. http://localhost:3000, or *) call the API from a "
        "browser; repeatable (default: none)",
    )
    _add_draft_arg(serve)

    synth = sub.add_parser(
        "synth", help="write a model of a real model's layer shapes with random weights"
    )
    synth.add_argument("--shape", required=True, help="e.g. llama2-70b, llama3-8b, tinyllama-1.1b")
    synth.add_argument("--layers", type=_positive, required=True, help="decoder layers to write")
    synth.add_argument("--out", type=Path, required=True, help="the model folder to create")
    synth.add_argument("--dtype", choices=("f16", "bf16", "f32"), default="f16")
    synth.add_argument("--seed", type=int, default=0)

    chat = sub.add_parser("chat", help="the terminal chat app, with a live view of the cluster")
    _add_model_args(chat)
    _add_cluster_args(chat, lan=True)
    _add_lan_args(chat, "cluster-", workers=0)
    _add_memory_args(chat)
    _add_draft_arg(chat)
    add_chat_arguments(chat)

    kern = sub.add_parser(
        "kernels", help="the kernels this device admitted for a model's matrices, and their times"
    )
    kern.add_argument("--model", default=None, help=f"default: {DEFAULT_MODEL}")
    kern.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        action="append",
        default=None,
        help="shard dtypes to show (repeatable; default: all, auto as the model stores them)",
    )
    kern.add_argument(
        "--local-nodes", type=_positive, default=1, help="nodes the model is split across"
    )
    kern.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="BLAS threads (default: each local node's share of the cores, as run and serve give)",
    )
    kern.add_argument("--recheck", action="store_true", help="check and time everything again")

    bench_serve = sub.add_parser(
        "bench-serve", help="aggregate tokens/s of edgetp serve with concurrent streaming clients"
    )
    bench_serve.add_argument("--model", default=None)
    bench_serve.add_argument("--context", type=int, default=None)
    bench_serve.add_argument("--local-nodes", type=int, default=1)
    bench_serve.add_argument(
        "--clients", type=_node_counts, default=[1, 4, 8], help="client counts (default 1,4,8)"
    )
    bench_serve.add_argument("--tokens", type=int, default=64, help="greedy tokens per client")
    bench_serve.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians")
    bench_serve.add_argument("--json", default=None, help="also write the results to this file")
    bench_serve.add_argument("--state-dir", type=Path, default=None)

    pull = sub.add_parser(
        "pull", help="fetch a model from the Hugging Face hub into the cache: OWNER/REPO[:QUANT]"
    )
    pull.add_argument(
        "name",
        help="e.g. bartowski/Qwen3-8B-GGUF:Q4_K_M (a GGUF repository's quant; default Q4_K_M, "
        "else its first) or an HF safetensors repository",
    )
    sub.add_parser("models", help="list the models in the cache: name, size, format, family")
    rm = sub.add_parser("rm", help="remove a model from the cache: OWNER/REPO[:QUANT]")
    rm.add_argument("name", help="without :QUANT, every quant and revision of the repository")
    return parser
