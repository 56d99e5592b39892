"""Keys and join tokens for CurveZMQ links between master and nodes.

The master has a long-lived Curve keypair, kept in its state folder (owner-only). A join token
carries two things: the master's public key, so a node can tell it is talking to the right
master, and a random secret from which every node derives the same client keypair. The master
authorizes (ZAP) only that client key, so a process without the token cannot finish the
handshake, let alone join or read anything; rotating the secret (`--new-token`) locks out every
holder of the old token. All traffic on these links is encrypted.

    token = "etp1-" + base64url(master public key (32 bytes) + secret (16 bytes))
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from edgetp.memory.files import atomic_write

TOKEN_PREFIX = "etp1-"
TOKEN_ENV = "EDGETP_TOKEN"  # where `edgetp join` also looks for the token


class TokenError(ValueError):
    """A token that cannot be read, in words for the person who typed it."""


@dataclass(frozen=True)
class Keypair:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes


@dataclass(frozen=True)
class JoinToken:
    master_public: bytes  # z85
    secret: bytes  # 16 raw bytes

    def __str__(self) -> str:
        raw = z85.decode(self.master_public) + self.secret
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def parse(cls, text: str) -> JoinToken:
        text = text.strip()
        if not text.startswith(TOKEN_PREFIX):
            raise TokenError(
                f"a join token starts with {TOKEN_PREFIX!r}; copy the one the master printed"
            )
        body = text[len(TOKEN_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError as exc:
            raise TokenError("the join token is damaged (not base64url); copy it again") from exc
        if len(raw) != 48:
            raise TokenError("the join token has the wrong length; copy it again")
        return cls(z85.encode(raw[:32]), raw[32:])

    def client_keys(self) -> Keypair:
        """The client keypair every holder of this token uses."""
        secret = z85.encode(hashlib.sha256(b"edgetp-client" + self.secret).digest())
        return Keypair(zmq.curve_public(secret), secret)


def fingerprint(public: bytes) -> str:
    """A short, printable digest of a public key (for the LAN announcement and logs)."""
    return hashlib.sha256(z85.decode(public)).hexdigest()[:16]


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    atomic_write(path, data, mode=0o600)


def master_keys(state_dir: Path) -> Keypair:
    """The master's keypair, created on first use and kept owner-only in `state_dir/keys`."""
    path = state_dir / "keys" / "master.key"
    if path.is_file():
        public, secret = path.read_bytes().split(b"\n")[:2]
        return Keypair(public, secret)
    public, secret = zmq.curve_keypair()
    _write_private(path, public + b"\n" + secret + b"\n")
    return Keypair(public, secret)


def master_token(state_dir: Path, keys: Keypair, rotate: bool = False) -> JoinToken:
    """The current join token; `rotate` replaces its secret, so old tokens stop working."""
    path = state_dir / "keys" / "token.secret"
    if rotate or not path.is_file():
        _write_private(path, secrets.token_bytes(16))
    return JoinToken(keys.public, path.read_bytes())


def save_node_token(state_dir: Path, token: JoinToken) -> None:
    """Keep the token a node joined with, so a restart can rejoin without it being retyped."""
    _write_private(state_dir / "keys" / "join.token", str(token).encode())


def load_node_token(state_dir: Path) -> JoinToken | None:
    path = state_dir / "keys" / "join.token"
    return JoinToken.parse(path.read_text()) if path.is_file() else None


def secure_server(sock: zmq.Socket, keys: Keypair) -> None:
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def secure_client(sock: zmq.Socket, token: JoinToken) -> None:
    client = token.client_keys()
    sock.curve_serverkey = token.master_public
    sock.curve_publickey = client.public
    sock.curve_secretkey = client.secret
