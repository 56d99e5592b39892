"""Turning what a person typed into prompt tokens, and loading a model into an engine."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from master.cluster import Hub
from master.engine import Engine, context_size
from master.plan import plan_slices
from master.splitter import split_model
from memory.shards import ShardStore
from models.chat_template import render_chat
from models.errors import ModelError
from models.source import ModelSource, open_model
from models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    source: ModelSource
    tokenizer: Tokenizer
    engine: Engine


def set_threads(threads: int | None = None) -> int:
    """This process's share of the cores (all unless told otherwise) for the BLAS matmuls.

    Torch keeps one thread: the projections run on OpenBLAS (models/kernels.py) and what torch
    still does per step is small; its OpenMP workers spinning between ops would steal the cores
    from OpenBLAS's threads (measured: 260 ms/token instead of 14 on SmolLM2 with both at 2).
    """
    from threadpoolctl import threadpool_limits

    n = threads or os.cpu_count() or 1
    torch.set_num_threads(1)
    threadpool_limits(limits=n, user_api="blas")
    return n


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
    hub: Hub,
    capacities: Sequence[float],
    state_dir: Path,
    max_context: int | None = None,
    slots: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
) -> Engine:
    """Plan for the master and the joined workers, split, ship, and build the master's engine.

    `capacities` has one entry per node, the master first.
    """
    context = context_size(source.config, max_context)
    slices = plan_slices(source.config, capacities)
    store = ShardStore(state_dir / "shards")
    split_progress = (lambda d, t: progress("splitting", d, t)) if progress else None
    manifest = split_model(source, slices, store, split_progress)
    hub.ship(manifest, store, context, slots)
    return Engine.from_manifest(manifest, store, context, slots, remote=hub)
