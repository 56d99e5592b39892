"""How far past its delay the emulated link's relay (master/emulate/relay.c) delivers: a 64-byte
TCP ping-pong to an echo in another process, direct and through the relay at DELAY us each way,
medians of ROUNDS. The difference less 2 x DELAY is the relay's.

    .venv/bin/python docs/bench/relay_lag.py 1000 2000
"""

from __future__ import annotations

import statistics
import sys

from edgetp.master.bench.round_trips import raw_tcp_round_trips


def main() -> None:
    delay_us = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    direct = statistics.median(raw_tcp_round_trips(64, rounds)) * 1e6
    through = sorted(raw_tcp_round_trips(64, rounds, relay_half_us=delay_us))
    median, p90 = (through[int(rounds * q)] * 1e6 - direct - 2 * delay_us for q in (0.5, 0.9))
    print(
        f"direct {direct:.1f} us, through the relay at {delay_us} us each way: it adds "
        f"{median:.1f} us a round trip beyond its delay (p90 {p90:.1f})"
    )


if __name__ == "__main__":
    main()
