"""How far past its delay the emulated link's relay (master/emulate/relay.c) delivers: a 64-byte
TCP ping-pong to an echo, direct and through the relay at DELAY us each way, medians of ROUNDS.
The echo and the client are the same both ways, so the difference less 2 x DELAY is the relay's.

    .venv/bin/python docs/bench/relay_lag.py 1000 2000
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time

from master.emulate.devices import RELAY_SOURCE
from models.cbuild import built


def main() -> None:
    delay_us = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        while True:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(64):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    relay = subprocess.Popen(
        [str(built(RELAY_SOURCE, ("-O2",))), str(delay_us), "127.0.0.2", "127.0.0.1", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert relay.stdout is not None and relay.stdout.readline().strip() == b"ready"

    def trips(host: str) -> list[float]:
        out = []
        with socket.create_connection((host, port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                started = time.perf_counter()
                s.sendall(b"x" * 64)
                got = 0
                while got < 64:
                    got += len(s.recv(64))
                out.append(time.perf_counter() - started)
        return out

    direct, through = trips("127.0.0.1"), trips("127.0.0.2")
    d, t = statistics.median(direct) * 1e6, statistics.median(through) * 1e6
    p90 = sorted(through)[int(rounds * 0.9)] * 1e6
    print(
        f"direct {d:.1f} us, through the relay at {delay_us} us each way {t:.1f} us: the relay "
        f"adds {t - d - 2 * delay_us:.1f} us a round trip beyond its delay (p90 "
        f"{p90 - d - 2 * delay_us:.1f})"
    )
    assert relay.stdin is not None
    relay.stdin.close()
    relay.wait()


if __name__ == "__main__":
    main()
