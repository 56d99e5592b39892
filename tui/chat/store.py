"""Conversations on disk: one JSON file each, replaced whole after every turn.

A file is written to a temporary name, synced, and renamed over the old one, so a crash leaves
either the previous turn's file or the new one, never half of either.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgetp.memory.files import atomic_write
from edgetp.tui.chat.client import Sampling

log = logging.getLogger(__name__)

FORMAT = 1
TITLE_CHARS = 60
Role = Literal["user", "assistant", "error"]


@dataclass
class Message:
    """One entry of a conversation. Errors are shown and kept, but never sent to the model."""

    role: Role
    content: str
    stopped: bool = False  # an answer cut short with Esc
    # A thinking model's reasoning before its answer: shown folded, never sent back (chat
    # templates drop earlier turns' reasoning, and some APIs refuse it in a request).
    reasoning: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.stopped:
            out["stopped"] = True
        if self.reasoning:
            out["reasoning"] = self.reasoning
        return out


@dataclass
class Conversation:
    id: str
    created: float
    updated: float
    system: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    messages: list[Message] = field(default_factory=list)

    @classmethod
    def new(cls, system: str = "", sampling: Sampling | None = None) -> Conversation:
        now = time.time()
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        return cls(f"{stamp}-{secrets.token_hex(3)}", now, now, system, sampling or Sampling())

    @property
    def title(self) -> str:
        first = next((m.content for m in self.messages if m.role == "user"), "")
        line = " ".join(first.split())
        return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"

    def request_messages(self) -> list[dict[str, str]]:
        """What the model sees: the system prompt and every user and assistant turn."""
        out = [{"role": "system", "content": self.system}] if self.system.strip() else []
        out += [
            {"role": m.role, "content": m.content}
            for m in self.messages
            if m.role in ("user", "assistant") and m.content
        ]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "id": self.id,
            "created": self.created,
            "updated": self.updated,
            "system": self.system,
            "sampling": self.sampling.to_dict(),
            "messages": [m.to_dict() for m in self.messages],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conversation:
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        messages = []
        for m in data["messages"]:
            if m["role"] not in ("user", "assistant", "error"):
                raise ValueError(f"a message has the unknown role {m['role']!r}")
            stopped, reasoning = bool(m.get("stopped", False)), str(m.get("reasoning", ""))
            messages.append(Message(m["role"], str(m["content"]), stopped, reasoning))
        return cls(
            str(data["id"]),
            float(data["created"]),
            float(data["updated"]),
            str(data.get("system", "")),
            Sampling.from_dict(data.get("sampling", {})),
            messages,
        )


class ConversationStore:
    """A folder of conversations, `<id>.json` each."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, conversation_id: str) -> Path:
        return self.root / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> None:
        conversation.updated = time.time()
        data = json.dumps(conversation.to_dict(), ensure_ascii=False, indent=1)
        atomic_write(self.path(conversation.id), data.encode())

    def load(self, conversation_id: str) -> Conversation:
        path = self.path(conversation_id)
        try:
            return Conversation.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read the conversation {path}: {exc}") from exc

    def list(self) -> list[Conversation]:
        """Every readable conversation, the latest first; unreadable files are logged, skipped."""
        found = []
        for path in self.root.glob("*.json"):
            try:
                found.append(self.load(path.stem))
            except ValueError as exc:
                log.warning("%s", exc)
        return sorted(found, key=lambda c: c.updated, reverse=True)
