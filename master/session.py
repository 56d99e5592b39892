"""Turning what a person typed into prompt tokens, and loading a model into an engine."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from master.cluster import Hub
from master.engine import Engine, context_size
from master.plan import plan_slices
from master.splitter import split_model
from memory.budget import ALL_RESIDENT, BudgetError, MemoryOptions, MemoryPlan, plan_memory
from memory.shards import Manifest, ShardStore
from models.chat_template import render_chat
from models.config import ModelConfig
from models.errors import ModelError
from models.layers import Slice
from models.source import ModelSource, open_model
from models.tokenizer import Tokenizer
from node.kvcache import KVCache

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    source: ModelSource
    tokenizer: Tokenizer
    engine: Engine


def load(
    model: str | None,
    capacities: Sequence[float] = (1.0,),
    max_context: int | None = None,
    slots: int = 1,
) -> LoadedModel:
    source = open_model(model)
    tokenizer = source.tokenizer()
    engine = Engine.local(source, capacities, max_context=max_context, slots=slots)
    return LoadedModel(source, tokenizer, engine)


def open_with_tokenizer(model: str | None) -> tuple[ModelSource, Tokenizer]:
    """The model's source and tokenizer, without loading weights: cheap checks come first."""
    source = open_model(model)
    return source, source.tokenizer()


def prompt_tokens(
    tokenizer: Tokenizer, text: str, raw: bool, system: str | None = None
) -> list[int]:
    """Tokens for a one-turn prompt: chat-templated, or the text as is when `raw`."""
    if not text.strip():
        raise ModelError("the prompt is empty: give some text")
    if raw:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return chat_tokens(tokenizer, messages)


def chat_tokens(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if not tokenizer.chat_template:
        raise ModelError("this model has no chat template: use --raw to give the prompt as is")
    rendered = render_chat(
        tokenizer.chat_template,
        messages,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    # The template writes any BOS itself; adding another would change the model's input.
    return tokenizer.encode(rendered, add_bos=False)


def cluster_engine(
    source: ModelSource,
    hub: Hub | None,
    capacities: Sequence[float],
    state_dir: Path,
    max_context: int | None = None,
    slots: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
    memory: MemoryOptions = ALL_RESIDENT,
) -> Engine:
    """Plan for the master and the joined workers, split, ship, and build the master's engine.

    `capacities` has one entry per node, the master first. Without a hub, the master alone
    runs the whole model from its shards (streamed through a window if the memory says so).
    """
    context = context_size(source.config, max_context)
    slices = plan_slices(source.config, capacities)
    store = ShardStore(state_dir / "shards")
    split_progress = (lambda d, t: progress("splitting", d, t)) if progress else None
    manifest = split_model(source, slices, store, split_progress, memory.dtype)
    try:
        plans = memory_plans(manifest, hub, context, slots, memory)
    except ModelError as exc:  # tell the workers why, or they only see the master go
        if hub is not None:
            hub.close(reason=f"the master cannot run this plan: {exc}")
        raise
    context = min(p.context for p in plans)
    if hub is not None:
        hub.ship(manifest, store, context, slots, windows=[p.window for p in plans])
    engine = Engine.from_manifest(
        manifest, store, context, slots, hub, plans[0].window, memory.drop_cache, memory.mode
    )
    engine.memory_budget = memory.budget
    return engine


def memory_plans(
    manifest: Manifest, hub: Hub | None, context: int, slots: int, memory: MemoryOptions
) -> list[MemoryPlan]:
    """Each node's window and context under its budget (the master's from `memory`, the
    workers' from their HELLO), all with the smallest context any of them can hold.

    Decided here, on the master, because only the master knows every node's slice size; a
    budget too small for some node is an error naming it.
    """
    config = ModelConfig.from_dict(manifest.config)
    members = hub.members if hub is not None else []
    names = ["the master", *(f"node {m.name}" for m in members)]
    budgets = [memory.budget, *(m.capacity.memory_budget for m in members)]
    windows = [memory.window, *(m.capacity.window for m in members)]

    def plan(k: int, ctx: int) -> MemoryPlan:
        s = Slice.from_dict(manifest.slices[k])
        return plan_memory(
            budgets[k],
            max(r.size for r in manifest.nodes[k]),
            config.n_layers,
            KVCache.bytes_per_token(config, s, torch.float32) * slots,
            ctx,
            fixed_bytes=manifest.globals.size if k == 0 else 0,
            window=windows[k],
            who=names[k],
        )

    layers = manifest.nodes[0]
    try:
        first = [plan(k, context) for k in range(len(names))]
        smallest = min(p.context for p in first)
        plans = [plan(k, smallest) for k in range(len(names))]
    except BudgetError as exc:
        raise ModelError(str(exc)) from exc
    for name, p in zip(names, plans, strict=True):
        log.info(
            "%s: %d of %d layers in memory, context %d", name, p.window, len(layers), p.context
        )
    return plans
