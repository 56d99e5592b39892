"""What an emulated device is: `--device cpu=0.5,mem=1GB,disk=200MB/s,link=100Mbit,rtt=2ms`.

Torch-free: the command line checks a spec before anything slow starts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from edgetp.memory.budget import RESERVE_BYTES, format_size, parse_size

_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
EXAMPLE = "cpu=0.5,mem=1GB,disk=200MB/s,link=100Mbit,rtt=2ms"


@dataclass(frozen=True)
class DeviceSpec:
    """One device's limits; None leaves that resource as this machine has it."""

    cpu: float | None = None  # cores (a CPU quota)
    mem: int | None = None  # bytes, page cache included
    disk: int | None = None  # bytes/s read from the disk holding the shards
    link: int | None = None  # bits/s each way
    rtt: float | None = None  # s, a round trip between this device and the master

    @property
    def threads(self) -> int | None:
        """The compute threads a node of this device runs: as many as its quota has cores."""
        return None if self.cpu is None else max(1, math.ceil(self.cpu - 1e-9))

    @property
    def networked(self) -> bool:
        return self.link is not None or self.rtt is not None

    def describe(self) -> str:
        parts = []
        if self.cpu is not None:
            parts.append(f"cpu={self.cpu:g}")
        if self.mem is not None:
            parts.append(f"mem={format_size(self.mem).replace(' ', '')}")
        if self.disk is not None:
            parts.append(f"disk={format_size(self.disk).replace(' ', '')}/s")
        if self.link is not None:
            parts.append(f"link={self.link / 1e6:g}Mbit")
        if self.rtt is not None:
            parts.append(f"rtt={self.rtt * 1e3:g}ms")
        return ",".join(parts) or "unlimited"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_device(text: str) -> DeviceSpec:
    """A spec from `key=value` pairs; a ValueError that names the bad part otherwise."""
    values: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key in values:
            raise ValueError(f"--device {text!r}: {key} is given twice")
        try:
            values[key] = _parse_value(key, value)
        except ValueError as err:
            raise ValueError(f"--device {text!r}: {err}") from None
    if not values:
        raise ValueError(f"--device {text!r} says nothing: write e.g. {EXAMPLE}")
    return DeviceSpec(**values)


def _parse_value(key: str, value: str) -> Any:
    if key == "cpu":
        cores = float(value) if re.fullmatch(r"[0-9]*\.?[0-9]+", value) else 0.0
        if not cores >= 0.01:
            raise ValueError(f"cpu={value} is not a number of cores of at least 0.01")
        return cores
    if key == "mem":
        mem = parse_size(value)
        if mem <= RESERVE_BYTES:  # the kernel killed such a master on its next page, unsaid
            raise ValueError(
                f"mem={value} leaves a node no room: it keeps {format_size(RESERVE_BYTES)} for "
                "its work beside the weights; write e.g. mem=1GB"
            )
        return mem
    if key == "disk":
        if not value.lower().endswith("/s"):
            raise ValueError(f"disk={value} is not a rate: write e.g. disk=200MB/s")
        return _positive(parse_size(value[:-2]), f"disk={value}")
    if key == "link":
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)", value)
        if not match or match.group(2).lower() not in _BITS:
            raise ValueError(f"link={value} is not a bit rate: write e.g. link=100Mbit")
        return _positive(int(float(match.group(1)) * _BITS[match.group(2).lower()]), value)
    if key == "rtt":
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", value)
        if not match or match.group(2) not in _SECONDS:
            raise ValueError(f"rtt={value} is not a time: write e.g. rtt=2ms")
        return float(match.group(1)) * _SECONDS[match.group(2)]
    raise ValueError(f"{key!r} is not a device property: write e.g. {EXAMPLE}")


def _positive(n: int, what: str) -> int:
    if n <= 0:
        raise ValueError(f"{what} must be more than zero")
    return n


def device_specs(given: Sequence[DeviceSpec], nodes: int) -> list[DeviceSpec]:
    """One spec per node, master first: one spec given is every node's."""
    if len(given) == 1:
        return [given[0]] * nodes
    if len(given) != nodes:
        raise ValueError(
            f"{len(given)} --device specs for {nodes} nodes: give one for all, or one per node"
        )
    return list(given)
