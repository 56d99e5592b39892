"""What a node's weight loader did: running totals, reported per step as differences."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StreamFigures:
    """Running totals of the loader; a node reports their difference per step."""

    bytes_read: int = 0
    load_s: float = 0.0  # time the loader spent reading
    wait_s: float = 0.0  # time compute waited for a layer not yet read
    compute_s: float = 0.0  # time in the node's partials, waits included (the executor adds)
    # A mixture's experts, where the node streams them (memory/experts.py: the reads' by the
    # step's expert reader, the rest by compute's thread):
    expert_hits: int = 0  # experts a step chose that the pool held
    expert_misses: int = 0  # and that it read
    expert_bytes_chosen: int = 0  # bytes of the chosen experts' slices, held or not
    expert_bytes_read: int = 0
    expert_load_s: float = 0.0  # time the expert reader spent reading
    expert_hidden_s: float = 0.0  # of that, the time compute did not wait for (it computed)
    expert_computes_overlapped: int = 0  # pooled experts computed while the reader read

    def minus(self, other: StreamFigures) -> StreamFigures:
        return StreamFigures(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )
