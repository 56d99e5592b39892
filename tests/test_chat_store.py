"""Conversations on disk, and `edgetp chat`'s start-up errors (no model needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edgetp.tui.chat.client import Sampling
from edgetp.tui.chat.store import Conversation, ConversationStore, Message


def test_a_conversation_round_trips_and_lists_latest_first(tmp_path):
    store = ConversationStore(tmp_path / "conversations")
    older = Conversation.new("Be brief.", Sampling(0.0, 1.0, 64))
    older.messages += [Message("user", "Hi"), Message("assistant", "Hello!", stopped=True)]
    store.save(older)
    newer = Conversation.new()
    newer.messages += [Message("user", "What is 2+2?"), Message("error", "the cluster is down")]
    store.save(newer)

    back = store.load(older.id)
    assert back == older
    assert [c.id for c in store.list()] == [newer.id, older.id]
    # Only user and assistant turns reach the model, after the system prompt.
    assert back.request_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert store.load(newer.id).request_messages() == [{"role": "user", "content": "What is 2+2?"}]
    assert newer.title == "What is 2+2?"


def test_a_crash_while_saving_leaves_the_previous_turn_whole(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    conversation = Conversation.new()
    conversation.messages.append(Message("user", "first"))
    store.save(conversation)
    before = store.path(conversation.id).read_bytes()

    conversation.messages.append(Message("assistant", "x" * 100_000))

    def crash(src: object, dst: object) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        store.save(conversation)
    monkeypatch.undo()
    assert store.path(conversation.id).read_bytes() == before  # the old file, whole
    assert [c.messages for c in store.list()] == [[Message("user", "first")]]


def test_an_unreadable_file_is_skipped_and_named(tmp_path, caplog):
    store = ConversationStore(tmp_path)
    good = Conversation.new()
    store.save(good)
    (tmp_path / "broken.json").write_text('{"format": 1, "id": ')
    (tmp_path / "future.json").write_text(json.dumps({"format": 99}))
    assert [c.id for c in store.list()] == [good.id]
    assert "broken.json" in caplog.text and "future.json" in caplog.text
    with pytest.raises(ValueError, match="unknown sampling settings: top_k"):
        Conversation.from_dict({**good.to_dict(), "sampling": {"top_k": 3}})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--connect", "http://127.0.0.1:1"], "cannot reach edgetp serve at http://127.0.0.1:1"),
        (["--connect", "http://127.0.0.1:1", "--model", "x.gguf"], "--model set up a local"),
        (["--model", "/nonexistent.gguf"], "model not found: /nonexistent.gguf"),
    ],
)
def test_chat_start_up_errors_are_one_clear_message(args, needle, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "edgetp.tui.cli", "chat", "--state-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
