"""The chat app's widgets: messages, the cluster panel, and the settings and conversation lists."""

from __future__ import annotations

import statistics
import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import (
    Button,
    Collapsible,
    Footer,
    Input,
    Label,
    Markdown,
    OptionList,
    Static,
    TextArea,
)
from textual.widgets.markdown import MarkdownStream
from textual.widgets.option_list import Option

from edgetp.master.bridge.schema import ClusterFigures, NodeFigures
from edgetp.tui.chat.client import Sampling
from edgetp.tui.chat.store import Conversation, Message

NONE = "—"
LABELS = {"user": "you", "assistant": "assistant", "error": "error"}


class Answer(Markdown):
    """The model's answer, rendered as markdown (code blocks highlighted)."""

    def __init__(self, message: Message) -> None:
        super().__init__(message.content, classes="message assistant")
        self.border_title = "assistant"
        if message.stopped:
            self.border_subtitle = "stopped"


class Thinking(Collapsible):
    """A thinking model's reasoning, folded above its answer: its title opens it. Reasoning
    is long and mostly not what a person came for, so it starts closed, even as it streams."""

    def __init__(self, reasoning: str = "") -> None:
        body = Markdown(reasoning, classes="reasoning")
        super().__init__(body, title="Thinking", collapsed=True)
        self.body = body
        self.text = reasoning
        self._stream: MarkdownStream | None = None

    async def write(self, piece: str) -> None:
        if self._stream is None:
            self._stream = Markdown.get_stream(self.body)
        self.text += piece
        await self._stream.write(piece)

    async def stop(self) -> None:
        if self._stream is not None:
            await self._stream.stop()


class Note(Static):
    """A person's prompt, or an error, shown exactly as written."""

    def __init__(self, message: Message) -> None:
        super().__init__(message.content, markup=False, classes=f"message {message.role}")
        self.border_title = LABELS[message.role]


def message_views(message: Message) -> list[Widget]:
    """A message's widgets: an answer's reasoning, if it has any, folded above it."""
    if message.role != "assistant":
        return [Note(message)]
    return [*([Thinking(message.reasoning)] if message.reasoning else []), Answer(message)]


class ClusterPanel(VerticalScroll):
    """The cluster's live figures: one block for the whole, one per node.

    `show` takes what /v1/cluster returns; fields a node does not report yet show as "—".
    """

    def compose(self) -> ComposeResult:
        yield Static("waiting for the cluster's figures…", id="cluster-summary")
        yield Static("", id="cluster-nodes")

    def show(self, figures: ClusterFigures) -> None:
        self.remove_class("unreachable")
        self.set_class(figures.down is not None, "down")
        self.query_one("#cluster-summary", Static).update(summary(figures))
        self.query_one("#cluster-nodes", Static).update(
            Group(*(node_block(n) for n in figures.nodes))
        )

    def show_error(self, message: str) -> None:
        self.add_class("unreachable")
        self.query_one("#cluster-summary", Static).update(Text(message, style="bold red"))


def summary(figures: ClusterFigures) -> RenderableType:
    g = figures.generation
    steps = sorted(g.step_ms_recent)
    ms = f"{statistics.median(steps):.1f}" if steps else NONE
    table = _pairs()
    table.add_row("model", figures.model)
    table.add_row("layers", f"{figures.layers} · context {figures.context}")
    table.add_row("tokens/s", f"{g.tokens_per_s:.1f}" if steps else NONE)
    if g.speculation:  # a step makes several tokens: its time is not a token's
        table.add_row("ms/step", ms)
        s = g.speculation
        table.add_row(
            "drafts",
            f"{s['draft']} · {s['acceptance']:.0%} accepted · "
            f"{s['tokens_per_step']:.2f} tokens/step",
        )
    else:
        table.add_row("ms/token", ms)
    if figures.allreduce is not None:
        a = figures.allreduce
        wire = " · float16" if a.wire == "float16" else ""  # float32 unless asked
        table.add_row("allreduce", f"{_us(a.median_us)} · p99 {_us(a.p99_us)}{wire}")
    elif len(figures.nodes) == 1:
        table.add_row("allreduce", f"{NONE} (one node)")
    else:
        table.add_row("allreduce", NONE)
    if figures.attention is not None and len(figures.nodes) > 1:
        sums = "one sum a layer" if figures.attention.on == "master" else "two sums a layer"
        table.add_row("attention", f"{figures.attention.on} · {sums}")
    table.add_row("requests", f"{g.active} active · {g.waiting} waiting / {g.slots}")
    parts: list[RenderableType] = [table]
    if g.last_loss:  # a node lost mid-answer: the answers went on; say so here, not in them
        parts.append(Text(f"node lost at {g.last_loss}", style="yellow"))
    if figures.down:
        parts.insert(0, Text(f"DOWN: {figures.down}", style="bold red"))
    return Group(*parts)


def node_block(node: NodeFigures) -> RenderableType:
    if not node.alive:
        state = Text("✕ down", style="bold red")
    elif node.standby:
        state = Text("◌ standby", style="yellow")
    elif not node.ready:
        state = Text("○ joining" if node.role == "worker" else "○ planning", style="yellow")
    else:
        state = Text("● up", style="green")
    title = Text.assemble((node.name, "bold"), "  ", (node.role, "italic"), "  ", state)
    table = _pairs()
    table.add_row("address", node.address or NONE)
    table.add_row("share", NONE if node.share is None else f"{node.share * 100:.1f}%")
    budget = f"/ {_bytes(node.memory_budget_bytes)}" if node.memory_budget_bytes else "· no budget"
    table.add_row("memory", f"{_bytes(node.rss_bytes)} {budget}")
    if node.kv_cache is not None:
        table.add_row("KV cache", f"{_bytes(node.kv_cache_bytes)} · {node.kv_cache}")
    table.add_row("window", NONE if node.window is None else f"{node.window} layers")
    table.add_row("compute", _ms(node.compute_ms))
    table.add_row("loader wait", _ms(node.loader_wait_ms))
    table.add_row("kernels", node.kernels or NONE)
    if node.hop_us_median is not None and node.hop_us_p99 is not None:
        link = "" if node.link_rtt_us is None else f" · link {_us(node.link_rtt_us)}"
        table.add_row("hop", f"{_us(node.hop_us_median)} · p99 {_us(node.hop_us_p99)}{link}")
    table.add_row("activations", node.activations or NONE)
    if node.heartbeat_silence_s is not None:
        table.add_row("heartbeat", f"{node.heartbeat_silence_s:.2f} s ago")
    return Group(Text(""), title, table)


def _pairs() -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="fold")
    return table


def _ms(value: float | None) -> str:
    return NONE if value is None else f"{value:.2f} ms"


def _us(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.0f} µs"


def _bytes(value: int | None) -> str:
    if value is None:
        return NONE
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


class SettingsScreen(ModalScreen[tuple[str, Sampling] | None]):
    """The system prompt and the sampling settings of the conversation."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save"),
    ]

    def __init__(self, system: str, sampling: Sampling) -> None:
        super().__init__()
        self.system = system
        self.sampling = sampling

    def compose(self) -> ComposeResult:
        with Vertical(id="settings"):
            yield Label("System prompt")
            yield TextArea(self.system, id="system", soft_wrap=True, show_line_numbers=False)
            with Horizontal(id="sampling"):
                with Vertical():
                    yield Label("Temperature (0: greedy)")
                    yield Input(str(self.sampling.temperature), id="temperature", type="number")
                with Vertical():
                    yield Label("Top-p")
                    yield Input(str(self.sampling.top_p), id="top_p", type="number")
                with Vertical():
                    yield Label("Max tokens")
                    yield Input(str(self.sampling.max_tokens), id="max_tokens", type="integer")
            yield Static("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
        yield Footer()

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def action_save(self) -> None:
        try:
            sampling = Sampling(
                temperature=float(self.query_one("#temperature", Input).value),
                top_p=float(self.query_one("#top_p", Input).value),
                max_tokens=int(self.query_one("#max_tokens", Input).value),
            )
        except ValueError as exc:
            self.query_one("#settings-error", Static).update(f"{exc}")
            return
        self.dismiss((self.query_one("#system", TextArea).text, sampling))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConversationsScreen(ModalScreen[str | None]):
    """The saved conversations, the latest first; Enter opens one."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("enter", "open", "Open")]

    def __init__(self, conversations: list[Conversation], current: str | None) -> None:
        super().__init__()
        self.conversations = conversations
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="conversations"):
            yield Label(f"Saved conversations ({len(self.conversations)})")
            options = [
                Option(
                    Text.assemble(
                        (c.title or "(empty)", "bold"),
                        "\n",
                        (
                            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(c.updated))} · "
                            f"{len(c.messages)} messages",
                            "dim",
                        ),
                    ),
                    id=c.id,
                )
                for c in self.conversations
            ]
            yield OptionList(*options, id="conversation-list")
            if not options:
                yield Static("None yet: a conversation is saved after its first turn.")
        yield Footer()

    def on_mount(self) -> None:
        ids = [c.id for c in self.conversations]
        if self.current in ids:
            self.query_one(OptionList).highlighted = ids.index(self.current)

    @on(OptionList.OptionSelected)
    def _open(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_open(self) -> None:
        self.query_one(OptionList).action_select()

    def action_cancel(self) -> None:
        self.dismiss(None)
