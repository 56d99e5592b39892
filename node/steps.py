"""A serving node's work on one STEP: checked against what the node holds, then computed.

A STEP's types are checked as it decodes (node/messages.py); what is left to check needs the
node's state: the layer against its model, the batch against its KV cache, the hidden state's
shape against the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from edgetp.models.config import ModelConfig
from edgetp.models.layers import StepBatch
from edgetp.models.moe import Routing
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.executor import Hidden, SliceExecutor
from edgetp.node.kvcache import KVCache
from edgetp.node.messages import ProtocolError, Step


@dataclass(frozen=True)
class Work:
    """One block of one layer to compute, checked: the step's batch and the hidden state."""

    step: int
    layer: int
    block: P.Block
    batch: StepBatch  # the step's (sent with its first block)
    hidden: np.ndarray  # decode (B, D), else (B, T, D); the HEAD's final-normed rows (R, D)
    begins: bool  # the step's first block: its batch came with it
    routing: Routing | None = None  # a mixture of experts' FFN block: the tokens' experts
    wire: str = "float32"  # what the hidden state came as, and so what the partial goes back as


# What a serving node acts on besides a STEP: a re-plan (WELCOME, or STANDBY without it), the
# probes before a plan, BYE.
SERVING = (M.Welcome, M.Standby, M.Measure, M.Echo, M.Bye)


def read_serving(
    frames: list[Any], config: ModelConfig, cache: KVCache, batch: StepBatch | None
) -> tuple[M.FromMaster, list[np.ndarray], Work | None]:
    """What a serving node is told, its tensors, and for a STEP the work checked against what
    the node holds (`config`, `cache`, the step's `batch` so far); ProtocolError for anything
    it cannot act on."""
    message, tensors = M.decode_from_master(frames)
    if isinstance(message, Step):
        return message, tensors, check_step(message, tensors, config, cache, batch)
    if not isinstance(message, SERVING):
        raise ProtocolError(f"unexpected {message.__struct_config__.tag!r} while serving steps")
    return message, tensors, None


def check_step(
    step: Step,
    tensors: list[np.ndarray],
    config: ModelConfig,
    cache: KVCache,
    batch: StepBatch | None,
) -> Work:
    """A STEP this node can compute with what it holds (`config`, `cache`, the step's `batch`
    so far), or ProtocolError saying why not."""
    begins = step.batch is not None
    batch = step.batch if step.batch is not None else batch
    if batch is None:
        raise ProtocolError("a STEP before any batch was given")
    layer, block = step.layer, step.block
    head = block == P.HEAD
    if (head and layer != config.n_layers) or (not head and layer >= config.n_layers):
        raise ProtocolError(f"a STEP for layer {layer!r}, block {block!r}")
    if not (
        0 < batch.size == len(batch.starts) == len(batch.lengths)
        and all(0 <= slot < cache.slots for slot in batch.slots)
        and all(0 <= a and 0 < n and a + n <= cache.max_context
                for a, n in zip(batch.starts, batch.lengths, strict=True))
    ):  # fmt: skip
        raise ProtocolError(f"a STEP batch this node cannot hold: {batch}")
    shape = (batch.size, config.hidden) if batch.rows else (batch.size, batch.width, config.hidden)
    if head:  # the final-normed rows the master takes logits of: one per sequence, or per token
        rows = tensors[0].shape[0] if len(tensors) == 1 and tensors[0].ndim == 2 else 0
        shape = (rows if 0 < rows <= batch.size * batch.width else -1, config.hidden)
    # A block's hidden state may come as float16 (`MemoryOptions.wire`): its partial goes back
    # the same way. The HEAD's rows are float32 always.
    wires = (np.float32,) if head else (np.float32, np.float16)
    if len(tensors) != 1 or tensors[0].shape != shape or tensors[0].dtype not in wires:
        got = [(t.dtype.name, t.shape) for t in tensors]
        raise ProtocolError(f"a STEP's hidden state is {got}, not one float32 {shape}")
    routing = check_routing(step, config, batch.size * batch.width)
    hidden, wire = tensors[0], tensors[0].dtype.name
    if wire != "float32":
        hidden = hidden.astype(np.float32)
    return Work(step.step, layer, block, batch, hidden, begins, routing, wire)


def check_routing(step: Step, config: ModelConfig, tokens: int) -> Routing | None:
    """A STEP's choice of experts: each of the step's `tokens` with `n_experts_used` experts
    (and a shared expert's `n_shared` pieces) below `n_stacked` and as many finite weights,
    where it is an FFN block of experts; none elsewhere. ProtocolError otherwise."""
    wanted = config.moe and step.block == P.FFN
    if step.experts is None and step.expert_weights is None and not wanted:
        return None
    if not wanted:
        raise ProtocolError(f"experts in a STEP for block {step.block!r} of {config.architecture}")
    if step.experts is None or step.expert_weights is None:
        raise ProtocolError("an FFN STEP of experts without its experts and their weights")
    shape = (tokens, config.n_experts_used + config.n_shared)
    try:
        experts = np.array(step.experts, dtype=np.int64)
        weights = np.array(step.expert_weights, dtype=np.float32)
    except ValueError as exc:  # ragged lists
        raise ProtocolError(f"a STEP's experts are not a table: {exc}") from exc
    if experts.shape != shape or weights.shape != shape:
        raise ProtocolError(
            f"a STEP's experts {experts.shape} and weights {weights.shape}, not {shape}"
        )
    if experts.size and int(experts.max()) >= config.n_stacked:
        raise ProtocolError(f"a STEP chose expert {int(experts.max())} of {config.n_stacked}")
    ordered = np.sort(experts, axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise ProtocolError("a STEP chose one expert twice for a token")
    if not np.isfinite(weights).all():
        raise ProtocolError("a STEP's expert weights are not all finite")
    return Routing(experts, weights)


def partial(executor: SliceExecutor, work: Work) -> Hidden:
    """This node's partial of one block, or its logits for the HEAD."""
    if work.block == P.HEAD:
        return executor.logits(work.hidden)
    if work.block == P.ATTENTION:
        return executor.attention(work.layer, work.hidden)
    return executor.ffn(work.layer, work.hidden, work.routing)
