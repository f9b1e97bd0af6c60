"""All terminal output goes through here; rich is imported nowhere else.

Data (tables, JSON) goes to stdout, progress and diagnostics to stderr, so `tpuctl list --json | jq` works.
Colour and live views only on a TTY with NO_COLOR unset; otherwise plain, cron-friendly lines.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tpuctl import events as ev
from tpuctl.errors import BadInput, TpuctlError


def _fancy(stream) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def _console(stream) -> Console:
    fancy = _fancy(stream)
    return Console(
        file=stream,
        no_color=not fancy,
        force_terminal=fancy,
        highlight=False,
        soft_wrap=not fancy,
        width=None if fancy else 200,
    )


out = _console(sys.stdout)
err = _console(sys.stderr)


def interactive() -> bool:
    return _fancy(sys.stderr)


def info(message: str) -> None:
    err.print(message, markup=False)


def note(message: str) -> None:  # escaped: a message's own brackets (`tpuctl[tpu]`) are not markup
    err.print(f"[dim]{_escape(message)}[/dim]" if interactive() else message, markup=interactive())


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {_escape(message)}" if interactive() else f"warning: {message}",
              markup=interactive())


def error(exc: TpuctlError) -> None:
    """One line naming the field and the problem, then the hint on its own line."""
    head = f"[bold red]error:[/bold red] {_escape(str(exc))}" if interactive() else f"error: {exc}"
    err.print(head, markup=interactive(), soft_wrap=True)
    if exc.hint:
        err.print(f"  hint: {exc.hint}", markup=False, soft_wrap=True)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def emit_json_line(record: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(record, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None) -> None:
    t = Table(title=title, show_edge=False, box=None if not _fancy(sys.stdout) else None, pad_edge=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    out.print(t)


def can_confirm(*, yes: bool, to: str) -> None:
    """The one confirmation rule for every command that creates or deletes (up, run, down, gc): `--yes`
    answers; otherwise a terminal must be there to ask on, whatever NO_COLOR or TERM say (colour and consent
    are unrelated). Commands call this before they touch anything, so a script without a terminal and
    without --yes is refused at once rather than after a scan. `to` ends the sentence "pass --yes to ...".
    Raises BadInput (exit 2)."""
    if not yes and not sys.stdin.isatty():
        raise BadInput(f"no terminal to confirm on; pass --yes to {to}", field="--yes")


def confirm(question: str, *, yes: bool, to: str, nothing: str = "nothing was created") -> bool:
    """Ask `question` on the terminal unless `--yes` (see `can_confirm` for the rule); returns True on yes.
    Blocks on the user's answer. Raises BadInput saying `nothing` happened otherwise."""
    can_confirm(yes=yes, to=to)
    if yes:
        return True
    err.print(f"{question} [y/N] ", end="", markup=False)
    try:
        answer = input().strip().lower()
    except EOFError:
        answer = ""
    if answer not in ("y", "yes"):
        raise BadInput(f"not confirmed; {nothing}", field="--yes", hint=f"pass --yes to {to} without asking")
    return True


def tee(*sinks: ev.EventSink | None) -> ev.EventSink:
    """One sink that reports to each given one (None: skipped), e.g. the board and `--json`'s lines."""
    chosen = [s for s in sinks if s is not None]

    def each(event: ev.Event) -> None:
        for sink in chosen:
            sink(event)

    return each


class Board:
    """Renders the library's events (tpuctl.events) for a person; an EventSink, safe to call from any thread.

    On a TTY: a live table of each resource's state, each worker's step, loss and examples/s, and a footer
    with the phase, elapsed time, cost so far and an ETA from the step rate; log lines, notes and warnings
    print above it. Otherwise one plain line per change (a resource's new state, a phase, a log line), never
    a line that only says time passed or a detail changed, so logs and cron mails stay readable.
    """

    def __init__(self, title: str):
        self.title = title
        self._resources: dict[str, tuple[str, str, float]] = {}  # key -> state, detail, since (monotonic)
        self._workers: dict[int, ev.Metrics] = {}
        self._rate_from: ev.Metrics | None = None  # worker 0's first step since the job (re)started: the ETA's base
        self._phase = ""
        self._started = time.monotonic()
        self._billing_since: float | None = None  # wall clock of the first resource event
        self._price: float | None = None
        self._cost: ev.CostAccrued | None = None
        # Re-entrant: a signal handler in the main thread may report while that thread is inside a report.
        self._lock = threading.RLock()  # guards the state above; held only to read or change it
        self._live: Live | None = None

    def __enter__(self) -> Board:
        if interactive():
            # get_renderable: each refresh redraws from the current state, so elapsed times tick between events.
            self._live = Live(console=err, get_renderable=self._render, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the live view while the terminal is needed for something else (a confirmation prompt)."""
        live = self._live
        if live is not None:
            live.stop()
        try:
            yield
        finally:
            if live is not None:
                live.start()

    def __call__(self, event: ev.Event) -> None:
        # Print and redraw outside our lock: rich's refresh thread takes its own lock, then ours (in _render).
        with self._lock:
            line = self._apply(event)
        if line is not None:
            line(event)
        if self._live is not None:
            self._live.refresh()

    def _apply(self, event: ev.Event) -> Callable[[ev.Event], None] | None:
        """Update the state from `event`; return how to print it as a line, if it deserves one."""
        if isinstance(event, ev.ResourceChanged):
            previous = self._resources.get(event.key)
            since = previous[2] if previous else time.monotonic()
            self._resources[event.key] = (event.state, event.detail, since)
            if self._billing_since is None:
                self._billing_since = event.at
            # A new detail in the same state ("requested", "3/4 hosts") updates the live table only.
            if self._live is not None or (previous is not None and previous[0] == event.state):
                return None
            return lambda e: info(f"{e.key}: {e.state}{f' ({e.detail})' if e.detail else ''} "
                                  f"[{time.monotonic() - since:.0f}s]")
        if isinstance(event, ev.Metrics):
            self._workers[event.worker] = event
            if event.worker == 0 and (self._rate_from is None or event.step <= self._rate_from.step):
                self._rate_from = event  # a resumed job restarts from its checkpoint: measure anew
            return None
        if isinstance(event, ev.PhaseStarted):
            self._phase = event.name
            return lambda e: info(f"==> {e.name}{': ' + e.detail if e.detail else ''}")
        if isinstance(event, ev.RunPlanned):
            self._price = event.price_per_hour
            framework = f", {event.framework} on {event.runtime_version}" if event.framework else ""
            return lambda e: info(f"run {e.run}: {e.accelerator} in {', '.join(e.zones)} ({e.provisioning}"
                                  f"{framework}), bucket gs://{e.bucket}, ~${e.price_per_hour:.2f}/h")
        if isinstance(event, ev.CostAccrued):
            self._cost = event
            return None
        if isinstance(event, ev.WorkerLog):
            return lambda e: info(f"[w{e.worker}] {e.line}")
        if isinstance(event, ev.Warn):
            return lambda e: warn(e.message)
        if isinstance(event, ev.Note):
            return lambda e: note(e.message)
        return None  # phase ends and recoveries show in the table and the phases that follow

    def _eta(self) -> str:
        now, first = self._workers.get(0), self._rate_from
        if now is None or first is None or now.max_steps is None or now.step <= first.step:
            return "-"
        rate = (now.step - first.step) / max(now.at - first.at, 1e-6)
        return f"{max(now.max_steps - now.step, 0) / rate:.0f}s"

    def _cost_so_far(self) -> str:
        if self._cost is not None and self._cost.final:
            return f"${self._cost.usd:.4f}"
        if self._price is not None and self._billing_since is not None:
            return f"~${self._price * (time.time() - self._billing_since) / 3600:.4f}"
        return "-"

    def _render(self) -> Table:
        now = time.monotonic()
        with self._lock:
            t = Table(title=self.title, box=None, pad_edge=False,
                      caption=f"phase {self._phase or '-'}, {now - self._started:.0f}s elapsed, "
                              f"cost {self._cost_so_far()}, ETA {self._eta()}")
            for c in ("resource / worker", "state", "elapsed", "detail"):
                t.add_column(c)
            for key, (state, detail, since) in self._resources.items():
                t.add_row(key, state, f"{now - since:.0f}s", detail)
            for index, m in sorted(self._workers.items()):
                target = f"/{m.max_steps}" if m.max_steps else ""
                loss = f"loss {m.loss:.4g}" if m.loss is not None else ""
                rate = f"{m.examples_per_s:g} examples/s" if m.examples_per_s is not None else ""
                t.add_row(f"worker {index}", f"step {m.step}{target}", "", ", ".join(x for x in (loss, rate) if x))
        return t


class JsonLines:
    """The `--json` sink: each event as one JSON object on stdout (tpuctl.events' wire format), then
    `summary(...)` as the last line. Thread-safe; lines never interleave."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, event: ev.Event) -> None:
        self._write(event.to_json())

    def summary(self, fields: Mapping[str, Any]) -> None:
        self._write({"v": ev.SCHEMA_VERSION, "type": ev.SUMMARY_TYPE, **fields})

    def _write(self, record: Mapping[str, Any]) -> None:
        with self._lock:
            emit_json_line(record)


def report(event: ev.Event) -> None:
    """Render a note or warning the library reported outside any board (config, spec, ledger, ssh)."""
    if isinstance(event, ev.Warn):
        warn(event.message)
    elif isinstance(event, ev.Note):
        note(event.message)
