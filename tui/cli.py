"""The `edgetp` command: one console script, one subcommand per job.

Errors a person can fix (a wrong path, a bad value) print one line to stderr and exit 1; they
never show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from models.errors import ModelError
from models.source import DEFAULT_MODEL


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"a .gguf file, an HF folder, or a bundled name (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--context", type=int, default=None, help="tokens of context to allocate (default 2048)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


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
    run.add_argument("prompt", help="the prompt")

    bench = sub.add_parser("bench", help="measure ms/token against the reference implementation")
    _add_model_args(bench)
    bench.add_argument("--tokens", type=int, default=64, help="greedy tokens to time")
    bench.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians kept")
    bench.add_argument("--json", default=None, help="also write the results to this file")
    return parser


def _run(args: argparse.Namespace) -> None:
    from master.engine import Engine, context_size
    from master.generate import check_prompt, start, stream
    from master.sampling import SamplingParams
    from master.session import open_with_tokenizer, prompt_tokens, set_threads

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
    set_threads(args.threads)
    source, tokenizer = open_with_tokenizer(args.model)
    tokens = prompt_tokens(tokenizer, args.prompt, args.raw, args.system)
    check_prompt(tokens, context_size(source.config, args.context))  # before the slow load
    engine = Engine.local(source, max_context=args.context)
    seqs = start(engine, [tokens], [params])
    for _, text in stream(engine, tokenizer, seqs):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _bench(args: argparse.Namespace) -> None:
    from master.bench import run_bench

    run_bench(args.model, args.tokens, args.rounds, args.json, args.threads, args.context)


COMMANDS = {"run": _run, "bench": _bench}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        COMMANDS[args.command](args)
    except (ModelError, ValueError) as exc:
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
