"""`edgetp bench --prompt-tokens N`: a prompt of exactly N tokens of generated prose, and what
prefilling it and decoding after it cost.

The prose is built from fixed word lists by a seeded generator, so every run and every engine
gets the same tokens; its sentences vary as text does (a prompt of one sentence repeated would
let a lookup draft or a cache of repeats flatter the figures, and reads like no agent's prompt).
"""

from __future__ import annotations

import random
import statistics
from typing import Any

from edgetp.models.errors import ModelError
from edgetp.models.tokenizer import Tokenizer

# Several phrases to a line: the lists are data, not code to read line by line.
# fmt: off
_SUBJECTS = (
    "The old ferryman", "A young engineer", "The village council", "Our neighbour", "The archivist",
    "A travelling musician", "The harbour master", "Her younger brother", "The night nurse",
    "A retired teacher", "The baker on the corner", "The survey team", "A careful gardener",
    "The lighthouse keeper", "Two students", "The museum guide", "A tired courier", "The mapmaker",
    "The orchestra", "A quiet librarian", "The railway clerk", "The beekeeper",
)
_VERBS = (
    "repaired", "described", "carried", "measured", "painted", "forgot", "discovered", "sold",
    "borrowed", "studied", "buried", "translated", "rebuilt", "questioned", "photographed",
    "counted", "explained", "polished", "returned", "copied", "weighed", "catalogued",
)
_ADJECTIVES = (
    "rusty", "narrow", "forgotten", "brightly painted", "heavy", "fragile", "crooked", "ancient",
    "borrowed", "silver", "water-stained", "hand-drawn", "enormous", "delicate", "weathered",
    "curious", "unfinished", "wooden", "faded", "copper", "misplaced", "crowded",
)
_THINGS = (
    "clock", "bridge", "ledger", "map of the coast", "violin", "greenhouse", "telescope", "bicycle",
    "letter", "staircase", "lantern", "fishing boat", "set of keys", "window frame", "photograph",
    "recipe book", "weather vane", "piano", "garden wall", "compass", "kettle", "signal box",
)
_PLACES = (
    "near the river", "behind the station", "in the attic", "at the edge of the forest",
    "under the old oak", "beside the harbour", "on the hill above the town", "in the market square",
    "inside the lighthouse", "along the canal", "at the back of the library", "in a rented room",
    "by the mill", "across the valley", "in the school yard", "outside the post office",
)
_TIMES = (
    "early one winter morning", "after the storm had passed", "during the long summer",
    "before the festival began", "late on a Sunday", "in the spring of that year",
    "while the town slept", "just after lunch", "on the first day of autumn",
    "a week before the wedding", "when the snow finally melted", "as the tide went out",
)
_AFTERS = (
    "and nobody could say why it mattered so much", "because the old plans had been lost years ago",
    "although the work took far longer than expected",
    "so that the children could see how it once worked", "while a small crowd gathered to watch",
    "and wrote down every detail in a notebook", "but kept the reason a secret for many years",
    "since no one else in the town knew how", "and afterwards the whole street seemed different",
    "even though the weather was against them", "as their grandparents had done before them",
    "and the story was told at every dinner that winter",
)
# fmt: on


def prose_tokens(tokenizer: Tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly `n_tokens` token ids of deterministic prose (the model's own start token
    first, if it adds one): the same ids for the same tokenizer, `n_tokens` and `seed`."""
    if n_tokens < 1:
        raise ModelError(f"--prompt-tokens must be at least 1, got {n_tokens}")
    rng = random.Random(seed)
    sentences: list[str] = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        # Sentences for the tokens still missing (~25 tokens each): one encode, rarely two.
        for _ in range(max(8, (n_tokens - len(ids)) // 20)):
            sentences.append(_sentence(rng))
            if len(sentences) % 6 == 0:  # paragraphs, as prose has
                sentences.append("\n\n")
        ids = tokenizer.encode(" ".join(sentences).replace(" \n\n ", "\n\n"))
    return ids[:n_tokens]


def _sentence(rng: random.Random) -> str:
    subject, verb = rng.choice(_SUBJECTS), rng.choice(_VERBS)
    thing = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_THINGS)}"
    place, when, after = rng.choice(_PLACES), rng.choice(_TIMES), rng.choice(_AFTERS)
    forms = (
        f"{subject} {verb} {thing} {place} {when}, {after}.",
        f"{when[0].upper()}{when[1:]}, {subject[0].lower()}{subject[1:]} {verb} {thing} {place}.",
        f"{subject} {verb} {thing} {place}, {after}.",
    )
    return rng.choice(forms)


def check_depth(
    n_prompt: int, n_tokens: int, context_length: int, context: int | None, model: str
) -> int:
    """The context a run of an `n_prompt`-token prompt and `n_tokens` decoded tokens needs
    (`context` if given); a ModelError saying so if the model's context or `context` is
    shorter."""
    need = n_prompt + n_tokens
    if need > context_length:
        raise ModelError(
            f"--prompt-tokens {n_prompt} and --tokens {n_tokens} need {need} tokens of context, "
            f"but {model} holds {context_length}: ask for at most "
            f"{context_length - n_tokens} prompt tokens"
        )
    if context is not None and need > context:
        raise ModelError(
            f"--prompt-tokens {n_prompt} and --tokens {n_tokens} need {need} tokens of context, "
            f"but --context is {context}: raise it or leave it out"
        )
    return context or need


def kv_mb(node: dict[str, Any], depth: int) -> float:
    """What a sequence `depth` tokens deep holds of a node's KV cache, in MB: its KV per token
    of context and its fixed state (sliding-window rings, a DeltaNet's), from the node's own
    figures."""
    return round((node["kv_bytes_per_token"] * depth + node["state_bytes_per_sequence"]) / 1e6, 2)


def long_prompt_row(runs: list[dict[str, Any]], n_prompt: int) -> dict[str, Any]:
    """One node count's long-prompt figures over its rounds: prefill tokens/s (the prompt over
    its time to first token), the time to first token and decode ms a token at that depth (each
    the median of the rounds), and each node's KV MB for the context the run fills, the prompt
    and its decoded tokens (what `/v1/cluster`'s kv_cache_bytes counts of a cache that long)."""
    ttft = statistics.median(r["ttft_ms"] for r in runs)
    depth = n_prompt + len(runs[0]["tokens"])
    return {
        "prompt_tokens": n_prompt,
        "prefill_tokens_per_s": round(n_prompt / (ttft / 1000), 1),
        "ttft_ms": round(ttft, 1),
        "rounds_ttft_ms": [r["ttft_ms"] for r in runs],
        "decode_ms_per_token": round(statistics.median(r["ms_per_token"] for r in runs), 2),
        "depth": depth,
        "kv_mb": {n["node"]: kv_mb(n, depth) for n in runs[0]["per_node"]},
    }


def print_long_prompt(rows: list[dict[str, Any]]) -> None:
    """The long-prompt figures of each node count, one line each and its nodes' KV."""
    print(
        f"{'nodes':>5}{'prompt':>8}{'prefill tok/s':>15}{'TTFT ms':>10}"
        f"{'decode ms/token':>17}  at depth"
    )
    for r in rows:
        lp = r["long_prompt"]
        print(
            f"{r['nodes']:>5}{lp['prompt_tokens']:>8}{lp['prefill_tokens_per_s']:>15}"
            f"{lp['ttft_ms']:>10}{lp['decode_ms_per_token']:>17}  {lp['depth']}"
        )
        kv = ", ".join(f"{name} {mb:g} MB" for name, mb in lp["kv_mb"].items())
        print(f"      KV for {lp['depth']} tokens of context: {kv}")
