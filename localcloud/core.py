"""The shared machinery of the local cloud: API errors, the operations clock, faults, the meter, the world.

`World` holds everything the services share: one re-entrant lock (every state change happens under it),
a condition that wakes `operations.wait` callers, the scheduler that fires delayed transitions, the fault
registry, the billing meter, the worker pool and the snapshot writer. Scheduled transitions are *named
actions* with JSON arguments so a persisted snapshot can re-arm them after a restart.
"""

from __future__ import annotations

import fnmatch
import heapq
import itertools
import json
import os
import random
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

# gRPC status name -> HTTP status, as Google's REST front ends map them.
HTTP_OF = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "ABORTED": 409,
    "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499, "INTERNAL": 500, "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}
CODE_OF = {
    "CANCELLED": 1, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5, "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9, "ABORTED": 10,
    "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14, "UNAUTHENTICATED": 16,
}
_COMPUTE_REASON = {
    400: "invalid", 404: "notFound", 409: "alreadyExists", 412: "conditionNotMet", 429: "rateLimitExceeded",
    503: "backendError", 501: "notImplemented",
}


class ApiError(Exception):
    """An error response. `status` is the gRPC status name; `http` defaults from it."""

    def __init__(self, status: str, message: str, *, http: int | None = None, details: list | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.http = http or HTTP_OF[status]
        self.details = details or []
        self.reason = reason

    def body(self, style: str) -> dict:
        """The error body as Google's one-platform APIs (`style="google"`) or Compute (`"compute"`) send it."""
        err: dict[str, Any] = {"code": self.http, "message": self.message, "status": self.status}
        details = self.details
        if style == "compute":
            err["errors"] = [{"message": self.message, "domain": "global",
                              "reason": self.reason or _COMPUTE_REASON.get(self.http, "invalid")}]
            if self.http == 403:
                # A Compute 403 (a quota, a missing permission) carries its user-facing text as a
                # google.rpc.LocalizedMessage, where AIP-193 puts it (README "Google's failure shapes").
                details = [*details, {"@type": "type.googleapis.com/google.rpc.LocalizedMessage", "locale": "en-US",
                                      "message": self.message}]
        if details:
            err["details"] = details
        return {"error": err}


def now_rfc3339(t: float | None = None) -> str:
    t = time.time() if t is None else t
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def parse_duration(text: str) -> float:
    """A google-duration ("3600s", "1.5s") in seconds."""
    if not text.endswith("s"):
        raise ApiError("INVALID_ARGUMENT", f"invalid duration {text!r}: expected seconds like '3600s'")
    try:
        return float(text[:-1])
    except ValueError:
        raise ApiError("INVALID_ARGUMENT", f"invalid duration {text!r}: expected seconds like '3600s'") from None


def parse_time(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ApiError("INVALID_ARGUMENT", f"invalid timestamp {text!r}: expected RFC 3339") from None


_LABEL_KEY_RE = re.compile(r"^[\w-]{1,63}$")
_LABEL_VALUE_RE = re.compile(r"^[\w-]{0,63}$")


def check_labels(labels: dict | None, field: str) -> None:
    """GCP label rules: at most 64; keys start with a lowercase letter; keys and values at most 63
    lowercase letters, digits, `_` or `-` (international letters allowed). ApiError INVALID_ARGUMENT."""
    labels = labels or {}
    if len(labels) > 64:
        raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{field}': at most 64 labels are allowed, got {len(labels)}.")
    for key, value in labels.items():
        if not (_LABEL_KEY_RE.match(key) and key[0].isalpha() and key == key.lower()):
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{field}': label key '{key}' violates format "
                           "constraints: it must start with a lowercase letter and contain at most 63 lowercase "
                           "letters, digits, underscores and dashes.")
        if not (isinstance(value, str) and _LABEL_VALUE_RE.match(value) and value == value.lower()):
            raise ApiError("INVALID_ARGUMENT", f"Invalid value for field '{field}': label value '{value}' violates "
                           "format constraints: at most 63 lowercase letters, digits, underscores and dashes.")


# ----------------------------------------------------------------------------------------------- scheduler

@dataclass(order=True)
class _Timer:
    due: float                      # wall-clock seconds (persisted, so restarts keep the remaining delay)
    seq: int
    action: str = field(compare=False)
    args: dict = field(compare=False)


class Scheduler:
    """Fires named actions at wall-clock times on one background thread.

    Actions run WITHOUT the world lock held: they take it themselves, so a slow step (starting SSH
    servers for a 64-host slice) does not stall HTTP requests. A running action still counts as
    pending until it returns, so a snapshot taken meanwhile re-runs it after a restart: actions must be
    idempotent (they check the state they move from).
    """

    def __init__(self, actions: dict[str, Callable[..., None]], on_error: Callable[[str, BaseException], None],
                 on_done: Callable[[], None]):
        self._actions = actions
        self._on_error = on_error
        self._on_done = on_done  # called once an action no longer counts as pending
        self._heap: list[_Timer] = []
        self._running: _Timer | None = None
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def at(self, due: float, action: str, **args) -> None:
        with self._cv:
            heapq.heappush(self._heap, _Timer(due, next(self._seq), action, args))
            self._cv.notify()

    def pending(self) -> list[dict]:
        with self._cv:
            timers = sorted(self._heap) + ([self._running] if self._running else [])
            return [{"due": t.due, "action": t.action, "args": t.args} for t in timers]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="localcloud-clock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (not self._heap or self._heap[0].due > time.time()):
                    wait = None if not self._heap else max(0.0, self._heap[0].due - time.time())
                    self._cv.wait(timeout=wait)
                if self._stopping:
                    return
                timer = self._running = heapq.heappop(self._heap)
            try:
                self._actions[timer.action](**timer.args)
            except BaseException as exc:  # one broken transition must not stop the clock
                self._on_error(timer.action, exc)
            finally:
                with self._cv:
                    self._running = None
                self._on_done()


# ----------------------------------------------------------------------------------------------- faults

FAULT_KINDS = ("capacity", "quota", "unavailable", "stuck", "preempt", "kill-worker", "drop-ssh", "repair",
               "no-guest-attributes", "preempt-creating", "odd-response")
# The operation error codes a TPU create fails with when a zone has no capacity (see README "Faults").
CAPACITY_CODES = (8, 9, 13)


@dataclass
class Fault:
    """One injected fault. `count` None = unlimited; `probability` rolls a seeded RNG per matching call."""

    id: str
    kind: str
    service: str | None = None          # "tpu", "compute", ...; None = any
    method: str | None = None           # glob on the short method id, e.g. "nodes.create", "instances.*"
    zone: str | None = None
    count: int | None = None
    probability: float = 1.0
    seed: int | None = None
    quota: str | None = None            # the quota a "quota" fault names
    code: int | None = None             # capacity: the TPU create operation's error code (8, 9 or 13)
    details: bool | None = None         # quota: False = a bare 429 without google.rpc.QuotaFailure
    in_operation: bool | None = None    # quota on Compute: the insert operation fails (403), not the request
    state: str | None = None            # repair: REPAIRING (default) or RESTARTING
    seconds: float | None = None        # repair: simulated seconds under maintenance (default 120)
    field: str | None = None            # odd-response: the response field (dotted path) left out
    empty: bool | None = None           # odd-response: True = the field is an empty list instead
    node: str | None = None             # preempt / kill-worker / drop-ssh target
    worker: int | None = None
    at: float | None = None             # preempt: wall-clock time
    hits: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class Faults:
    """The fault registry, shared by the Python API and `POST /_localcloud/faults`. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: dict[str, Fault] = {}
        self._ids = itertools.count(1)
        self.on_add: Callable[[Fault], None] | None = None

    def add(self, kind: str, **options) -> Fault:
        """Register a fault; returns it. Unknown kinds or options raise ValueError."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; choose one of {', '.join(FAULT_KINDS)}")
        known = set(Fault.__dataclass_fields__) - {"id", "kind", "hits"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown fault option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        if options.get("probability") is not None and not 0 <= float(options["probability"]) <= 1:
            raise ValueError("probability must be between 0 and 1")
        if options.get("code") is not None and int(options["code"]) not in CAPACITY_CODES:
            raise ValueError(f"code must be one of {', '.join(map(str, CAPACITY_CODES))}")
        if options.get("state") not in (None, "REPAIRING", "RESTARTING"):
            raise ValueError("state must be REPAIRING or RESTARTING")
        if kind == "odd-response" and not options.get("field"):
            raise ValueError("fault odd-response needs field= (the response field to leave out or empty)")
        options = {k: v for k, v in options.items() if v is not None}
        with self._lock:
            fault = Fault(id=f"f{next(self._ids)}", kind=kind, **options)
            self._faults[fault.id] = fault
        if self.on_add:
            self.on_add(fault)
        return fault

    def list(self) -> list[dict]:
        with self._lock:
            return [f.public() for f in self._faults.values()]

    def clear(self, fault_id: str | None = None) -> int:
        """Remove one fault (by id) or all; returns how many were removed."""
        with self._lock:
            if fault_id is None:
                n = len(self._faults)
                self._faults.clear()
                return n
            return 1 if self._faults.pop(fault_id, None) else 0

    def take(self, kind: str, service: str, method: str, zone: str | None,
             where: Callable[[Fault], bool] | None = None) -> Fault | None:
        """The first matching fault of `kind` (and `where`), consuming one of its count; None if none fires."""
        with self._lock:
            for fault in list(self._faults.values()):
                if fault.kind != kind or not _matches(fault, service, method, zone) or (where and not where(fault)):
                    continue
                if fault.probability < 1 and fault._rng.random() >= fault.probability:
                    continue
                fault.hits += 1
                if fault.count is not None:
                    fault.count -= 1
                    if fault.count <= 0:
                        del self._faults[fault.id]
                return fault
        return None


def _matches(fault: Fault, service: str, method: str, zone: str | None) -> bool:
    if fault.service and fault.service != service:
        return False
    if fault.method and not fnmatch.fnmatchcase(method, fault.method):
        return False
    if fault.zone and fault.zone != zone:
        return False
    return True


# ----------------------------------------------------------------------------------------------- meter

@dataclass
class Metered:
    resource: str
    kind: str              # "tpu", "vm", "bucket"
    sku: str               # "tpu/v3-8/europe-west4-a/on-demand", "vm/e2-small/us-central1-a", "bucket/us-central1"
    rate_usd_per_hour: float   # TPU and VM: per resource-hour; bucket: per GB-hour
    intervals: list[list[float | None]] = field(default_factory=list)
    gb_seconds: float = 0.0
    last_sample: float | None = None
    last_gb: float = 0.0


class Meter:
    """Resource-seconds per resource and SKU, in wall-clock seconds (the `speed` factor shortens only
    operation latencies, never billed time), with USD from localcloud's own price table. The services say
    when billing begins and ends: a TPU node while READY, a Compute instance from RUNNING (README, "Billing
    meter")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, Metered] = {}

    def begin(self, resource: str, kind: str, sku: str, rate: float, t: float | None = None) -> None:
        """Start (or resume) billing `resource`; idempotent while already running."""
        t = time.time() if t is None else t
        with self._lock:
            item = self._items.get(resource)
            if item is None:
                item = self._items[resource] = Metered(resource, kind, sku, rate)
            if not item.intervals or item.intervals[-1][1] is not None:
                item.intervals.append([t, None])

    def end(self, resource: str, t: float | None = None) -> None:
        """Stop billing `resource`; idempotent."""
        t = time.time() if t is None else t
        with self._lock:
            item = self._items.get(resource)
            if item and item.intervals and item.intervals[-1][1] is None:
                item.intervals[-1][1] = t

    def forgive(self, resource: str) -> None:
        """Charge nothing for `resource`'s time so far: a preemptible/Spot TPU preempted in the first minute
        after its creation is not charged (tpu/docs/preemptible)."""
        with self._lock:
            item = self._items.get(resource)
            if item is not None:
                item.intervals.clear()

    def sample_bucket(self, resource: str, sku: str, rate_per_gb_month: float, gb: float | None,
                      t: float | None = None) -> None:
        """Integrate a bucket's size: call with its current GB, or None once it is deleted."""
        t = time.time() if t is None else t
        with self._lock:
            item = self._items.get(resource)
            if item is None:
                if gb is None:
                    return
                item = self._items[resource] = Metered(resource, "bucket", sku, rate_per_gb_month / 730.0)
                item.intervals.append([t, None])
            if item.last_sample is not None and item.intervals[-1][1] is None:
                item.gb_seconds += item.last_gb * (t - item.last_sample)
            item.last_sample, item.last_gb = t, gb or 0.0
            if gb is None and item.intervals[-1][1] is None:
                item.intervals[-1][1] = t

    def billing(self, kinds: tuple[str, ...] = ("tpu", "vm")) -> bool:
        """Whether any resource of these kinds is being billed now (created and not yet stopped or deleted)."""
        with self._lock:
            return any(i.kind in kinds and i.intervals and i.intervals[-1][1] is None for i in self._items.values())

    def report(self, t: float | None = None) -> dict:
        """JSON-ready: per resource (seconds, usd, running) and per SKU totals."""
        t = time.time() if t is None else t
        resources, skus = [], {}
        with self._lock:
            for item in self._items.values():
                seconds = sum((end if end is not None else t) - start for start, end in item.intervals)
                running = bool(item.intervals) and item.intervals[-1][1] is None
                if item.kind == "bucket":
                    gb_s = item.gb_seconds + (item.last_gb * (t - item.last_sample) if running and item.last_sample else 0)
                    usd = gb_s / 3600.0 * item.rate_usd_per_hour
                    row = {"gb_seconds": gb_s}
                else:
                    usd = seconds / 3600.0 * item.rate_usd_per_hour
                    row = {}
                row.update(resource=item.resource, kind=item.kind, sku=item.sku, seconds=seconds,
                           running=running, usd_per_hour=item.rate_usd_per_hour, usd=usd)
                resources.append(row)
                agg = skus.setdefault(item.sku, {"seconds": 0.0, "usd": 0.0, "resources": 0})
                agg["seconds"] += seconds
                agg["usd"] += usd
                agg["resources"] += 1
        return {"as_of": t, "resources": resources, "skus": skus,
                "total_usd": sum(r["usd"] for r in resources)}

    def dump(self) -> list[dict]:
        with self._lock:
            return [asdict(i) for i in self._items.values()]

    def load(self, rows: list[dict]) -> None:
        with self._lock:
            self._items = {r["resource"]: Metered(**r) for r in rows}


# ----------------------------------------------------------------------------------------------- world

class World:
    """State shared by the services; see the module docstring."""

    def __init__(self, *, speed: float, strict: bool, state_dir: Path | None, workers, storage_host: str = "",
                 python=None):
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.speed = float(speed)
        self.strict = strict
        self.state_dir = state_dir
        self.workers = workers
        self.storage_host = storage_host
        self.python = python  # runtimes.WorkerPython: which interpreter TPU workers run
        self.tokens = None  # tokens.Tokens, set by LocalCloud: guests' service account tokens
        self.lock = threading.RLock()
        self.changed_cv = threading.Condition(self.lock)
        self.actions: dict[str, Callable[..., None]] = {}
        self.scheduler = Scheduler(self.actions, self._action_failed, self._action_done)
        self.faults = Faults()
        self.meter = Meter()
        self.errors: list[str] = []
        self.last_request = time.time()  # wall clock of the latest API request (the daemon's idle stop reads it)
        self._ids = itertools.count(int(time.time() * 1000) % 10**12 * 1000)
        self.services: dict[str, Any] = {}
        # (project, instance metadata, keys from its `ssh-keys`) -> the keys its workers admit; the projects
        # service replaces it so that OS Login, when on, overrides metadata keys.
        self.worker_keys: Callable[[str, dict | None, list[str]], list[str]] = lambda project, metadata, keys: keys

    def next_id(self) -> int:
        return next(self._ids)

    def latency(self, seconds: float) -> float:
        """Real seconds for a simulated latency."""
        return seconds / self.speed

    def later(self, sim_seconds: float, action: str, **args) -> None:
        self.scheduler.at(time.time() + self.latency(sim_seconds), action, **args)

    def changed(self) -> None:
        """Call after every state change, holding the lock: wakes waiters and writes the snapshot."""
        self.changed_cv.notify_all()
        if self.state_dir is not None:
            self.save()

    def _action_done(self) -> None:
        if self.state_dir is not None:
            with self.lock:
                self.save()

    def _action_failed(self, action: str, exc: BaseException) -> None:
        self.errors.append(f"{action}: {type(exc).__name__}: {exc}")

    # persistence ---------------------------------------------------------------------------------------
    def snapshot_path(self) -> Path:
        assert self.state_dir is not None
        return self.state_dir / "state.json"

    def save(self) -> None:
        data = {
            "version": 1,
            "services": {name: svc.dump() for name, svc in self.services.items()},
            "timers": self.scheduler.pending(),
            "meter": self.meter.dump(),
        }
        path = self.snapshot_path()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    def load(self) -> bool:
        """Restore a snapshot if one exists; re-arms pending timers. Returns whether one was loaded."""
        if self.state_dir is None or not self.snapshot_path().exists():
            return False
        data = json.loads(self.snapshot_path().read_text())
        for name, svc in self.services.items():
            svc.load(data["services"].get(name, {}))
        self.meter.load(data.get("meter", []))
        for t in data.get("timers", []):
            self.scheduler.at(t["due"], t["action"], **t["args"])
        return True
