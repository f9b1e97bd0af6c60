"""The typed events tpuctl's library reports through: the one way `provision`, `jobs` and the core speak.

The library never prints, prompts or imports a terminal library. Each long operation takes an `on_event`
callback (`EventSink`) and calls it with one of the frozen dataclasses below; the CLI renders them (a live board
on a terminal, plain lines otherwise, NDJSON with `--json`), a notebook or a scheduler does what it likes.
A sink is called synchronously, so it must return quickly; `tpuctl.run` serialises the calls (never two at
once), although they may come from the library's worker threads. A sink should not raise; if it does,
`tpuctl.run` calls it no more, stops at its next check and tears down (raising TpuctlError from it), and
`up`/`down` fail the step that reported.

Wire format (`Event.to_json()`, one JSON object per line with `tpuctl run|up|down --json`): every object
has `v` (the schema version, `SCHEMA_VERSION`), `type` (below), `at` (Unix seconds) and the event's own
fields. Version rules: a new event type or a new field keeps the version, so readers must ignore what
they do not know; renaming or removing a field, or changing its meaning, bumps it.

| type | fields |
|------|--------|
| `run_planned` | run, accelerator, zones, bucket, price_per_hour, provisioning, framework, runtime_version |
| `resource` | key (`KIND/LOCATION/NAME`), state (a `provision.State` value), detail |
| `phase_started` | name, detail |
| `phase_ended` | name, seconds, ok |
| `log` | worker, line |
| `metrics` | worker, step, loss, examples_per_s, max_steps |
| `recovery_started` | attempt, max_attempts, reason |
| `recovery_ended` | attempt, ok |
| `cost` | usd, price_per_hour, final |
| `warning` | message |
| `note` | message |

After the events, `--json` writes one summary object with `"type": "summary"` (`SUMMARY_TYPE`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

SCHEMA_VERSION = 1
SUMMARY_TYPE = "summary"


@dataclass(frozen=True)
class Event:
    """Base of every event: `type` names it on the wire, `at` is when it happened (Unix seconds)."""

    type: ClassVar[str] = "event"
    at: float = field(default_factory=time.time, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        """The wire form: `v`, `type`, `at` and the fields, JSON-ready (tuples become lists)."""
        return {"v": SCHEMA_VERSION, "type": self.type, **asdict(self)}


EventSink = Callable[[Event], None]


def ignore(event: Event) -> None:
    """The sink of a caller that did not ask to hear anything."""


def resource_progress(sink: EventSink) -> Callable[[str, str, str], None]:
    """`provision`'s progress callback (key, state, detail) reporting ResourceChanged events to `sink`: each
    (state, detail) of a resource once, as it changes. provision's waits report at every poll (a TPU's create,
    ~90 identical lines of `up --json` on the local cloud), and an event says a resource *changed*. Thread-safe:
    apply creates resources in parallel."""
    last: dict[str, tuple[str, str]] = {}
    lock = threading.Lock()

    def progress(key: str, state: str, detail: str) -> None:
        with lock:
            if last.get(key) == (state, detail):
                return
            last[key] = (state, detail)
        sink(ResourceChanged(key, state, detail))

    return progress


@dataclass(frozen=True)
class RunPlanned(Event):
    """`tpuctl run` validated the spec and chose where it goes; nothing is created yet."""

    type: ClassVar[str] = "run_planned"
    run: str
    accelerator: str
    zones: tuple[str, ...]
    bucket: str
    price_per_hour: float
    provisioning: str = ""
    framework: str | None = None
    runtime_version: str | None = None


@dataclass(frozen=True)
class ResourceChanged(Event):
    """A cloud resource changed state (creating, ready, deleting, deleted, ...) or detail ("requested")."""

    type: ClassVar[str] = "resource"
    key: str
    state: str
    detail: str = ""


@dataclass(frozen=True)
class PhaseStarted(Event):
    type: ClassVar[str] = "phase_started"
    name: str
    detail: str = ""


@dataclass(frozen=True)
class PhaseEnded(Event):
    """A phase ended after `seconds`; `ok` is False when it raised (failure, cancel, Ctrl-C)."""

    type: ClassVar[str] = "phase_ended"
    name: str
    seconds: float
    ok: bool = True


@dataclass(frozen=True)
class WorkerLog(Event):
    """One line a worker's job wrote. Step lines come from worker 0 only: every worker trains the same steps,
    and a 64-host slice should not say each one 64 times (their numbers are in `Metrics`)."""

    type: ClassVar[str] = "log"
    worker: int
    line: str


@dataclass(frozen=True)
class Metrics(Event):
    """A worker finished a step. `max_steps` is the job's target when its log said so (for an ETA)."""

    type: ClassVar[str] = "metrics"
    worker: int
    step: int
    loss: float | None = None
    examples_per_s: float | None = None
    max_steps: int | None = None


@dataclass(frozen=True)
class RecoveryStarted(Event):
    """The TPU node was preempted, lost or under maintenance; recovery `attempt` of `max_attempts` begins."""

    type: ClassVar[str] = "recovery_started"
    attempt: int
    max_attempts: int
    reason: str


@dataclass(frozen=True)
class RecoveryEnded(Event):
    type: ClassVar[str] = "recovery_ended"
    attempt: int
    ok: bool


@dataclass(frozen=True)
class CostAccrued(Event):
    """What the run has cost so far (`final`: the ledger's figure after teardown; else price x time up)."""

    type: ClassVar[str] = "cost"
    usd: float
    price_per_hour: float
    final: bool = False


@dataclass(frozen=True)
class Warn(Event):
    """Something the user should know that did not stop the operation."""

    type: ClassVar[str] = "warning"
    message: str


@dataclass(frozen=True)
class Note(Event):
    type: ClassVar[str] = "note"
    message: str


TYPES: Mapping[str, type[Event]] = {c.type: c for c in (
    RunPlanned, ResourceChanged, PhaseStarted, PhaseEnded, WorkerLog, Metrics, RecoveryStarted, RecoveryEnded,
    CostAccrued, Warn, Note)}


def from_json(data: Mapping[str, Any]) -> Event:
    """The event a `to_json()` object describes; unknown fields are ignored (see the version rules).
    Raises KeyError for an unknown type and ValueError for another schema version."""
    if data.get("v") != SCHEMA_VERSION:
        raise ValueError(f"event schema version {data.get('v')!r}, expected {SCHEMA_VERSION}")
    cls = TYPES[data["type"]]
    known = {f.name for f in fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
    return cls(**values)
