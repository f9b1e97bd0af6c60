"""A run's timeline (`gs://BUCKET/runs/RUN/timeline.json`) and the goodput and dollars-by-phase read from it.

`tpuctl run` marks every state it enters (`Step` values of `tpuctl.jobs.pipeline`) and, from worker 0's log
lines, the first step of each launch, each checkpoint save and restore and the last step before a watch ended.
What the issue calls the run's phases are these marks: requested = `up`, capacity granted = the mark after it,
workers ready = `workers_ready` (after every launch, recoveries' too), `first_step`, `checkpoint`,
`restored`, preemption = `recover` (its detail says why: `lost` or `maintenance`), recovered = the next
`first_step`, `teardown`, and the end (`done` or `failed`). A mark from a log line carries the time the line
reached tpuctl (log lines carry no time; up to a poll interval late). The file is written whole at each
transition and while watching by the pipeline (`--attach` and a detached run's supervisor continue it). A run
nobody watched to its end (`--detach --no-supervisor`, or a supervisor that `down` stopped) is ended by what
deleted its TPU, `down` or `gc` (`close`): its `teardown` and a `closed` end, whose detail says which.

The time between the first mark and the end is split into categories that follow Google's ML Goodput
Measurement library (https://github.com/AI-Hypercomputer/ml-goodput-measurement, README "Badput Breakdown
Details" and `goodput_utils.BadputType`); tpuctl measures from the request, not from the program's start:

| category | what | ml-goodput-measurement |
|---|---|---|
| `provisioning` | waiting for the TPU and creating the bucket, before the first launch | (before its job start) |
| `training_prep` | preparing and uploading data and the bundle | TRAINING_PREP, DATA_LOADING_SYNC |
| `program_startup` | launch to the job's first step (install, compile, restore) | TPU_INITIALIZATION, PROGRAM_STARTUP |
| `productive` | training whose steps were kept | GoodputType.TOTAL |
| `wasted_progress` | training after the checkpoint a resume restored, lost with the node | WASTED_PROGRESS_FROM_DISRUPTION |
| `recovery` | bringing the node back and relaunching, to the first step after | INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION |
| `other` | after the last step until the job ended (export, exit) | OTHER |
| `teardown` | collecting the artifacts and deleting the TPU and VMs | (after its job end) |

Blocking checkpoint saves are inside `productive`: a log line says when a save ended, not how long it blocked.
`goodput` is `productive` over the time the run held a TPU (all but `provisioning`); unknown, not 0, when no
step was seen while the job went unwatched (`detached`). Dollars per category are
each resource's own billing (tpuctl.cost) over the category's intervals, so they add up to the run's cost;
"lost to preemption" is `wasted_progress` + `recovery`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from tpuctl import cost
from tpuctl.errors import TpuctlError
from tpuctl.events import EventSink, Warn, ignore

if TYPE_CHECKING:
    from tpuctl.catalog import Catalog
    from tpuctl.ledger import Entry
    from tpuctl.provision import Clients

CATEGORIES = ("provisioning", "training_prep", "program_startup", "productive", "wasted_progress", "recovery",
              "other", "teardown")
LOST_TO_PREEMPTION = ("wasted_progress", "recovery")
# The end of a run that nobody watched to its end, marked by what deleted its TPU (`close`; detail: `down`, `gc: ...`).
CLOSED = "closed"
END = ("done", "failed", CLOSED)  # the last mark of a run that ended (a detached run's is `detached` until an attach)
# Which category the time in each state goes to; `watch` is split by its step marks (see `intervals`). While
# detached, nobody watched: what the job did then is not known.
_STATE_CATEGORY = {"up": "provisioning", "prepare": "training_prep", "ship": "training_prep",
                   "launch": "program_startup", "watch": "program_startup", "recover": "recovery",
                   "detached": "other", "attach": "other", "collect": "teardown", "teardown": "teardown"}
STATES = frozenset(_STATE_CATEGORY) | frozenset(END)
WATCHED_FROM = ("workers_ready", "attach")  # the next step seen is the first of a launch (or the first seen)
# The built-in templates' (and the stand-in's) lines for a checkpoint saved and one restored (templates/README.md).
SAVE_LINE = re.compile(r"^(checkpoint|restored) step=(\d+)")


def name(run: str) -> str:
    return f"runs/{run}/timeline.json"


@dataclass(frozen=True)
class Mark:
    at: float  # Unix seconds
    what: str  # a state entered (STATES) or: workers_ready, first_step, checkpoint, restored, last_step
    step: int | None = None
    detail: str = ""


class Timeline:
    """The marks of one run, appended from the pipeline's thread and its log streams' (hence the lock)."""

    def __init__(self, marks: Iterable[Mark] = ()):
        self.marks = list(marks)
        self._lock = threading.Lock()
        self._awaiting_first_step = False
        self._saved = len(self.marks)  # marks already in the bucket

    def mark(self, what: str, *, at: float, step: int | None = None, detail: str = "") -> None:
        with self._lock:
            self.marks.append(Mark(at, what, step, detail))
            if what in WATCHED_FROM:
                self._awaiting_first_step = True

    def first_step(self, step: int, *, at: float) -> None:
        """A step finished: marked when it is the first since the job was (re)launched or attached to."""
        with self._lock:
            if self._awaiting_first_step:
                self._awaiting_first_step = False
                self.marks.append(Mark(at, "first_step", step))

    def save(self, clients: Clients, bucket: str, run: str, *, on_event: EventSink = ignore) -> None:
        """Write it when it has new marks. Best effort, like the status record: a timeline write must never
        stop a run or its teardown."""
        from . import cluster

        with self._lock:
            count, doc = len(self.marks), {"v": 1, "marks": [asdict(m) for m in self.marks]}
        if count == self._saved:
            return
        try:
            cluster.write_json(clients, bucket, name(run), doc)
            self._saved = count
        except Exception as exc:  # noqa: BLE001 - see the docstring
            on_event(Warn(f"could not write gs://{bucket}/{name(run)}: {exc}"))


def load(clients: Clients, bucket: str, run: str) -> Timeline | None:
    from . import cluster

    doc = cluster.read_json(clients, bucket, name(run))
    return None if doc is None else Timeline(Mark(**m) for m in doc.get("marks", ()))


def close(clients: Clients, bucket: str, run: str, *, by: str, started: float, ended: float,
          on_event: EventSink = ignore) -> None:
    """End the timeline of a run whose TPU `by` (`down`, `gc: REASONS`) deleted from `started` to `ended`, when its
    pipeline did not (nobody watched it to its end): that deletion is its `teardown` and `ended` its end, so its
    wall time stops growing. A timeline that ended, or none (a run `up` made), is left as it is.

    Best effort, like `Timeline.save`: a missing bucket is nothing to close, and a record that cannot be read or
    written is a Warn event, never a failed deletion."""
    try:
        found = load(clients, bucket, run)
    except (TpuctlError, ValueError, TypeError) as exc:  # unreadable, or not a timeline
        on_event(Warn(f"could not read gs://{bucket}/{name(run)}: {exc}"))
        return
    if found is None or any(m.what in END for m in found.marks):
        return
    found.mark("teardown", at=started, detail=by)
    found.mark(CLOSED, at=ended, detail=by)
    found.save(clients, bucket, run, on_event=on_event)


# Ledger kinds (provision.resources.Kind values) the pipeline's teardown deletes, waiting until they are gone.
_TORN_DOWN = ("tpu", "queued-resource")


def gone_by(marks: Iterable[Mark], kind: str) -> float | None:
    """The latest a resource of the run (of ledger `kind`) was deleted, for one that nobody here saw go (tpuctl.ledger
    `closed_by_scan`): a TPU or queued resource once the run's teardown moved on (the state mark after it), anything
    else (the supervisor VM deletes itself after the run's end) at the run's end, its last seconds unrecorded.
    None while the run has not ended: it may still make a TPU again."""
    states = [m for m in sorted(marks, key=lambda m: m.at) if m.what in STATES]
    end = next((i for i, m in enumerate(states) if m.what in END), None)
    if end is None:
        return None
    teardown = max((i for i, m in enumerate(states[:end]) if m.what == "teardown"), default=None)
    return states[teardown + 1].at if kind in _TORN_DOWN and teardown is not None else states[end].at


def _first(marks: Sequence[Mark], what: str, t0: float, t1: float) -> Mark | None:
    return next((m for m in marks if m.what == what and t0 <= m.at <= t1), None)


def _last(marks: Sequence[Mark], what: str, t0: float, t1: float) -> Mark | None:
    return next((m for m in reversed(marks) if m.what == what and t0 <= m.at <= t1), None)


def _saved_at(marks: Sequence[Mark], step: int | None, first: Mark, last: Mark | None, until: float) -> float:
    """When `step` was checkpointed: its `checkpoint` mark, else (its line died with the node) the time the watch
    reached it, between its first and last step marks at their pace; the first step's when unknown."""
    saved = next((x for x in reversed(marks) if x.what == "checkpoint" and x.step == step and x.at <= until), None)
    if saved is not None:
        return saved.at
    if step is None or last is None or last.step is None or first.step is None or last.step <= first.step:
        return first.at
    return first.at + (last.at - first.at) * (step - first.step) / (last.step - first.step)


def intervals(marks: Iterable[Mark], *, now: float) -> list[tuple[str, float, float]]:
    """(category, start, end) covering the run from its first state mark to its end (`now` while it runs)."""
    marks = sorted(marks, key=lambda m: m.at)
    states = [m for m in marks if m.what in STATES]
    out: list[tuple[str, float, float]] = []
    after_loss = False  # a recovery lasts until the relaunched job's first step

    def add(category: str, t0: float, t1: float) -> None:
        if t1 > t0:
            out.append((category, t0, t1))

    for i, m in enumerate(states):
        if m.what in END:
            break
        t0, t1 = m.at, states[i + 1].at if i + 1 < len(states) else now
        if m.what == "recover":
            after_loss = True
        if m.what != "watch":
            add(_STATE_CATEGORY[m.what], t0, t1)
            continue
        # Steps are dated by the worker's clock: the job may train a moment before the watch begins (between its
        # launch's `workers_ready` and the `watch` mark), so its first step is looked for from the launch on.
        since = max((x.at for x in marks if x.what in WATCHED_FROM and x.at <= t0), default=t0)
        first = _first(marks, "first_step", since, t1)
        if first is not None and first.at < t0:
            first = replace(first, at=t0)
        if first is None:  # no step in this watch: it never got past starting
            add("recovery" if after_loss else "program_startup", t0, t1)
            continue
        add("recovery" if after_loss else "program_startup", t0, first.at)
        after_loss = False
        lost = i + 1 < len(states) and states[i + 1].what == "recover"
        if lost:
            # Kept: up to the checkpoint the next launch restored (its `restored` mark, else its first step - 1).
            later = marks[marks.index(states[i + 1]):]
            resumed = next((x.step - (x.what == "first_step") for x in later
                            if x.what in ("restored", "first_step") and x.step is not None), None)
            kept = min(max(_saved_at(marks, resumed, first, _last(marks, "last_step", t0, t1), t1), first.at), t1)
            add("productive", first.at, kept)
            add("wasted_progress", kept, t1)
        else:
            last = _last(marks, "last_step", t0, t1)
            end = min(max(last.at if last else t1, first.at), t1)
            add("productive", first.at, end)
            add("other", end, t1)
    return out


@dataclass(frozen=True)
class Goodput:
    seconds: dict[str, float]
    usd: dict[str, float]
    wall_s: float
    recoveries: int
    goodput: float | None  # productive / time holding a TPU; None before any TPU time, or its steps unseen (account)
    ended: bool
    lost_to_preemption_usd: float = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "lost_to_preemption_usd", sum(self.usd[c] for c in LOST_TO_PREEMPTION))

    def to_json(self) -> dict:
        return {"goodput": None if self.goodput is None else round(self.goodput, 4), "recoveries": self.recoveries,
                "wall_s": round(self.wall_s, 2), "ended": self.ended,
                "seconds": {c: round(s, 2) for c, s in self.seconds.items()},
                "usd": {c: round(u, 6) for c, u in self.usd.items()},
                "lost_to_preemption_usd": round(self.lost_to_preemption_usd, 6),
                "total_usd": round(sum(self.usd.values()), 6)}


def account(timeline: Timeline, *, now: float, entries: Iterable[Entry] = (), catalog: Catalog | None = None) -> Goodput:
    """Seconds and (given the run's ledger `entries` and a catalog) dollars per category, and the goodput."""
    spans = intervals(timeline.marks, now=now)
    entries = list(entries)
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    usd = dict.fromkeys(CATEGORIES, 0.0)
    for category, t0, t1 in spans:
        seconds[category] += t1 - t0
        if catalog is not None:
            usd[category] += sum(cost.accrued(e, catalog, now=t1, since=t0) for e in entries)
    held = sum(seconds.values()) - seconds["provisioning"]
    # No step seen, and the job went unwatched for a while (`detached`): it may have trained then, so its goodput
    # is unknown, not 0 (a watched job that never reached a step has 0).
    unseen = (not any(m.what == "first_step" for m in timeline.marks)
              and any(m.what == "detached" for m in timeline.marks))
    return Goodput(seconds=seconds, usd=usd, wall_s=sum(seconds.values()),
                   recoveries=sum(m.what == "recover" for m in timeline.marks),
                   goodput=seconds["productive"] / held if held > 0 and not unseen else None,
                   ended=any(m.what in END for m in timeline.marks))
