"""A small local ledger of the resources tpuctl saw created and deleted: the memory behind `tpuctl cost`.

Labels on the cloud resources decide what exists; the ledger only remembers what no longer does (a deleted
TPU has no labels left to read), so cost reports can include finished runs. Losing the file loses history,
never control: `gc` and `down` never consult it to decide what to delete.

Concurrency: every read-modify-write holds an exclusive `fcntl` lock on a sidecar file, and the JSON is
replaced atomically (write then rename), so two tpuctl processes never interleave or tear it.
"""

from __future__ import annotations

import fcntl
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tpuctl.events import EventSink, Warn, ignore

from tpuctl import paths
from tpuctl.catalog import write_json_atomic

_VERSION = 1
# The soft-deleted bytes a deleted bucket left behind: Cloud Storage bills them at the storage rate until their
# hard delete time, after the bucket is gone.
SOFT_DELETED = "soft-deleted"


@dataclass(frozen=True)
class Entry:
    """One resource's lifetime as tpuctl last knew it; times are unix seconds."""

    kind: str  # provision.resources.Kind value ("tpu", "queued-resource", "vm", "bucket") or SOFT_DELETED
    name: str
    project: str
    location: str
    run: str | None
    owner: str | None
    created: float
    deleted: float | None = None
    accelerator: str | None = None
    machine_type: str | None = None
    spot: bool = False
    disk_gb: int = 0
    ends: float | None = None  # when the provider deletes it by itself (a flex-start TPU's max run duration)
    rolled_back: bool = False  # created and deleted again by the same `up` (failure, Ctrl-C, no capacity)
    gb: float = 0.0  # SOFT_DELETED: the bytes still billed from `created` until `deleted` (hard delete time)
    # The billed window of a TPU or VM (tpuctl.cost's docstring says why): from when it became READY/RUNNING
    # (None: from `created`, as ledgers written before these fields counted) until it stopped billing while it
    # still existed (stopped, preempted, or not READY yet; None: until `deleted`).
    billed_from: float | None = None
    billed_until: float | None = None
    # `deleted` is when a scan found it gone (`Ledger.reconcile`), not when it went: it went while nobody here
    # watched (a detached run's supervisor, another machine), at most then. `Ledger.settle` puts the time its
    # run's own record gives, once.
    closed_by_scan: bool = False

    @property
    def key(self) -> str:
        return f"{self.project}/{self.kind}/{self.location}/{self.name}"


def entry_of(r: Any, *, now: float | None = None) -> Entry:
    """The ledger entry of a live `tpuctl.provision.resources.Resource`.

    Creation time: the API's own create time, else the `tpuctl-created` label, else `now` (a resource seen
    for the first time without either is costed from when it was first seen). Billing: from `detail["ready"]`
    (when tpuctl saw it become READY, or Compute's `lastStartTimestamp`), else from its creation; nothing yet
    while it is PENDING or CREATING; until `detail["stopped"]` (Compute's `lastStopTimestamp`), else `now`,
    while it is STOPPED or PREEMPTED.
    """
    created = r.created.timestamp() if r.created is not None else None
    if created is None:
        try:
            created = float(r.labels["tpuctl-created"])
        except (KeyError, ValueError):
            created = time.time() if now is None else now
    now = time.time() if now is None else now
    billed_from, billed_until = _timestamp(r.detail.get("ready")) or created, None
    if r.state.value in _NOT_YET:
        billed_from = billed_until = now
    elif r.state.value in _STOPPED:
        billed_until = _timestamp(r.detail.get("stopped")) or now
    return Entry(kind=r.kind.value, name=r.name, project=r.project, location=r.location, run=r.run,
                 owner=r.labels.get("tpuctl-owner"), created=created, accelerator=r.accelerator,
                 machine_type=r.machine_type, spot=bool(r.spot), disk_gb=int(r.detail.get("disk_gb", 0) or 0),
                 ends=_timestamp(r.detail.get("ends")), billed_from=billed_from, billed_until=billed_until)


# provision.resources.State values: not billing yet (queued, being created or started), and no longer billing
# while the resource still exists.
_NOT_YET = frozenset({"pending", "creating"})
_STOPPED = frozenset({"stopped", "preempted", "failed"})


def _billed(old: Entry, new: Entry) -> dict[str, float | None]:
    """The billed window from two sightings of one resource, older first.

    It began billing when first seen billing (an earlier sighting's start stands: a later one that did not
    watch it become READY can only assume its creation), or, if no sighting saw it billing yet, at the latest
    moment one saw it not billing. It stopped billing when it was first seen stopped, unless the newer sighting
    sees it billing again (a node started after a stop: the gap between is counted, see tpuctl.cost)."""
    start = old.billed_from if old.billed_from is not None else old.created
    if old.billed_until is not None and old.billed_until <= start:  # never seen billing
        start = max(start, new.billed_from if new.billed_from is not None else new.created)
    until = None
    if new.billed_until is not None:
        until = new.billed_until if old.billed_until is None else min(old.billed_until, new.billed_until)
    return {"billed_from": start, "billed_until": until}


def _timestamp(text: str | None) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None
    except ValueError:
        return None


def key_of(r: Any) -> str:
    """The ledger key of a live resource (same as `entry_of(r).key`)."""
    return f"{r.project}/{r.kind.value}/{r.location}/{r.name}"


def remember(resources: Iterable[Any], *, deleted: bool = False, on_event: EventSink = ignore) -> None:
    """Best effort: record `tpuctl.provision` resources as last seen (and, with `deleted`, mark them deleted now)
    in the default ledger.

    IAM bindings cost nothing and are skipped. A ledger that cannot be written is a Warn event and never fails
    the command: labels, not the ledger, decide what exists."""
    from tpuctl.provision.resources import Kind  # loaded already: callers hold provision resources

    rows = [s for r in resources if r.kind is not Kind.IAM for s in _slices(r)]
    try:
        book = Ledger()
        # What was last seen of each counts too when it is gone: a node seen PREEMPTED stopped billing then.
        book.record([entry_of(r) for r in rows])
        if deleted:
            book.mark_deleted([key_of(r) for r in rows])
    except OSError as exc:
        on_event(Warn(f"could not update the local cost ledger: {exc}"))


def _slices(r: Any) -> list[Any]:
    """A multislice TPU (provision's one TPU of N slices, `detail["slice_nodes"]`) bills as its N slice nodes:
    one entry each, the entries that teardown's, recovery's and gc's sightings of those nodes meet."""
    names = r.detail.get("slice_nodes")
    return [replace(r, name=name) for name in names.split(",")] if names else [r]


def remember_gone(entries: Iterable[Entry], *, on_event: EventSink = ignore) -> None:
    """Best effort, like `remember`: record resources that existed and are already gone (an `up` rolled
    them back), so `tpuctl cost` still counts what they billed."""
    try:
        Ledger().record(entries)
    except OSError as exc:
        on_event(Warn(f"could not update the local cost ledger: {exc}"))


class Ledger:
    """The ledger file at `path` (default `tpuctl.paths.ledger()`). Each method is one locked transaction."""

    def __init__(self, path: Path | None = None):
        self.path = path or paths.ledger()

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                doc = self._read()
                before = json.dumps(doc, sort_keys=True)
                yield doc
                if json.dumps(doc, sort_keys=True) != before:
                    write_json_atomic(self.path, doc)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": _VERSION, "resources": {}}
        except ValueError:
            # A corrupt cache is set aside rather than trusted or fatal; labels still decide what exists.
            self.path.replace(self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}"))
            return {"version": _VERSION, "resources": {}}
        doc.setdefault("resources", {})
        return doc

    def entries(self) -> list[Entry]:
        """Every entry, live and deleted, oldest first."""
        with self._locked() as doc:
            out = [Entry(**e) for e in doc["resources"].values()]
        return sorted(out, key=lambda e: e.created)

    def record(self, entries: Iterable[Entry]) -> None:
        """Remember resources seen alive (idempotent: an entry already known keeps its earliest creation
        time and its deletion time, if any, and `_billed` merges what each sighting knew of its billing).

        A resource created after an earlier one of the same name was deleted (the same run started again,
        a preempted node recreated) is a new incarnation: the old one is kept under `KEY@CREATED`, so both
        lifetimes are costed."""
        with self._locked() as doc:
            res = doc["resources"]
            for e in entries:
                old = res.get(e.key)
                if old is not None and old.get("deleted") is not None and e.created > old["deleted"]:
                    res[f"{e.key}@{old['created']:.0f}"] = old
                elif old is not None:
                    gone = old.get("deleted") is not None  # a stale sighting does not bring it back
                    e = replace(e, created=min(e.created, old["created"]),
                                deleted=old["deleted"] if gone else e.deleted,
                                closed_by_scan=bool(old.get("closed_by_scan")) if gone else e.closed_by_scan,
                                rolled_back=e.rolled_back or bool(old.get("rolled_back")),
                                **_billed(Entry(**old), e))
                res[e.key] = asdict(e)

    def mark_deleted(self, keys: Iterable[str], at: float | None = None) -> None:
        """Mark resources deleted at `at` (default now). Idempotent: a first deletion time is kept."""
        at = time.time() if at is None else at
        with self._locked() as doc:
            for k in keys:
                e = doc["resources"].get(k)
                if e is not None and e.get("deleted") is None:
                    e["deleted"] = at

    def reconcile(self, live_keys: Iterable[str], scanned_projects: Iterable[str], at: float | None = None) -> None:
        """After a complete scan of `scanned_projects`: entries of those projects the scan did not see were
        deleted by someone else (a supervisor, console, `down` on another machine); close them at `at` (default
        now), the latest they can have gone, marked `closed_by_scan` for `settle` to correct."""
        at = time.time() if at is None else at
        live = set(live_keys)
        projects = set(scanned_projects)
        with self._locked() as doc:
            for k, e in doc["resources"].items():
                if e["project"] in projects and e.get("deleted") is None and k not in live:
                    e.update(deleted=at, closed_by_scan=True)

    def settle(self, deleted_at: Callable[[Entry], float | None]) -> None:
        """Give each entry a scan closed the time it was deleted, `deleted_at(entry)` (from what its run
        recorded; None: not known yet, asked again next time), and clear its mark: settled once.

        A time outside the entry's life [created, the scan] is not about this incarnation (the record is of
        another life of the same name): the scan's time stands."""
        with self._locked() as doc:
            for e in doc["resources"].values():
                if not e.get("closed_by_scan") or (at := deleted_at(Entry(**e))) is None:
                    continue
                if e["created"] <= at < e["deleted"]:
                    e["deleted"] = at
                e["closed_by_scan"] = False
