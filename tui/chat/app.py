"""`edgetp chat`: a Textual app that chats with a cluster through its REST bridge.

The app is always an HTTP client of the bridge. An answer streams in an async worker that reads
the server-sent events and writes each piece into a Markdown stream (a thinking model's
reasoning into a folded "Thinking" above it); Esc cancels that worker, which closes the
connection, and the bridge drops the request before its next step. The whole
conversation goes with every request, so the model's chat template sees every turn. The cluster
panel polls /v1/cluster once a second. A conversation is saved after every turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import Footer, Header, Input, Markdown, Static
from textual.worker import Worker

from edgetp.master.bridge.client import BridgeError, Reasoning, StreamEnd
from edgetp.tui.chat.client import BridgeClient, Sampling
from edgetp.tui.chat.store import Conversation, ConversationStore, Message
from edgetp.tui.chat.widgets import (
    Answer,
    ClusterPanel,
    ConversationsScreen,
    Note,
    SettingsScreen,
    Thinking,
    message_views,
)

log = logging.getLogger(__name__)

POLL_S = 1.0


class ChatApp(App[None]):
    """Chat with the model a bridge serves, and watch its cluster."""

    CSS_PATH = "chat.tcss"
    TITLE = "edgetp chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new", "New chat"),
        Binding("ctrl+o", "open", "Open"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+b", "toggle_cluster", "Cluster"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        client: BridgeClient,
        store: ConversationStore,
        conversation: Conversation | None = None,
        system: str = "",
        sampling: Sampling | None = None,
        poll_s: float = POLL_S,
        down_hint: str = "",
        join_hint: str = "",
    ) -> None:
        super().__init__()
        self.client = client
        self.store = store
        self.conversation = conversation or Conversation.new(system, sampling)
        self.poll_s = poll_s
        self.down_hint = down_hint  # added to a "cluster down" error: how to get it back
        self.join_hint = join_hint  # how a device joins this cluster (a local bridge's line)
        self.answering: Worker[None] | None = None
        self.model_id = ""
        self._polling = False
        # The main screen's widgets, held here: a query would search whatever screen is on top
        # (the conversation list, the settings), and a poll or an answer can land while one is.
        self.log_view = VerticalScroll(id="conversation")
        self.status_line = Static("", id="status")
        self.prompt_input = Input(placeholder="Ask something (Enter sends)", id="prompt")
        self.cluster_panel = ClusterPanel(id="cluster")

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield self.log_view
                yield self.status_line
                yield self.prompt_input
            yield self.cluster_panel
        yield Footer()

    async def on_mount(self) -> None:
        self.sub_title = self.client.base_url
        self.log_view.anchor()  # follow a streaming answer unless scrolled up
        self.cluster_panel.border_title = "cluster"
        await self.show_conversation(self.conversation)
        self.prompt_input.focus()
        self.load_model()
        self.poll_cluster()
        self.set_interval(self.poll_s, self.poll_cluster)
        if self.join_hint:
            self.notify(self.join_hint, title="devices join with", timeout=60)

    async def on_unmount(self) -> None:
        await self.client.aclose()

    # -- the bridge ---------------------------------------------------------------------------
    @work(exclusive=True, group="model")
    async def load_model(self) -> None:
        try:
            self.model_id = await self.client.model()
        except BridgeError as exc:
            self.notify(str(exc), title="bridge", severity="error")
            return
        self.sub_title = f"{self.model_id} · {self.client.base_url}"

    def poll_cluster(self) -> None:
        if not self._polling:  # a slow answer must not pile requests up
            self._polling = True
            self._poll_cluster()

    @work(group="cluster")
    async def _poll_cluster(self) -> None:
        panel = self.cluster_panel
        try:
            try:
                figures = await self.client.cluster()
            except BridgeError as exc:
                panel.show_error(str(exc))
            else:
                panel.show(figures)
        except NoMatches:  # the app closed while the figures were on their way: no one to show
            pass
        finally:
            self._polling = False

    # -- a turn -------------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    async def submit(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.answering is not None:
            self.notify("still answering: Esc stops it", severity="warning")
            return
        event.input.clear()
        message = Message("user", text)
        self.conversation.messages.append(message)
        await self.log_view.mount_all(message_views(message))
        self.log_view.border_title = self.conversation.title
        self.save(self.conversation)  # the question survives a crash mid-answer
        self.answering = self.answer(self.conversation)
        self.refresh_bindings()

    @work(exclusive=True, group="answer")
    async def answer(self, conversation: Conversation) -> None:
        """Stream the answer into a new message, a thinking model's reasoning folded above it;
        record it however it ends."""
        view = Answer(Message("assistant", ""))
        await self.log_view.mount(view)
        stream = Markdown.get_stream(view)
        thinking = Thinking()  # shown once reasoning comes
        pieces: list[str] = []
        started = time.monotonic()
        stopped, error, done = False, "", None
        self.set_status("answering… (Esc stops)")
        try:
            async for event in self.client.stream_chat(
                conversation.request_messages(), conversation.sampling
            ):
                if isinstance(event, StreamEnd):
                    done = event
                    break
                if isinstance(event, Reasoning):
                    if not thinking.is_mounted:
                        await self.log_view.mount(thinking, before=view)
                    await thinking.write(event.text)
                    self.set_status("thinking… (Esc stops)")
                    continue
                pieces.append(event)
                await stream.write(event)
                self.set_status(f"answering… {len(pieces)} pieces (Esc stops)")
        except BridgeError as exc:
            error = str(exc)
            if self.down_hint and exc.code == "cluster_down":
                error += f"\n{self.down_hint}"
        except asyncio.CancelledError:
            stopped = True
            raise
        finally:
            try:
                await thinking.stop()
                await stream.stop()
            except Exception:  # the view is gone (another conversation opened): text is kept
                log.exception("finishing the answer's view")
            answer = Message("assistant", "".join(pieces), stopped, thinking.text)
            self.end_answer(conversation, view, answer, error)
            seconds = time.monotonic() - started
            if done is not None:
                tokens = done.completion_tokens or len(pieces)
                self.set_status(
                    f"{tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s), "
                    f"finished: {done.finish_reason}"
                )
            elif stopped:
                self.set_status(f"stopped after {len(pieces)} pieces")
            else:
                self.set_status("the answer failed: see the conversation")

    def end_answer(
        self, conversation: Conversation, view: Answer, answer: Message, error: str
    ) -> None:
        """Keep what arrived (marked if stopped) and any error, save, and take the next prompt."""
        kept = bool(answer.content or answer.reasoning)
        if kept:
            conversation.messages.append(answer)
        if error:
            conversation.messages.append(Message("error", error))
        shown = conversation is self.conversation
        if shown and answer.stopped:
            view.border_subtitle = "stopped"
        if shown and not kept:
            view.remove()
        if shown and error:
            self.log_view.mount(Note(conversation.messages[-1]))
        self.save(conversation)
        self.answering = None
        self.refresh_bindings()

    def save(self, conversation: Conversation) -> None:
        try:
            self.store.save(conversation)
        except OSError as exc:  # the conversation goes on in memory
            self.notify(f"could not save the conversation: {exc}", severity="error")

    def set_status(self, text: str) -> None:
        self.status_line.update(text)

    def idle_status(self) -> str:
        s = self.conversation.sampling
        system = "system prompt set · " if self.conversation.system.strip() else ""
        return (
            f"{system}temperature {s.temperature:g} · top-p {s.top_p:g} · max {s.max_tokens} tokens"
        )

    # -- conversations ------------------------------------------------------------------------
    async def show_conversation(self, conversation: Conversation) -> None:
        self.conversation = conversation
        await self.log_view.remove_children()
        await self.log_view.mount_all([v for m in conversation.messages for v in message_views(m)])
        self.log_view.border_title = conversation.title or "new conversation"
        self.log_view.scroll_end(animate=False)
        self.set_status(self.idle_status())

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return True if self.answering is not None else None  # None: shown, dimmed
        return True

    def action_stop(self) -> None:
        if self.answering is not None:
            self.answering.cancel()

    async def action_new(self) -> None:
        self.action_stop()
        old = self.conversation
        await self.show_conversation(Conversation.new(old.system, old.sampling))

    def action_open(self) -> None:
        def chosen(conversation_id: str | None) -> None:
            if conversation_id is not None:
                self.open_conversation(conversation_id)

        self.push_screen(ConversationsScreen(self.store.list(), self.conversation.id), chosen)

    @work(exclusive=True, group="open")
    async def open_conversation(self, conversation_id: str) -> None:
        try:
            conversation = self.store.load(conversation_id)
        except ValueError as exc:
            self.notify(str(exc), severity="error")
            return
        self.action_stop()
        await self.show_conversation(conversation)

    def action_settings(self) -> None:
        def chosen(result: tuple[str, Sampling] | None) -> None:
            if result is None:
                return
            self.conversation.system, self.conversation.sampling = result
            if self.conversation.messages:
                self.save(self.conversation)
            self.set_status(self.idle_status())

        c = self.conversation
        self.push_screen(SettingsScreen(c.system, c.sampling), chosen)

    def action_toggle_cluster(self) -> None:
        panel = self.cluster_panel
        panel.display = not panel.display


def conversations_dir(state_dir: Path | None) -> Path:
    """Where conversations live: `<state>/conversations` ($EDGETP_HOME, ~/.cache/edgetp)."""
    from edgetp.memory.files import default_state_dir

    return (state_dir or default_state_dir()) / "conversations"
