"""Continuous batching: one thread owns the engine and steps every active request together.

The engine is not thread-safe, so exactly one thread, the loop here, calls it; the loop also
has the session re-plan, while no request runs (nodes joined or left) or after a node failed.
Fronts (the REST bridge) `submit` a prompt from any thread and get events back through a
callback; the loop admits a new request into a free KV-cache slot before the next step, so it
starts at once instead of waiting for the others to finish, and decodes in the same steps as
they do. A cancelled request is dropped before the next step and its slot freed: at most the
step already running when the cancel came still computes its token. A finished request's slot
keeps its KV cache, and a new request takes the free slot whose tokens begin like its own and
prefills only the rest (master/generation/reuse.py). Embeddings (`embed`) are steps of their own
between two generation steps, in slots free at the time (master/generation/embedding.py).
"""

from __future__ import annotations

import collections
import itertools
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import numpy as np

from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.figures import BatcherStats, CancelRecord, ReuseRecord
from edgetp.master.cluster.session import Session
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.embedding import chunk, embed_step
from edgetp.master.generation.generate import Generation, check_prompt, step
from edgetp.master.generation.params import CHUNK_STEP_S, SamplingParams
from edgetp.master.generation.reuse import SlotPool, common_prefix
from edgetp.master.generation.sampling import TokenLogprob, sampler_for
from edgetp.master.generation.speculate import Speculator
from edgetp.models.config import ModelConfig
from edgetp.models.errors import ModelError
from edgetp.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RECENT_STEPS = 64  # steps kept for the live figures (ms per step, tokens/s)
MIXED_PREFILL_MAX = 4  # longest new prompt that shares a step with decoding sequences
# While others decode, a longer prompt prefills in chunks, a decode step between two: a chunk is
# sized so that a running stream waits STALL_STEPS decode steps for its next token, or, where a
# step of several tokens costs more than that whatever its length (SmolLM2: 2 tokens take 5 decode
# steps' time, the Python path's fixed cost), so that a chunk's step takes CHUNK_STEP_S (params.py).
STALL_STEPS = 3
FIRST_CHUNK = 32  # prompt tokens of the first chunk, before any prompt step has been timed
DECODE_STEPS_TIMED = 9  # the latest decode steps, whose median time sizes a chunk
# Prompt tokens a request shares with one taken in at the same moment, past what it can reuse
# now, for which it waits a step: the next copies them from that prompt's slot (reuse.py), where
# prefilling them beside it would compute them twice.
SHARED_PREFIX_MIN = 64
IDLE_POLL_S = 0.5  # s between looks at who joined or left while no request runs


@dataclass(frozen=True)
class Delta:
    """New text for the request (stop strings held back until they can no longer match), and
    with logprobs asked for, those of the tokens whose text begins in it."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The request's last event when it ended normally."""

    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int  # tokens sampled, an end-of-sequence token included
    stop_string: str | None = None  # the request's stop string that ended it, if one did
    reused_tokens: int = 0  # of the prompt's, those whose KV its slot held: not prefilled
    prefill_s: float = 0.0  # from taking its slot to its first token (the prompt's prefill)
    decode_s: float = 0.0  # from its first token to its last


@dataclass(frozen=True)
class Failed:
    """The request's last event when the step failed (ClusterError: the cluster is down)."""

    error: Exception


Event = Delta | Finished | Failed


class BusyError(Exception):
    """Every slot is taken and the waiting line is full."""


class ShuttingDown(ClusterError):
    """The server is stopping: no new requests, running ones end."""


class NodeLost(ClusterError):
    """A node failed mid-step and a request cannot go on: the nodes left cannot hold it."""


@dataclass
class _Job:
    id: str
    generation: Generation
    on_event: Callable[[Event], None]
    cancelled: bool = False
    cancel_step: int = -1  # steps started when the cancel came (the one running included)
    # When it took its slot and had its first token (perf_counter; 0: not yet)
    admitted: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0  # when its last step ended


@dataclass
class _Embedding:
    """An embeddings request: its inputs, the vectors of those computed so far, its future."""

    inputs: list[list[int]]
    future: Future[list[np.ndarray]]
    vectors: list[np.ndarray] = field(default_factory=list)


class Ticket:
    """A submitted request (all of its choices): cancel it when its client goes away."""

    def __init__(self, batcher: Batcher, jobs: Sequence[_Job], request_id: str) -> None:
        self._batcher = batcher
        self._jobs = list(jobs)
        self._id = request_id

    @property
    def id(self) -> str:
        return self._id

    def cancel(self) -> None:
        """Stop generating for this request; safe to call more than once, and after it ended."""
        for job in self._jobs:
            self._batcher._cancel(job)


class Batcher:
    """The generation loop: `start()` it, `submit()` requests, `close()` it."""

    def __init__(
        self,
        session: Session,
        tokenizer: Tokenizer,
        max_waiting: int = 64,
        speculator: Speculator | None = None,
        prompt_reuse: bool = True,
        chunk_step_s: float | None = CHUNK_STEP_S,
    ) -> None:
        """`prompt_reuse`: a request prefills only what no free slot's cache holds already.
        `chunk_step_s`: the least time a step of a prompt's chunk aims at while others decode
        (`_timed`); None: a prompt prefills whole, and the others wait for it."""
        self.chunk_step_s = chunk_step_s
        self.session = session
        self.speculator = speculator  # drafts checked in each step (master/generation/speculate.py)
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._active: list[_Job] = []
        self._embeddings: collections.deque[_Embedding] = collections.deque()
        self._embedded_last = False  # the last step was an embedding's: answers go next
        self._slots = SlotPool(session.slots, prompt_reuse)
        self._closed = False
        self._down: str | None = None
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="edgetp-batcher", daemon=True)
        # Counters, changed only under the lock.
        self._steps = 0
        self._submitted = self._completed = self._cancelled = self._failed = 0
        self._recovered = 0
        self._last_loss: str | None = None
        self._replans_mid_answer = 0  # nodes planned in or out between two steps of answers
        self._prompt_tokens = self._completion_tokens = 0
        self._reused_tokens = 0  # prompt tokens whose KV a slot held already
        self._last_reuse: ReuseRecord | None = None
        self._largest_batch = 0
        self._recent: collections.deque[tuple[float, float, int, int]] = collections.deque(
            maxlen=RECENT_STEPS
        )  # (ended at, seconds, sequences, tokens made) of the latest steps
        self._last_cancel: CancelRecord | None = None
        # Chunked prefill (`_next_batch`): the last step's kind, the chunk the next prompt step
        # feeds, the latest decode steps' seconds, and the longest a decoding stream waited
        # between two of its steps (s).
        self._chunked_last = False
        self._chunk = FIRST_CHUNK
        self._decode_s: collections.deque[float] = collections.deque(maxlen=DECODE_STEPS_TIMED)
        self._longest_gap_s = 0.0

    @property
    def engine(self) -> Engine | None:
        """The session's engine (None while it re-plans)."""
        return self.session.engine

    @property
    def config(self) -> ModelConfig:
        return self.session.config

    @property
    def max_context(self) -> int:
        return self.session.max_context

    # -- the fronts' side --------------------------------------------------------------------
    def start(self) -> Batcher:
        self._thread.start()
        return self

    @property
    def down(self) -> str | None:
        """Why the cluster is down (None while it is up)."""
        return self._down

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        on_event: Callable[[Event], None],
        request_id: str | None = None,
    ) -> Ticket:
        """Queue a request; `on_event` is called from the loop thread (keep it short).

        Raises ModelError for a prompt that does not fit the context, ClusterError when the
        cluster is down, BusyError when the waiting line is full.
        """
        return self.submit_choices(prompt, [params], lambda _, e: on_event(e), request_id)

    def submit_choices(
        self,
        prompt: Sequence[int],
        params: Sequence[SamplingParams],
        on_event: Callable[[int, Event], None],
        request_id: str | None = None,
    ) -> Ticket:
        """Queue one sequence per `params` for the same prompt (a request's n choices), all or
        none: each takes a slot of its own as one frees, in the line like any request, and
        `on_event` gets its index with each of its events. Raises as `submit` does."""
        check_prompt(prompt, self.max_context)
        with self._cond:
            rid = request_id or f"req-{next(self._ids)}"
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if self._down:
                raise ClusterError(self._down)
            if len(self._waiting) + len(params) > self.max_waiting:
                raise BusyError(
                    f"all {self.session.slots} slots are busy and {len(self._waiting)} requests "
                    f"are waiting; retry later, or restart with a larger --max-batch"
                )
            jobs = []
            for i, p in enumerate(params):
                # The slot is chosen when the sequence is admitted; -1 until then.
                g = Generation(-1, list(prompt), p, sampler_for(p, self.tokenizer))
                jobs.append(_Job(rid if len(params) == 1 else f"{rid}/{i}", g, _for(on_event, i)))
            self._waiting.extend(jobs)
            self._submitted += len(jobs)
            self._cond.notify()
        return Ticket(self, jobs, rid)

    def embed(self, inputs: Sequence[Sequence[int]]) -> Future[list[np.ndarray]]:
        """Each input's unit vector (master/generation/embedding.py), in order, computed on the
        loop's thread in steps of their own between generation steps, in the slots free then;
        cancel the future when its client goes away. Raises ModelError for an input that is
        empty or longer than the context, ClusterError when the cluster is down, BusyError
        when the waiting line is full."""
        for i, tokens in enumerate(inputs):
            if not tokens or len(tokens) > self.max_context:
                raise ModelError(
                    f"input {i} has {len(tokens)} tokens; an input takes 1 to "
                    f"{self.max_context} (the context): shorten it or raise --context"
                )
        with self._cond:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            if self._down:
                raise ClusterError(self._down)
            if len(self._waiting) + len(self._embeddings) >= self.max_waiting:
                raise BusyError(
                    f"{len(self._waiting) + len(self._embeddings)} requests are waiting; retry "
                    f"later"
                )
            job = _Embedding([list(t) for t in inputs], Future())
            self._embeddings.append(job)
            self._submitted += 1  # a request as an answer is: the counters count it alike
            self._cond.notify()
        return job.future

    def _cancel(self, job: _Job) -> None:
        with self._cond:
            if job.cancelled or job.generation.finished:
                return
            job.cancelled = True
            job.cancel_step = self._steps
            self._cond.notify()

    def stats(self) -> BatcherStats:
        with self._cond:
            recent = list(self._recent)
            busy = sum(s for _, s, _, _ in recent)
            return BatcherStats(
                slots=self.session.slots,
                active=len(self._active),
                waiting=len(self._waiting) + len(self._embeddings),  # the line they share
                steps=self._steps,
                submitted=self._submitted,
                completed=self._completed,
                cancelled=self._cancelled,
                failed=self._failed,
                prompt_tokens=self._prompt_tokens,
                reused_tokens=self._reused_tokens,
                last_reuse=self._last_reuse,
                completion_tokens=self._completion_tokens,
                largest_batch=self._largest_batch,
                step_ms_recent=[round(s * 1000, 2) for _, s, _, _ in recent],
                batch_recent=[n for _, _, n, _ in recent],
                tokens_per_s=round(sum(t for _, _, _, t in recent) / busy, 1) if busy else 0.0,
                last_cancel=self._last_cancel,
                down=self._down,
                recovered=self._recovered,
                last_loss=self._last_loss,
                replans_mid_answer=self._replans_mid_answer,
                speculation=self.speculator.figures() if self.speculator else None,
                longest_gap_ms=round(self._longest_gap_s * 1000, 1),
                prefill_chunk=0 if self.chunk_step_s is None else self._chunk,
            )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still running or waiting fail with a ClusterError. The
        speculator's draft model, if any, goes with the loop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cond:
            self._fail_all(ShuttingDown("the server is shutting down"))
        if self.speculator is not None and not self._thread.is_alive():
            self.speculator.close()

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        poll = IDLE_POLL_S if self.session.can_replan else None
        while True:
            with self._cond:
                while not self._closed and not self._work():
                    if not self._cond.wait(poll):
                        break  # idle a while: time to see who joined or left
                if self._closed:
                    return
                between_requests = not self._active and self._down is None
            if between_requests and self.session.can_replan:
                self._take_in_changes()  # no KV cache to lose: nothing is running
            elif self.session.can_replan and self.session.answer_joins():
                # A node joined (a restarted worker, a new device) or went silent: plan it in
                # or out at this step boundary, not after the running answers, which replay.
                self._replan_running("the nodes changed", loss=False)
            with self._cond:
                if self._closed:
                    return
                # Embeddings first to the free slots, and answers' steps between theirs.
                turn = not (self._embedded_last and self._active)
                embedding = self._next_embedding() if turn else None
                self._embedded_last = embedding is not None
                if embedding is None:
                    self._admit()
                    batch, chunk = self._next_batch()
                    self._steps += bool(batch)
                    number = self._steps
            if embedding is not None:
                self._run_embedding(*embedding)
                continue
            if not batch:
                continue
            before = sum(len(j.generation.tokens) for j in batch)
            decode = all(j.generation.decoding for j in batch)
            prompts = not any(j.generation.decoding for j in batch)
            at = [j.generation.position for j in batch]
            started = time.perf_counter()
            try:
                assert self.engine is not None  # only None while the loop itself re-plans
                gens = [j.generation for j in batch]
                step(self.engine, self.tokenizer, gens, self.speculator, chunk)
            except ClusterError as exc:
                log.error("step %d failed: %s", number, exc)
                exc.with_traceback(None)  # its frames hold the failed engine's slices
                self._replan_running(str(exc), loss=True)
                continue
            except Exception as exc:  # a bug: fail this batch, keep serving the next requests
                log.exception("step %d failed", number)
                with self._cond:
                    for job in batch:
                        self._drop(job, keep=False)  # the step stopped half-way: KV unknown
                        self._failed += 1
                        _emit(job, Failed(exc))
                continue
            seconds = time.perf_counter() - started
            with self._cond:
                fed = max(j.generation.position - p for j, p in zip(batch, at, strict=True))
                self._timed(seconds, decode, prompts, chunk, fed)
                made = sum(len(j.generation.tokens) for j in batch) - before
                self._recent.append((time.perf_counter(), seconds, len(batch), made))
                self._largest_batch = max(self._largest_batch, len(batch))
                for job in batch:
                    self._deliver(job)

    def _work(self) -> bool:
        """Whether anything waits for the loop (lock held)."""
        return bool(self._active or self._waiting or self._embeddings)

    def _next_embedding(self) -> tuple[_Embedding, list[list[int]], list[int]] | None:
        """The first embeddings request's next inputs and the free slots they take, if any are
        free (lock held). Requests whose client went away are dropped."""
        while self._embeddings and self._embeddings[0].future.cancelled():
            self._embeddings.popleft()
            self._cancelled += 1
        if not self._embeddings or not self._slots or self.engine is None:
            return None
        self._slots.bind(self.engine)  # another engine than the last (a re-plan): no KV
        job = self._embeddings[0]
        rest = job.inputs[len(job.vectors) :]
        n = chunk([len(t) for t in rest], len(self._slots))
        return job, rest[:n], [self._slots.borrow() for _ in range(n)]

    def _run_embedding(self, job: _Embedding, inputs: list[list[int]], slots: list[int]) -> None:
        """One step of an embeddings request; the slots go back holding nothing known, as an
        embedding's input is rarely the beginning of a later prompt (no chat template). A node
        lost mid-step costs the request nothing, as it costs an answer nothing: the cluster
        re-plans and the inputs not yet computed run on the nodes here now (the vectors do not
        depend on the split); if it cannot re-plan, the request fails with the others."""
        try:
            assert self.engine is not None  # only None while the loop itself re-plans
            vectors = embed_step(self.engine, inputs, slots)
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop serves on
            lost = isinstance(exc, ClusterError)
            if lost:
                log.error("an embedding step failed: %s", exc)
                exc.with_traceback(None)  # its frames hold the failed engine's slices
            else:
                log.exception("an embedding step failed")
            with self._cond:
                for slot in slots:
                    self._slots.give_back(slot, None)
                if not lost:
                    if job in self._embeddings:
                        self._embeddings.remove(job)
                        self._failed += 1
                    _settle(job.future, exc)
            if lost:
                self._replan_running(str(exc), loss=True)
            return
        with self._cond:
            for slot in slots:
                self._slots.give_back(slot, None)
            job.vectors.extend(vectors)
            self._prompt_tokens += sum(len(t) for t in inputs)
            if len(job.vectors) == len(job.inputs):
                self._embeddings.remove(job)
                if job.future.cancelled():  # its client went away during its last step
                    self._cancelled += 1
                else:
                    self._completed += 1
                _settle(job.future, job.vectors)

    def _replan_running(self, cause: str, loss: bool) -> None:
        """Re-plan on the nodes here now, and every running request goes on where it was: a
        node failed mid-step (`loss`), or nodes joined or left between two steps. A request's
        KV cache was split across the old plan, so its next step replays its prompt and the
        tokens it has so far into the new engine's cache (a prefill), then it samples its next
        token as the uninterrupted run would have. A request that no longer fits the new plan's
        context fails, saying so; if the cluster cannot re-plan, every request fails. Requests
        that arrive meanwhile wait in line for the new engine.
        """
        with self._cond:
            if not self.session.can_replan:
                self._down = f"the cluster is down: {cause}; restart edgetp serve to re-plan"
                self._fail_all(ClusterError(self._down))
                return
        at, started = time.strftime("%H:%M:%S"), time.perf_counter()
        if not self._replanned(self.session.replan, f"{cause}; re-planning"):
            return
        replan_s = time.perf_counter() - started
        assert self.engine is not None
        context = self.engine.max_context
        replayed = 0
        with self._cond:
            self._slots.bind(self.engine)  # the old plan's caches are gone, on every node
            for job in list(self._active):
                g = job.generation
                if len(g.prompt) + len(g.tokens) + 1 > context:
                    self._drop(job, keep=False)
                    self._failed += 1
                    _emit(job, Failed(NodeLost(
                        f"{cause}; the nodes here now hold a context of {context} tokens, and "
                        f"this answer needs {len(g.prompt) + len(g.tokens) + 1}"
                    )))  # fmt: skip
                    continue
                g.position, g.source = 0, -1  # replayed whole by the next step (`pending`)
                replayed += 1
            if loss:
                self._recovered += replayed
                self._last_loss = (
                    f"{at} {cause}; re-planned on {self.session.nodes} node(s) in "
                    f"{replan_s:.1f} s, {replayed} answer(s) went on"
                )
            else:
                self._replans_mid_answer += 1
        log.warning(
            "%s: re-planned on %d node(s) in %.1f s; %d answer(s) replayed",
            "a node was lost" if loss else "the nodes changed",
            self.session.nodes,
            replan_s,
            replayed,
        )

    def _take_in_changes(self) -> None:
        """Between requests: nodes that joined get a share, nodes that left give theirs up."""
        self._replanned(self.session.replan_if_changed, "re-planning for the nodes here")

    def _replanned(self, replan: Callable[[], object], what: str) -> bool:
        """Run `replan`; if it fails, the cluster is down: every request fails, and later ones
        are refused, with what happened."""
        try:
            replan()  # the session lets go of the old engine before the new one loads
        except Exception as exc:  # noqa: BLE001 - whatever it was, the cluster is down
            log.exception("%s failed", what)
            with self._cond:
                self._down = f"the cluster is down: {what} failed ({exc}); restart edgetp serve"
                self._fail_all(ClusterError(self._down))
            return False
        return True

    def _admit(self) -> None:
        """Drop cancelled requests, then fill free slots from the waiting line (lock held)."""
        for job in [j for j in self._active if j.cancelled]:
            self._drop(job)
            g = job.generation
            self._cancelled += 1
            self._completion_tokens += g.sampled
            dropped_before = self._steps + 1
            self._last_cancel = CancelRecord(job.id, len(g.tokens), job.cancel_step, dropped_before)
            log.info(
                "request %s cancelled during step %d after %d tokens; dropped before step %d, "
                "slot %d freed",
                job.id,
                job.cancel_step,
                len(g.tokens),
                dropped_before,
                g.slot,
            )
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            self._cancelled += 1
            log.info("request %s cancelled while waiting for a slot", job.id)
        if self._waiting and self._slots and self.engine is not None:
            self._slots.bind(self.engine)  # another engine than the last (a re-plan): no KV
        admitted: list[list[int]] = []  # prompts taken in now: their prefill is the next step
        # The positions each slot in use holds (none that a copy brings in yet), for a new
        # prompt to copy.
        running = {j.generation.slot: j.generation.cached() for j in self._active
                   if j.generation.source < 0 and self._slots.reuse}  # fmt: skip
        while self._waiting and self._slots:
            g = self._waiting[0].generation
            taken = self._slots.reusable(g.prompt, running)
            if admitted and self._slots.reuse:
                shared = max(min(common_prefix(p, g.prompt), len(g.prompt) - 1) for p in admitted)
                if shared - taken.start >= SHARED_PREFIX_MIN:
                    break  # it copies them from that prompt after the next step, with those behind
            job = self._waiting.popleft()
            self._slots.claim(g.prompt, taken)
            admitted.append(g.prompt)
            g.slot, g.position, g.reused = taken.slot, taken.start, taken.start
            g.source = taken.source
            if g.source < 0 and self._slots.reuse:  # what its own slot held, kept from now on
                running[g.slot] = g.cached()
            job.admitted = time.perf_counter()
            self._active.append(job)
            self._prompt_tokens += len(g.prompt)
            self._reused_tokens += g.reused
            self._last_reuse = ReuseRecord(job.id, len(g.prompt), g.reused)
            log.info(
                "request %s joins at step %d in slot %d (%d prompt tokens, %d of them reused%s; "
                "%d running)",
                job.id,
                self._steps + 1,
                g.slot,
                len(g.prompt),
                g.reused,
                f", copied from slot {g.source}" if g.source >= 0 else "",
                len(self._active),
            )

    def _next_batch(self) -> tuple[list[_Job], int | None]:
        """The sequences of the next step, and the prompt tokens a sequence feeds at most in it
        (None: all it has).

        A step is right-padded to its longest feed, so a prompt of T tokens sharing a step with
        D decoding sequences would make each of them compute T rows instead of 1. Above
        `MIXED_PREFILL_MAX` tokens the new prompts get steps of their own. With no one decoding,
        a prompt prefills in one step (its first token soonest); beside decoding sequences it
        prefills a chunk at a time, each chunk followed by a decode step of the others, so a
        long prompt does not stop their streams while it prefills (`_timed` sizes the chunk).
        Where the chunks and the others' tokens fit one step of rows (`Engine.row_step_tokens`:
        no padding), they share it: the streams wait one step, not a chunk's and their own.
        """
        new = [j for j in self._active if not j.generation.decoding]
        if not new or len(new) == len(self._active):
            self._chunked_last = False
            return list(self._active), None
        if max(len(j.generation.pending()) for j in new) <= MIXED_PREFILL_MAX:
            self._chunked_last = False
            return list(self._active), None
        if self.chunk_step_s is None:
            return new, None  # the others wait this step, and decode with it from the next
        decoding = len(self._active) - len(new)
        if self.engine is not None and decoding + len(new) * self._chunk <= (
            self.engine.row_step_tokens
        ):  # the chunks ride with the others' tokens: one step of rows, not two steps
            self._chunked_last = False
            return list(self._active), self._chunk
        self._chunked_last = not self._chunked_last
        if self._chunked_last:
            return new, self._chunk
        return [j for j in self._active if j.generation.decoding], None

    def _timed(
        self, seconds: float, decode: bool, prompts: bool, chunk: int | None, fed: int
    ) -> None:
        """Size the next prefill chunk from this step's time (lock held): a chunk step should
        take (STALL_STEPS - 1) decode steps, so a stream's wait, a chunk step and its own decode
        step (or one step that carries both), is STALL_STEPS of them, or `chunk_step_s` if
        longer. A step of `prompts` only that fed `fed` tokens (a whole chunk, or prompts fed
        whole) scales them by target / time, at most doubling them: a step's time is a fixed
        part (the weights' read, the sums) and a part per token, so the chunk settles where
        its step takes the target."""
        if decode:
            self._decode_s.append(seconds)
            return
        decode_s = statistics.median(self._decode_s) if self._decode_s else 0.0
        target = max((STALL_STEPS - 1) * decode_s, self.chunk_step_s or 0.0)
        if prompts and fed > 0 and target > 0 and (chunk is None or fed >= chunk):
            self._chunk = max(1, min(2 * fed, int(fed * target / seconds)))
        elif chunk is not None and fed >= chunk and decode_s > 0:
            # a chunk beside the others' tokens: its part of the step is what the step took
            # past a decode step, aimed at the target a step of its own aims at
            extra = seconds - decode_s
            grown = fed * target / extra if extra > 0 else 2 * fed
            self._chunk = max(1, min(2 * fed, int(grown)))

    def _deliver(self, job: _Job) -> None:
        g = job.generation
        if job.cancelled:  # nobody is listening; dropped before the next step
            return
        now = time.perf_counter()
        if g.tokens and not job.first_token:
            job.first_token = now
        elif job.first_token:  # a stream's wait for its next token: this step and any before
            self._longest_gap_s = max(self._longest_gap_s, now - job.last_token)
        job.last_token = now
        text = g.take_text()
        logprobs = tuple(g.take_logprobs())
        if text or logprobs:
            _emit(job, Delta(text, logprobs))
        if g.failure is not None:  # this request alone: the others in its steps go on
            log.error("request %s failed: %s", job.id, g.failure)
            self._drop(job, keep=False)  # not a number: its keys may not be either
            self._failed += 1
            _emit(job, Failed(g.failure))
        elif g.finished:
            self._drop(job)
            self._completed += 1
            sampled = g.sampled
            self._completion_tokens += sampled
            reason = g.finish_reason or "stop"
            prefill = job.first_token - job.admitted
            decode = time.perf_counter() - job.first_token
            finished = Finished(reason, len(g.prompt), sampled, g.stop_string, g.reused,
                                prefill, decode)  # fmt: skip
            _emit(job, finished)

    def _drop(self, job: _Job, keep: bool = True) -> None:
        """Free the job's slot; unless not `keep`, with what its KV cache holds now, for a
        later request that begins alike."""
        if job in self._active:
            self._active.remove(job)
            g = job.generation
            self._slots.give_back(g.slot, g.cached() if keep else None)

    def _fail_all(self, exc: Exception) -> None:
        for job in [*self._active, *self._waiting]:
            self._drop(job, keep=False)
            self._failed += 1
            if not job.cancelled:
                _emit(job, Failed(exc))
        self._waiting.clear()
        for embedding in self._embeddings:
            if embedding.future.cancelled():
                self._cancelled += 1
            else:
                self._failed += 1
            _settle(embedding.future, exc)
        self._embeddings.clear()


def _for(on_event: Callable[[int, Event], None], index: int) -> Callable[[Event], None]:
    return lambda event: on_event(index, event)


def _emit(job: _Job, event: Event) -> None:
    """Hand an event to the request's front; a broken callback must not stop the loop."""
    try:
        job.on_event(event)
    except Exception:
        log.exception("request %s: delivering %s failed", job.id, type(event).__name__)


def _settle(future: Future[list[np.ndarray]], outcome: list[np.ndarray] | Exception) -> None:
    """Give an embeddings request its vectors or its error, unless its client has gone."""
    try:
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:  # cancelled meanwhile
        pass
