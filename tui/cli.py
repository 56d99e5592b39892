"""The `edgetp` command: one console script, one subcommand per job.

Errors a person can fix (a wrong path, a bad value) print one line to stderr and exit 1; they
never show a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memory.budget import MemoryOptions, parse_size
from models.config import DEFAULT_MODEL
from models.errors import ModelError
from node.protocol import DEFAULT_PORT
from tui.chat.command import add_arguments as add_chat_arguments

if TYPE_CHECKING:
    from master.lan import LanOptions
    from master.session import Session
    from models.source import ModelSource
    from node.security import JoinToken


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"a .gguf file, an HF folder, or a bundled name (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--context", type=int, default=None, help="tokens of context to allocate (default 2048)"
    )
    p.add_argument("--threads", type=int, default=None, help="BLAS threads (default: all cores)")


def _add_cluster_args(p: argparse.ArgumentParser, lan: bool = False) -> None:
    p.add_argument(
        "--local-nodes",
        type=int,
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


def _add_lan_args(p: argparse.ArgumentParser, flag: str, workers: int) -> None:
    """Where devices join the master (`flag` names the address options) and how it is found."""
    p.add_argument(
        f"--{flag}bind", dest="lan_bind", default="0.0.0.0", help="address devices join on"
    )
    p.add_argument(
        f"--{flag}port",
        dest="lan_port",
        type=int,
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


def _add_memory_args(p: argparse.ArgumentParser, master: bool = True) -> None:
    if master:
        p.add_argument(
            "--dtype",
            choices=("f32", "f16", "bf16", "int8"),
            default="f32",
            help="how the shards store the weights (int8: per-channel scales)",
        )
        p.add_argument(
            "--memory-budget", default=None, help="memory for weights and KV cache, e.g. 2GB"
        )
    p.add_argument(
        "--window", type=_positive, default=None, help="layers of the slice in memory (forced)"
    )
    p.add_argument(
        "--drop-cache",
        action="store_true",
        help="drop each shard from the page cache after reading it (cold-disk benchmarks)",
    )


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _memory(args: argparse.Namespace) -> MemoryOptions:
    """The memory options given on the command line."""
    budget = getattr(args, "memory_budget", None)
    return MemoryOptions(
        budget=parse_size(budget) if budget else None,
        window=getattr(args, "window", None),
        dtype=getattr(args, "dtype", "f32"),
        drop_cache=getattr(args, "drop_cache", False),
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


def _parser() -> argparse.ArgumentParser:
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
    _add_cluster_args(run)
    _add_memory_args(run)
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
        join.add_argument("--threads", type=int, default=None)
        join.add_argument(
            "--memory-budget",
            default=None,
            help="for weights and KV cache, e.g. 2GB (default: RAM)",
        )
        _add_memory_args(join, master=False)
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
    _add_memory_args(bench)
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
    _add_model_args(serve)
    _add_cluster_args(serve, lan=True)
    _add_lan_args(serve, "cluster-", workers=0)
    _add_memory_args(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (or set EDGETP_API_KEY)",
    )
    serve.add_argument(
        "--max-batch", type=int, default=8, help="requests generated at once (KV-cache slots)"
    )

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
    add_chat_arguments(chat)

    kern = sub.add_parser(
        "kernels", help="the kernels this device admitted for a model's matrices, and their times"
    )
    kern.add_argument("--model", default=None, help=f"default: {DEFAULT_MODEL}")
    kern.add_argument(
        "--dtype",
        choices=("f32", "f16", "bf16", "int8"),
        action="append",
        default=None,
        help="shard dtypes to show (repeatable; default: all)",
    )
    kern.add_argument("--local-nodes", type=int, default=1, help="nodes the model is split across")
    kern.add_argument(
        "--threads",
        type=int,
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
    return parser


def _run(args: argparse.Namespace) -> None:
    from master.engine import context_size
    from master.generate import check_prompt, start, stream
    from master.sampling import SamplingParams
    from master.session import open_with_tokenizer, prompt_tokens

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )
    if not args.prompt.strip():
        raise ModelError("the prompt is empty: give some text")
    source, tokenizer = open_with_tokenizer(args.model)
    tokens = prompt_tokens(tokenizer, args.prompt, args.raw, args.system)
    check_prompt(tokens, context_size(source.config, args.context))  # before the slow load
    with _engine(args, source) as engine:
        seqs = start(engine, [tokens], [params])
        for _, text in stream(engine, tokenizer, seqs):
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")


def _engine(args: argparse.Namespace, source: ModelSource) -> contextlib.AbstractContextManager:
    """One process, or a local cluster of `--local-nodes` processes over loopback."""
    from master.local import local_engine

    nodes = len(args.capacities) if args.capacities else args.local_nodes
    return local_engine(
        source,
        nodes,
        capacities=args.capacities,
        threads=args.threads,
        state_dir=args.state_dir,
        context=args.context,
        verbose=args.verbose,
        memory=_memory(args),
    )


def _session(
    args: argparse.Namespace,
    source: ModelSource,
    slots: int,
    who: str,
    local: int | None = None,
) -> contextlib.AbstractContextManager[Session]:
    """The cluster a long-running command serves: `local` processes of this machine, or
    (None) a LAN master that devices join."""
    from master.lan import lan_session
    from master.local import local_session
    from memory.files import default_state_dir
    from models.kernels import set_threads

    if local is not None:
        return local_session(
            source,
            local,
            args.capacities,
            args.threads,
            args.state_dir,
            args.context,
            slots,
            args.verbose,
            memory=_memory(args),
        )
    set_threads(args.threads)
    return lan_session(
        source,
        args.state_dir or default_state_dir(),
        _lan(args),
        args.context,
        slots,
        _memory(args),
        args.capacities,
        who=who,
        workers=args.workers,
        join_timeout=args.join_timeout,
        progress=_split_progress(),
    )


def _local_nodes(args: argparse.Namespace) -> int | None:
    """The processes of this machine a serve or chat runs (None: devices join over the LAN)."""
    return len(args.capacities) if args.capacities else args.local_nodes


def _lan(args: argparse.Namespace) -> LanOptions:
    from master.lan import LanOptions

    if args.workers < 0:
        raise ValueError(f"--workers must be at least 0, got {args.workers}")
    return LanOptions(
        bind=args.lan_bind,
        port=args.lan_port,
        new_token=args.new_token,
        announce=not args.no_announce,
        cluster=args.cluster,
        interface=args.interface,
    )


def _split_progress() -> Any:
    """A progress callback `(stage, done, total)` drawing a bar while a split runs."""
    from tui.progress import StageBars

    return StageBars()


def _master(args: argparse.Namespace) -> None:
    from master.cluster import ClusterError
    from master.generate import start, stream
    from master.sampling import SamplingParams
    from master.session import open_with_tokenizer, prompt_tokens

    source, tokenizer = open_with_tokenizer(args.model)
    with _session(args, source, 1, "edgetp master") as session:
        if not sys.stdin.isatty():
            print(
                "edgetp master: ready; stdin is not a terminal, so it serves the cluster "
                "until stopped (SIGTERM or Ctrl-C)",
                file=sys.stderr,
                flush=True,
            )
            _until_stopped(session)
            return
        print("edgetp master: ready; type a prompt per line (Ctrl-D to stop)", file=sys.stderr)
        for line in _typed_lines(session):
            if not line.strip():
                continue
            try:
                assert session.engine is not None
                seqs = start(
                    session.engine,
                    [prompt_tokens(tokenizer, line.strip(), raw=False)],
                    [SamplingParams(max_tokens=args.max_tokens)],
                )
                for _, text in stream(session.engine, tokenizer, seqs):
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    session.answer_joins()
                sys.stdout.write("\n")
            except (ClusterError, ModelError) as exc:  # the master keeps running
                print(f"edgetp: error: {exc}", file=sys.stderr)


def _typed_lines(session: Session) -> Iterator[str]:
    """Lines typed at the terminal until Ctrl-D; while none comes, devices that join or leave
    are planned in (a joining device gives up on a master silent for 30 s)."""
    import select

    while True:
        session.replan_if_changed()
        if select.select([sys.stdin], [], [], 0.5)[0]:
            line = sys.stdin.readline()
            if not line:
                return
            yield line


def _until_stopped(session: Session) -> None:
    """Keep the cluster up, taking in devices that join or leave, until SIGTERM."""
    import signal
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        session.replan_if_changed(wait=0.5)
    print("edgetp master: stopping (SIGTERM)", file=sys.stderr)


def _join(args: argparse.Namespace) -> None:
    from memory.budget import parse_size
    from memory.files import default_state_dir
    from models.kernels import set_threads
    from node.security import TOKEN_ENV, JoinToken, load_node_token
    from node.worker import Worker, measure_capacity
    from tui.progress import progress_bar

    threads = set_threads(args.threads)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    state_dir = args.state_dir or default_state_dir()
    text = args.token or os.environ.get(TOKEN_ENV)
    token = JoinToken.parse(text) if text else load_node_token(state_dir)
    if args.master is None:
        address = _find_master(args.cluster, args.interface, token)
    else:
        address = args.master if ":" in args.master else f"{args.master}:{DEFAULT_PORT}"
    capacity = measure_capacity(threads, budget, args.window)
    with progress_bar("fetching shards", in_bytes=True) as fetch_progress:
        worker = Worker(
            address,
            capacity,
            state_dir,
            args.name,
            args.model,
            fetch_progress,
            token=token,
            drop_cache=args.drop_cache,
        )
        worker.run()


BROWSE_SECONDS = 3.0


def _find_master(cluster: str | None, interface: str | None, token: JoinToken | None) -> str:
    """HOST:PORT of the master found on the LAN, asking when there are several."""
    from node.discovery import browse
    from node.security import fingerprint

    print(f"edgetp: looking for masters on the LAN ({BROWSE_SECONDS:.0f} s)...", file=sys.stderr)
    ads = browse(BROWSE_SECONDS, interface)
    if token:  # a master whose key is not the token's cannot be the one meant
        ads = [a for a in ads if a.fingerprint == fingerprint(token.master_public)] or ads
    if cluster:
        ads = [a for a in ads if a.cluster == cluster]
    if not ads:
        what = f"no master named {cluster!r}" if cluster else "no master"
        raise ValueError(
            f"{what} answered on the LAN within {BROWSE_SECONDS:.0f} s (multicast may be "
            f"blocked here); give its address: edgetp join HOST:PORT --token TOKEN"
        )
    if len(ads) == 1:
        ad = ads[0]
    elif sys.stdin.isatty():
        for i, a in enumerate(ads, 1):
            print(f"  {i}. {a.cluster}  {a.model}  {a.address}", file=sys.stderr)
        choice = input(f"join which master [1-{len(ads)}]? ").strip()
        if not choice.isdigit() or not 1 <= int(choice) <= len(ads):
            raise ValueError(f"no master numbered {choice!r}")
        ad = ads[int(choice) - 1]
    else:
        names = ", ".join(f"{a.cluster} ({a.address})" for a in ads)
        raise ValueError(f"several masters answered: {names}; pick one with --cluster NAME")
    print(f"edgetp: joining {ad.cluster} at {ad.address} ({ad.model})", file=sys.stderr)
    return ad.address


def _bench(args: argparse.Namespace) -> None:
    from master.bench import run_bench, run_cluster_bench

    if args.local_nodes:
        run_cluster_bench(
            args.model,
            args.local_nodes,
            args.tokens,
            args.json,
            args.context,
            args.state_dir,
            _memory(args),
            args.rss_tokens,
            args.rounds,
        )
    else:
        run_bench(args.model, args.tokens, args.rounds, args.json, args.threads, args.context)


def _serve(args: argparse.Namespace) -> None:
    from master.bridge.server import serve
    from master.session import open_with_tokenizer

    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1, got {args.max_batch}")
    source, tokenizer = open_with_tokenizer(args.model)
    serve(
        _session(args, source, args.max_batch, "edgetp serve", _local_nodes(args)),
        source,
        tokenizer,
        args.model,
        args.host,
        args.port,
        args.api_key or os.environ.get("EDGETP_API_KEY"),
        args.verbose,
    )


def _chat(args: argparse.Namespace) -> None:
    from tui.chat.command import run

    run(args)


def _bench_serve(args: argparse.Namespace) -> None:
    from master.bridge.bench import run_serve_bench

    run_serve_bench(
        args.model,
        args.local_nodes,
        args.clients,
        args.tokens,
        args.rounds,
        args.context,
        args.state_dir,
        args.json,
    )


def _synth(args: argparse.Namespace) -> None:
    from memory.budget import format_size
    from models.kernels import DTYPES
    from models.synth import synthetic_size, write_synthetic_model
    from tui.progress import progress_bar

    dtype = DTYPES[args.dtype]
    size = synthetic_size(args.shape, args.layers, dtype)
    print(
        f"edgetp synth: {args.shape}, {args.layers} layers, {args.dtype}: "
        f"{format_size(size)} to {args.out}",
        file=sys.stderr,
    )
    with progress_bar("writing", in_bytes=True) as progress:
        write_synthetic_model(args.shape, args.layers, args.out, dtype, args.seed, progress)
    print(f"edgetp synth: done; run it with --model {args.out}", file=sys.stderr)


def _kernels(args: argparse.Namespace) -> None:
    from master.local import thread_share
    from master.plan import plan_slices
    from memory.files import default_state_dir
    from models.kernels import set_threads
    from models.source import open_model
    from node.device import describe, plan_shapes, prepare

    if args.local_nodes < 1:
        raise ModelError("--local-nodes must be at least 1")
    config = open_model(args.model).config
    threads = set_threads(args.threads or thread_share(args.local_nodes))
    slices = plan_slices(config, [1.0] * args.local_nodes)
    shapes = [
        s
        for d in args.dtype or ("f32", "f16", "bf16", "int8")
        for s in plan_shapes(config, slices, d)
    ]
    cache_dir = default_state_dir() / "kernels"
    if args.recheck:
        for old in cache_dir.glob("*.json"):
            old.unlink()
    prepared = prepare(shapes, cache_dir, install=False)
    print(describe(prepared, shapes, threads))


COMMANDS = {
    "run": _run,
    "bench": _bench,
    "master": _master,
    "join": _join,
    "node": _join,
    "serve": _serve,
    "bench-serve": _bench_serve,
    "synth": _synth,
    "chat": _chat,
    "kernels": _kernels,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from master.cluster import ClusterError
    from node.worker import NodeError

    try:
        COMMANDS[args.command](args)
    except (ModelError, ValueError, ClusterError, NodeError) as exc:
        if args.verbose:
            logging.exception("details")
        print(f"edgetp: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edgetp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
