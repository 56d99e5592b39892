"""The `edgetp` command: one console script, one subcommand per job.

Each command here takes the parsed arguments (`tui.arguments`) and calls the package that does
the work. Errors a person can fix (a wrong path, a bad value) print one line to stderr and exit
1; they never show a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NoReturn

from edgetp.models.dtypes import DTYPE_CHOICES
from edgetp.models.errors import ModelError
from edgetp.tui.arguments import build_parser, memory_options
from edgetp.tui.join import join

if TYPE_CHECKING:
    from edgetp.master.cluster.lan import LanOptions
    from edgetp.master.cluster.session import Session
    from edgetp.models.hub import LocalModel, Name
    from edgetp.models.source import ModelSource


def _run(args: argparse.Namespace) -> None:
    from edgetp.master.generation.params import SamplingParams
    from edgetp.models.bundled import model_path

    # A wrong path, an empty prompt, a sampling value out of range: said before the slow imports.
    model_path(args.model)
    if not args.prompt.strip():
        raise ModelError("the prompt is empty: give some text")
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )
    _start_fork_server(args)
    from edgetp.master.cluster.engine import context_size
    from edgetp.master.generation.generate import check_prompt, start, stream
    from edgetp.master.generation.prompts import open_with_tokenizer, prompt_tokens
    from edgetp.master.generation.speculate import draft_source, open_speculator

    source, tokenizer = open_with_tokenizer(args.model)
    tokens = prompt_tokens(tokenizer, args.prompt, args.raw, args.system, args.enable_thinking)
    check_prompt(tokens, context_size(source.config, args.context))  # before the slow load
    draft_source(args.draft, tokenizer)
    with _local_session(args, source, 1, _local_nodes(args) or 1) as session:
        assert session.engine is not None
        speculator = open_speculator(args.draft, args.draft_dtype, session, tokenizer)
        try:
            seqs = start(session.engine, [tokens], [params])
            for _, text in stream(session.engine, tokenizer, seqs, speculator):
                sys.stdout.write(text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        finally:
            if speculator is not None:
                speculator.close()


@contextlib.contextmanager
def _local_session(
    args: argparse.Namespace, source: ModelSource, slots: int, nodes: int
) -> Iterator[Session]:
    from edgetp.master.cluster.local import local_session
    from edgetp.master.emulate.devices import emulated
    from edgetp.memory.files import default_state_dir

    state_dir = args.state_dir or default_state_dir()
    with (
        emulated(getattr(args, "device", None), nodes, state_dir) as devices,
        local_session(
            source,
            nodes,
            args.capacities,
            args.threads,
            state_dir,
            args.context,
            slots,
            args.verbose,
            memory=memory_options(args),
            devices=devices,
        ) as session,
    ):
        yield session


def _session(
    args: argparse.Namespace,
    source: ModelSource,
    slots: int,
    who: str,
    local: int | None = None,
) -> contextlib.AbstractContextManager[Session]:
    """The cluster a long-running command serves: `local` processes of this machine, or
    (None) a LAN master that devices join."""
    from edgetp.master.cluster.lan import lan_session
    from edgetp.memory.files import default_state_dir
    from edgetp.models.kernels import set_threads
    from edgetp.tui.progress import StageBars

    if local is not None:
        return _local_session(args, source, slots, local)
    set_threads(args.threads)
    return lan_session(
        source,
        args.state_dir or default_state_dir(),
        _lan(args),
        args.context,
        slots,
        memory_options(args),
        args.capacities,
        who=who,
        workers=args.workers,
        join_timeout=args.join_timeout,
        progress=StageBars(),  # a bar per stage while the model is split and shipped
    )


def _local_nodes(args: argparse.Namespace) -> int | None:
    """The processes of this machine a command runs (None: devices join over the LAN). Specs
    for several `--device`s say how many, where `--local-nodes` does not."""
    if args.capacities:
        return len(args.capacities)
    devices = getattr(args, "device", None) or []
    if len(devices) > 1 and args.local_nodes in (None, 1):
        return len(devices)
    if devices and args.local_nodes is None:
        return 1
    return args.local_nodes


def _start_fork_server(args: argparse.Namespace) -> None:
    """A command that will start local workers starts the server they fork from now: its
    imports (torch and the node's code, 2.2 s of a Zen 3 core) run beside this process's own
    instead of after them. An emulated device's worker starts in its cgroups, not forked."""
    if (_local_nodes(args) or 1) > 1 and not getattr(args, "device", None):
        from edgetp.node import children

        children.start_server()


def _lan(args: argparse.Namespace) -> LanOptions:
    from edgetp.master.cluster.lan import LanOptions

    if args.workers < 0:
        raise ValueError(f"--workers must be at least 0, got {args.workers}")
    return LanOptions(
        bind=args.lan_bind,
        port=args.lan_port,
        new_token=args.new_token,
        announce=not args.no_announce,
        cluster=args.cluster,
        interface=args.interface,
        every_device=args.every_device,
    )


def _master(args: argparse.Namespace) -> None:
    from edgetp.master.cluster.transport import ClusterError
    from edgetp.master.generation.generate import start, stream
    from edgetp.master.generation.params import SamplingParams
    from edgetp.master.generation.prompts import open_with_tokenizer, prompt_tokens

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
    import threading

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        session.replan_if_changed(wait=0.5)
    print("edgetp master: stopping (SIGTERM)", file=sys.stderr)


def _bench(args: argparse.Namespace) -> None:
    from edgetp.master.bench.cluster import run_cluster_bench
    from edgetp.master.bench.reference import run_bench

    if args.local_nodes or args.prompt_tokens is not None:
        run_cluster_bench(
            args.model,
            args.local_nodes or [1],
            args.tokens,
            args.json,
            args.context,
            args.state_dir,
            memory_options(args),
            args.rss_tokens,
            args.rounds,
            args.device,
            args.baseline,
            args.draft or ["off"],
            args.prompt,
            args.draft_dtype,
            args.threads,
            prompt_length=args.prompt_tokens,
            attentions=args.attention or ["auto"],
            wires=args.wire or ["float32"],
        )
    else:
        run_bench(args.model, args.tokens, args.rounds, args.json, args.threads, args.context)


def _serve(args: argparse.Namespace) -> None:
    from edgetp.master.bridge.listen import bind, check_api_key

    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1, got {args.max_batch}")
    api_key = args.api_key or os.environ.get("EDGETP_API_KEY")
    check_api_key(api_key)
    sock = bind(args.host, args.port)  # before the slow imports and load: a taken port fails now
    try:  # until serve owns the socket
        from edgetp.models.bundled import model_path

        model_path(args.model)
        _start_fork_server(args)
        from edgetp.master.bridge.server import serve
        from edgetp.master.generation.prompts import open_with_tokenizer
        from edgetp.master.generation.speculate import draft_source

        models = [
            (*open_with_tokenizer(path), name)
            for path, name in zip(args.models, args.model_names, strict=True)
        ]
        draft_source(args.draft, models[0][1])  # before the slow load
        local = _local_nodes(args)
        if len(models) > 1 and local is None:
            raise ValueError(
                "several --model need --local-nodes: a LAN master serves one model (its "
                "devices would have to join again at each switch)"
            )

        def sessions(source: ModelSource) -> contextlib.AbstractContextManager[Session]:
            return _session(_own(source), source, args.max_batch, "edgetp serve", local)

        def _own(source: ModelSource) -> argparse.Namespace:
            return argparse.Namespace(**{**vars(args), "model": str(source.path)})  # its dtype

        def need(source: ModelSource) -> int:
            from edgetp.master.cluster.engine import context_size
            from edgetp.master.cluster.plan import resident_bytes

            memory = memory_options(_own(source))
            context = context_size(source.config, args.context)
            return resident_bytes(source, memory.dtype, memory.kv_cache, context, args.max_batch)

        from edgetp.memory.budget import machine_memory_budget

        given = memory_options(args).budget
        # several models stay resident while their needs fit in this machine's memory (its
        # nodes are all here: several models need --local-nodes)
        budget = given * (local or 1) if given is not None else machine_memory_budget()

    except BaseException:
        sock.close()
        raise
    serve(
        sessions,
        models,
        sock,
        api_key,
        args.verbose,
        (args.draft, args.draft_dtype),
        args.cors_origin,
        args.prompt_reuse,
        args.unload_after,
        args.prefill_chunk_ms / 1000 if args.prefill_chunk_ms else None,
        (need, budget),
    )


def _chat(args: argparse.Namespace) -> None:
    from edgetp.tui.chat.command import run

    run(args)


def _bench_serve(args: argparse.Namespace) -> None:
    from edgetp.master.bench.serve import run_serve_bench

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
    from edgetp.master.bench.synth import synthetic_size, write_synthetic_model
    from edgetp.memory.budget import format_size
    from edgetp.models.kernels import DTYPES
    from edgetp.tui.progress import progress_bar

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


def _pull(args: argparse.Namespace) -> None:
    from edgetp.memory.budget import format_size
    from edgetp.models.hub import model_files, pull

    name = _hub_name(args.name)
    path = pull(name)
    size = sum(p.stat().st_size for p in model_files(path))
    print(f"edgetp pull: {name}: {format_size(size)} in {path}", file=sys.stderr)
    print(path)  # for scripts: --model "$(edgetp pull NAME)"


def _hub_name(text: str) -> Name:
    from edgetp.models.hub import parse_name

    name = parse_name(text)
    if name is None:
        raise ModelError(f"{text!r} is not a model on the hub: give OWNER/REPO[:QUANT]")
    return name


def _models(args: argparse.Namespace) -> None:
    from edgetp.memory.budget import format_size
    from edgetp.memory.files import default_state_dir
    from edgetp.models.hub import local_models, mirrored_models

    models = local_models() + mirrored_models(default_state_dir() / "remote")
    if not models:
        print("edgetp models: none in the cache; fetch one with `edgetp pull OWNER/REPO[:QUANT]`",
              file=sys.stderr)  # fmt: skip
        return

    def size(m: LocalModel) -> str:  # a mirror holds the part of the files read so far
        return format_size(m.size) + (f" of {format_size(m.whole)}" if m.whole else "")

    rows = [("NAME", "SIZE", "FORMAT", "FAMILY", "QUANT")] + [
        (m.name, size(m), m.format, m.family, m.quant) for m in models
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _rm(args: argparse.Namespace) -> None:
    from edgetp.memory.budget import format_size
    from edgetp.memory.files import default_state_dir
    from edgetp.models.hub import remove

    name = _hub_name(args.name)
    freed = remove(name, default_state_dir() / "remote")
    print(f"edgetp rm: removed {name} ({format_size(freed)} freed)", file=sys.stderr)


def _resolve_names(args: argparse.Namespace) -> None:
    """A model named OWNER/REPO[:QUANT] becomes its local path, pulled first if the cache lacks
    it: every command that opens a model (and a draft model) gets a path, whatever the front.
    `model_name` keeps what was asked for (the bridge accepts it in requests)."""
    from edgetp.memory.files import default_state_dir
    from edgetp.models.hub import resolve_model

    if args.command in ("join", "node") or not hasattr(args, "model"):
        return  # join's --model is a name to compare with the master's, not a file
    state_dir = getattr(args, "state_dir", None) or default_state_dir()
    # serve's --model is repeatable: each is resolved, the first is the one the others' options
    # (its dtype, --draft) go with
    asked = args.model if isinstance(args.model, list) else [args.model]
    args.model_names = asked
    # a GGUF by name: each device fetches its slices' bytes (models/ranges.py), none the file
    args.models = [resolve_model(m, state_dir / "remote") for m in asked]
    args.model_name, args.model = asked[0], args.models[0]
    draft = getattr(args, "draft", None)
    if isinstance(draft, list):
        args.draft = [d if d in ("lookup", "off") else resolve_model(d) for d in draft]
    elif draft not in (None, "lookup", "off"):
        args.draft = resolve_model(draft)


def _kernels(args: argparse.Namespace) -> None:
    from edgetp.master.cluster.local import thread_share
    from edgetp.master.cluster.plan import plan_slices
    from edgetp.memory.files import default_state_dir
    from edgetp.models.kernels import set_threads
    from edgetp.models.source import open_model
    from edgetp.node.device import plan_shapes, prepare
    from edgetp.node.kernel_table import describe

    source = open_model(args.model)
    threads = set_threads(args.threads or thread_share(args.local_nodes))
    shapes = []
    for d in args.dtype or DTYPE_CHOICES:
        slices = plan_slices(source.config, [1.0] * args.local_nodes, source.ffn_align(d))
        shapes += plan_shapes(source, slices, d)
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
    "join": join,
    "node": join,
    "serve": _serve,
    "bench-serve": _bench_serve,
    "synth": _synth,
    "chat": _chat,
    "kernels": _kernels,
    "pull": _pull,
    "models": _models,
    "rm": _rm,
}


# The errors whose message says what went wrong and what to do: printed as one line. Looked up
# where this run imported them, not imported: a class from a module the command never imported
# cannot be what it raised, and importing those modules (torch under them) would make every
# early error, a bad option, wait seconds for its line.
CLEAR_ERRORS = (
    ("edgetp.master.cluster.transport", "ClusterError"),
    ("edgetp.node.worker", "NodeError"),
    ("edgetp.master.emulate.host", "DeviceError"),
)


def _said_clearly(exc: Exception) -> bool:
    kinds = [ModelError, ValueError]
    for module, name in CLEAR_ERRORS:
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return isinstance(exc, tuple(kinds))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGINT is how a node is told to leave (it says LEAVE) and a server to stop. A process
    # inherits an ignored SIGINT from its parent (a script's `trap '' INT`, a shell's background
    # job, a parent inside glibc's system()), and Python keeps it ignored: such a node would
    # serve on, unnoticed, where its owner asked it to leave.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        _resolve_names(args)
        COMMANDS[args.command](args)
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("edgetp: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not _said_clearly(exc):
            raise
        if args.verbose:
            logging.exception("details")
        print(f"edgetp: error: {exc}", file=sys.stderr)
        return 1
    return 0


def run() -> NoReturn:
    """The `edgetp` program: `main`, and out without the interpreter's teardown
    (node.children.exit_now says why)."""
    code = main()
    from edgetp.node.children import exit_now

    exit_now(code)


if __name__ == "__main__":
    run()
