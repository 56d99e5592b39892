"""The bridge's listening socket and the options that decide it: checked before anything slow
is imported or loaded, so a taken port or a bad option is one line within a second."""

from __future__ import annotations

import socket


def check_api_key(api_key: str | None) -> None:
    """An API key, from --api-key or EDGETP_API_KEY, that is empty or blank is a mistake."""
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the option out")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port"
        ) from exc
    sock.listen(128)
    return sock
