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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

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


def note(message: str) -> None:
    err.print(f"[dim]{message}[/dim]" if interactive() else message, markup=interactive())


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {message}" if interactive() else f"warning: {message}", markup=interactive())


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


def confirm(question: str, *, yes: bool, to: str, nothing: str = "nothing was created") -> None:
    """Ask `question` on the terminal unless `--yes` (see `can_confirm` for the rule); returns only on yes.
    Blocks on the user's answer. Raises BadInput saying `nothing` happened otherwise."""
    can_confirm(yes=yes, to=to)
    if yes:
        return
    err.print(f"{question} [y/N] ", end="", markup=False)
    try:
        answer = input().strip().lower()
    except EOFError:
        answer = ""
    if answer not in ("y", "yes"):
        raise BadInput(f"not confirmed; {nothing}", field="--yes", hint=f"pass --yes to {to} without asking")


class ProgressBoard:
    """A live table of things in flight (resources, workers): key -> state, detail, elapsed.

    Thread-safe: provisioning updates it from worker threads. On a TTY it is a rich Live view; otherwise
    each state change prints one plain line, so logs and cron mails stay readable.
    """

    def __init__(self, title: str):
        self.title = title
        self._rows: dict[str, tuple[str, str, float]] = {}
        self._lock = threading.Lock()
        self._live: Live | None = None

    def __enter__(self) -> ProgressBoard:
        if interactive():
            self._live = Live(self._render(), console=err, refresh_per_second=8, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)
            self._live = None

    def update(self, key: str, state: str, detail: str = "") -> None:
        with self._lock:
            previous = self._rows.get(key)
            started = previous[2] if previous else time.monotonic()
            self._rows[key] = (state, detail, started)
            changed = previous is None or previous[:2] != (state, detail)
        if self._live is not None:
            self._live.update(self._render())
        elif changed:
            elapsed = time.monotonic() - started
            suffix = f" ({detail})" if detail else ""
            err.print(f"{key}: {state}{suffix} [{elapsed:.0f}s]", markup=False, soft_wrap=True)

    def _render(self) -> Table:
        t = Table(title=self.title, box=None, pad_edge=False)
        for c in ("resource", "state", "elapsed", "detail"):
            t.add_column(c)
        now = time.monotonic()
        with self._lock:
            for key, (state, detail, started) in self._rows.items():
                t.add_row(key, state, f"{now - started:.0f}s", detail)
        return t
