"""`edgetp chat`'s options and start-up: attach to a bridge, or start a local one, then the app.

Only argparse is imported at module level: the `edgetp` parser is built on every command.
"""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 512}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The chat's own options (the model and cluster options are the shared ones)."""
    p.add_argument(
        "--connect",
        metavar="URL",
        default=None,
        help="attach to a running edgetp serve (e.g. http://127.0.0.1:8000) instead of "
        "starting a local cluster",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the key of the bridge given to --connect (or EDGETP_API_KEY)",
    )
    p.add_argument("--system", default="", help="system prompt (changeable in the app)")
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_SAMPLING["temperature"],
        help="0 = greedy (default %(default)s)",
    )
    p.add_argument("--top-p", type=float, default=DEFAULT_SAMPLING["top_p"])
    p.add_argument("--max-tokens", type=int, default=DEFAULT_SAMPLING["max_tokens"])


def run(args: argparse.Namespace) -> None:
    """Start (or reach) the bridge, run the app until it quits, then stop what was started."""
    import os

    from textual.logging import TextualHandler

    from edgetp.master.bridge.client import BridgeError, ServerProcess, start_server
    from edgetp.models.errors import ModelError
    from edgetp.tui.chat.app import ChatApp, conversations_dir
    from edgetp.tui.chat.client import BridgeClient, Sampling, check_bridge
    from edgetp.tui.chat.store import ConversationStore

    sampling = Sampling(args.temperature, args.top_p, args.max_tokens)
    store = ConversationStore(conversations_dir(args.state_dir))
    # The app owns the terminal: log records go to Textual's log, not across the screen.
    logging.getLogger().handlers[:] = [TextualHandler(stderr=False)]
    local: ServerProcess | None = None
    try:
        if args.connect:
            _only_local(args)
            base = args.connect
            api_key = args.api_key or os.environ.get("EDGETP_API_KEY")
            check_bridge(base, api_key)
            hint = join = ""
        else:
            nodes = len(args.capacities) if args.capacities else args.local_nodes
            what = f"a local cluster of {nodes} node(s)" if nodes else "a cluster devices can join"
            print(f"edgetp chat: starting {what}…", file=sys.stderr)
            local = start_server(_serve_args(args), verbose=args.verbose)
            base = local.base
            api_key = None
            hint = "The local cluster stays down: quit (Ctrl+Q) and start edgetp chat again."
            join = next((line for line in local.log if "edgetp join" in line), "")
            if join:  # the app is about to take the screen: it shows the line too
                print(join, file=sys.stderr)
        app = ChatApp(
            BridgeClient(base, api_key),
            store,
            system=args.system,
            sampling=sampling,
            down_hint=hint,
            join_hint=join,
        )
        app.run()
    except BridgeError as exc:
        raise ModelError(str(exc)) from exc
    finally:
        if local is not None:
            local.stop()


def _serve_args(args: argparse.Namespace) -> list[str]:
    out = ["--local-nodes", str(args.local_nodes)] if args.local_nodes is not None else []
    if args.capacities:
        out += ["--capacities", ",".join(f"{c:g}" for c in args.capacities)]
    for flag, value in (
        ("--model", args.model),
        ("--context", args.context),
        ("--threads", args.threads),
        ("--state-dir", args.state_dir),
        ("--memory-budget", args.memory_budget),
        ("--kv-cache", args.kv_cache if args.kv_cache != "f32" else None),
        ("--window", args.window),
        ("--dtype", args.dtype),
        ("--activations", args.activations if args.activations != "exact" else None),
        ("--attention", args.attention if args.attention != "auto" else None),
        ("--wire", args.wire if args.wire != "float32" else None),
        ("--draft", args.draft if args.draft != "off" else None),
        ("--draft-dtype", args.draft_dtype if args.draft_dtype != "auto" else None),
        ("--cluster-bind", args.lan_bind),
        ("--cluster-port", args.lan_port),
        ("--workers", args.workers),
        ("--join-timeout", args.join_timeout),
        ("--cluster", args.cluster),
        ("--interface", args.interface),
    ):
        if value is not None:
            out += [flag, str(value)]
    for flag, given in (
        ("--drop-cache", args.drop_cache),
        ("--new-token", args.new_token),
        ("--no-announce", args.no_announce),
    ):
        if given:
            out.append(flag)
    return out


def _only_local(args: argparse.Namespace) -> None:
    given = [
        flag
        for flag, value in (
            ("--model", args.model),
            ("--context", args.context),
            ("--threads", args.threads),
            ("--capacities", args.capacities),
            ("--local-nodes", args.local_nodes),
            ("--workers", args.workers or None),
            ("--no-announce", args.no_announce or None),
            ("--memory-budget", args.memory_budget),
            ("--kv-cache", args.kv_cache if args.kv_cache != "f32" else None),
            ("--window", args.window),
            ("--dtype", args.dtype),
            ("--activations", args.activations if args.activations != "exact" else None),
            ("--attention", args.attention if args.attention != "auto" else None),
            ("--wire", args.wire if args.wire != "float32" else None),
            ("--drop-cache", args.drop_cache or None),
            ("--draft", args.draft if args.draft != "off" else None),
            ("--draft-dtype", args.draft_dtype if args.draft_dtype != "auto" else None),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} set up a local cluster; with --connect the running server "
            f"decides them: leave them out"
        )
