"""`tpuctl gc`: find tpuctl-labelled resources that outlived their purpose and delete them.

Three steps, each testable alone:
1. `scan` lists every TPU node, queued resource, Compute instance and bucket of the project that carries
   the tpuctl labels (the provisioning layer's inventory: all TPU locations, Compute's aggregated list),
   and `read_status` reads each run's job status object (`gs://BUCKET/runs/RUN/status.json`, written by
   the jobs layer).
2. `decide` is pure: from resources, job statuses and accrued costs it returns one `Action` per resource it
   would touch, with the reasons. It never selects a resource without the tpuctl labels, nor another owner's
   unless the policy says `all_owners`.
3. `execute` deletes the selected resources in parallel with the provisioning layer's delete functions
   (NotFound counts as done, so two gc runs racing never fail on each other's deletions).

Why a run goes: its TTL (`tpuctl-expires`) passed; its job succeeded, failed or was cancelled; its job
stopped heart-beating for the idle window; its TPU was preempted and nobody is recovering it; its accrued
cost passed the budget (per run or per owner); the supervisor VM of its detached run stopped beating (its
heartbeat in the bucket is stale: nobody watches, recovers or tears it down any more, so gc cleans it up). A run whose status says `recovering` is safe from the
preempted, idle, failed and cancelled rules (the `run` command is bringing it back); TTL and budget are hard
limits and still apply.
Buckets go only with `buckets=True` and only once their *own* TTL passed: they hold the trained model.
"""

from __future__ import annotations

import fcntl
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from tpuctl.catalog import Catalog
from tpuctl.cost import accrued_by_run
from tpuctl.errors import BadInput, TpuctlError
# status.json's record (its one schema, shared with the worker agents), named as gc has always called it.
from tpuctl.jobs.agent.status import CorruptStatus
from tpuctl.jobs.agent.status import RunStatus as JobStatus
from tpuctl.jobs.agent.status import object_name as status_object
from tpuctl.ledger import Entry, Ledger, entry_of, key_of
from tpuctl.provision import labels as L
from tpuctl.provision import list_resources, waits
from tpuctl.provision.apply import Undo, delete
from tpuctl.provision.clients import Clients
from tpuctl.provision.resources import Kind, Resource, State


class Reason(str, Enum):
    EXPIRED = "expired"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    IDLE = "idle"
    PREEMPTED = "preempted"
    OVER_BUDGET = "over-budget"
    ENDED = "ended"  # a flex-start TPU reached its max run duration: Google deletes it, the run is over
    SUPERVISOR_LOST = "supervisor-lost"  # a detached run's supervisor stopped beating (jobs.supervisor_vm)


# Kinds that bill by the hour and go with their run. IAM bindings live and die with the bucket.
COMPUTE_KINDS = (Kind.TPU, Kind.QUEUED, Kind.VM)


@dataclass(frozen=True)
class Policy:
    now: float
    owner: str  # the caller's owner label; others' runs are skipped unless all_owners
    all_owners: bool = False
    idle_s: float | None = None  # no heartbeat for this long -> idle; None disables the rule
    budget_usd: float | None = None
    budget_per: str = "run"  # "run" | "owner"
    buckets: bool = False


@dataclass(frozen=True)
class Action:
    """What gc does (or, under --dry-run, would do) to one resource."""

    verdict: str  # "delete" | "skip"
    resource: Resource
    run: str
    owner: str | None
    reasons: tuple[str, ...]
    why: str  # one human line: the reasons, or why a resource that qualified was skipped

    def record(self) -> dict:
        r = self.resource
        return {"verdict": self.verdict, "kind": r.kind.value, "name": r.name, "location": r.location,
                "project": r.project, "run": self.run, "owner": self.owner, "reasons": list(self.reasons),
                "why": self.why}


def ours(r: Resource) -> bool:
    """Only resources carrying tpuctl's run and owner labels are ever candidates."""
    return L.matches(r.labels) and bool(r.labels.get(L.OWNER))


def _expires(r: Resource) -> float | None:
    try:
        return float(r.labels[L.EXPIRES])
    except (KeyError, ValueError):
        return None


def _ends(r: Resource) -> float | None:
    try:
        return datetime.fromisoformat(r.detail["ends"]).timestamp()
    except (KeyError, ValueError):
        return None


def _created_s(r: Resource) -> float:
    if r.created is not None:
        return r.created.timestamp()
    try:
        return float(r.labels[L.CREATED])
    except (KeyError, ValueError):
        return 0.0


@dataclass
class _Run:
    run: str
    owner: str | None
    resources: list[Resource] = field(default_factory=list)


def group_runs(resources: Iterable[Resource]) -> dict[tuple[str, str | None], _Run]:
    """tpuctl resources by (run, owner): two owners may reuse a run name and stay separate."""
    runs: dict[tuple[str, str | None], _Run] = {}
    for r in resources:
        if not ours(r):
            continue
        key = (r.labels[L.RUN], r.labels.get(L.OWNER))
        runs.setdefault(key, _Run(*key)).resources.append(r)
    return runs


def run_reasons(run: _Run, status: JobStatus | None, accrued_usd: float, owner_usd: float,
                policy: Policy, *, supervisor_lost: bool = False) -> list[Reason]:
    """Why this run's compute should go (empty: it stays)."""
    reasons: list[Reason] = []
    compute = [r for r in run.resources if r.kind in COMPUTE_KINDS]
    if any((e := _expires(r)) is not None and e <= policy.now for r in compute):
        reasons.append(Reason.EXPIRED)
    recovering = status is not None and status.recovering
    # A final state written before this run's newest compute existed belongs to an earlier job under the same
    # run name (`up` again after a finished run): it must not kill the new one.
    newest = max((_created_s(r) for r in compute), default=None)
    current = status is not None and (status.heartbeat is None or newest is None or status.heartbeat >= newest)
    if current and status.state == "succeeded":
        reasons.append(Reason.FINISHED)
    if current and status.state == "failed" and not recovering:
        reasons.append(Reason.FAILED)
    if current and status.state == "cancelled" and not recovering:
        reasons.append(Reason.CANCELLED)
    if (policy.idle_s is not None and status is not None and status.state == "running" and not recovering
            and (status.heartbeat is None or policy.now - status.heartbeat > policy.idle_s)):
        reasons.append(Reason.IDLE)
    if any((e := _ends(r)) is not None and e <= policy.now for r in compute):
        reasons.append(Reason.ENDED)
    if not recovering and any(r.state == State.PREEMPTED for r in compute):
        reasons.append(Reason.PREEMPTED)
    if supervisor_lost:
        reasons.append(Reason.SUPERVISOR_LOST)
    if policy.budget_usd is not None:
        spent = owner_usd if policy.budget_per == "owner" else accrued_usd
        if spent > policy.budget_usd:
            reasons.append(Reason.OVER_BUDGET)
    return reasons


def decide(resources: Iterable[Resource], statuses: Mapping[str, JobStatus | None],
           accrued: Mapping[str, float], policy: Policy, *, lost_supervisors: frozenset[str] = frozenset()) -> list[Action]:
    """The actions gc takes; pure. `statuses` and `accrued` are keyed by run name; `lost_supervisors` names the
    runs whose supervisor stopped beating.

    Resources without the tpuctl labels never appear in the result. Another owner's resources appear as
    "skip" (only when a rule selected them) unless `policy.all_owners`.
    """
    runs = group_runs(resources)
    owner_usd: dict[str | None, float] = {}
    for (name, owner) in runs:
        owner_usd[owner] = owner_usd.get(owner, 0.0) + accrued.get(name, 0.0)
    actions: list[Action] = []
    for (name, owner), run in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        reasons = run_reasons(run, statuses.get(name), accrued.get(name, 0.0), owner_usd.get(owner, 0.0), policy,
                              supervisor_lost=name in lost_supervisors)
        foreign = owner != policy.owner and not policy.all_owners
        for r in run.resources:
            why_list = [x.value for x in reasons] if r.kind in COMPUTE_KINDS else []
            if r.kind == Kind.BUCKET and policy.buckets and (e := _expires(r)) is not None and e <= policy.now:
                why_list = [Reason.EXPIRED.value]
            if not why_list:
                continue
            if foreign:
                actions.append(Action("skip", r, name, owner, tuple(why_list),
                                      f"owned by {owner} (would go: {', '.join(why_list)}); pass --all-owners"))
            else:
                actions.append(Action("delete", r, name, owner, tuple(why_list), ", ".join(why_list)))
    return actions


# -- reading the cloud ----------------------------------------------------------------------------------------


def scan(clients: Clients) -> list[Resource]:
    """Every resource of the project that carries tpuctl's run and owner labels, in every location.

    The provisioning layer's inventory lists TPU nodes and queued resources in all locations (`locations/-`),
    VMs with Compute's aggregated list and the project's buckets, concurrently. Blocks for the listings.
    """
    return [r for r in list_resources(clients) if ours(r)]


def read_status(clients: Clients, bucket_name: str, run: str) -> JobStatus | None:
    """The run's job status record, or None when there is none (no job yet, or no bucket) or the object is no
    status record: a foreign or corrupt file decides nothing (and one run's must not stop gc for the others)."""
    name = status_object(run)
    raw = waits.get_or_none(clients.storage.bucket(bucket_name).blob(name).download_as_bytes,
                            what=f"read gs://{bucket_name}/{name}")
    try:
        return None if raw is None else JobStatus.from_json(raw)
    except CorruptStatus:
        return None


def statuses(clients: Clients, resources: Iterable[Resource]) -> dict[str, JobStatus | None]:
    """Each run's status, from the run's labelled bucket, else the bucket `up` names for it by default."""
    buckets = {r.labels[L.RUN]: r.name for r in resources if r.kind == Kind.BUCKET and ours(r)}
    out: dict[str, JobStatus | None] = {}
    for run in sorted({r.labels[L.RUN] for r in resources if ours(r)}):
        name = buckets.get(run) or L.auto_bucket(clients.project, run)
        out[run] = read_status(clients, name, run)
    return out


def lost_supervisors(clients: Clients, resources: Iterable[Resource], *, now: float) -> frozenset[str]:
    """The runs with compute whose supervisor's heartbeat (in the run's bucket) went stale."""
    from tpuctl.jobs import supervisor_vm

    resources = list(resources)
    buckets = {r.labels[L.RUN]: r.name for r in resources if r.kind == Kind.BUCKET and ours(r)}
    runs = sorted({r.labels[L.RUN] for r in resources if ours(r) and r.kind in COMPUTE_KINDS})
    return frozenset(run for run in runs
                     if supervisor_vm.stale(clients, buckets.get(run) or L.auto_bucket(clients.project, run), run,
                                            now=now))


def ledger_entries(clients: Clients, resources: Iterable[Resource], ledger: Ledger, *, now: float) -> list[Entry]:
    """Remember what the scan saw, close what it no longer sees, and return every entry (live and gone)."""
    live = [entry_of(r, now=now) for r in resources]
    ledger.record(live)
    ledger.reconcile([e.key for e in live], [clients.project], at=now)
    return [e for e in ledger.entries() if e.project == clients.project]


def cost_entries(clients: Clients, *, now: float, ledger: Ledger | None = None) -> list[Entry]:
    """What `tpuctl cost` reports on: a fresh scan merged into the ledger."""
    return ledger_entries(clients, scan(clients), ledger or Ledger(), now=now)


# -- acting ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    action: Action
    ok: bool
    dry_run: bool
    error: str | None = None
    seconds: float = 0.0
    # When its deletion began (unix seconds; None: none was tried): an unwatched run's timeline ends with it.
    started: float | None = None

    def record(self) -> dict:
        rec = self.action.record()
        status = "skipped" if self.action.verdict == "skip" else "would-delete" if self.dry_run else (
            "deleted" if self.ok else "failed")
        rec.update(status=status, error=self.error, seconds=round(self.seconds, 2))
        return rec


# Queued resources first (their force delete takes the node with it), then nodes and VMs, buckets last:
# a bucket must outlive the compute that may still write checkpoints to it.
_PHASES = ((Kind.QUEUED,), (Kind.TPU, Kind.VM), (Kind.BUCKET,))


def execute(clients: Clients, actions: Iterable[Action], *, dry_run: bool, ledger: Ledger | None = None,
            on_outcome: Callable[[Outcome], None] | None = None, parallel: int = 8, deadline_s: float = 900.0,
            cancel: threading.Event | None = None) -> list[Outcome]:
    """Carry out `actions`: deletions in parallel within each phase; skips and dry runs only report.

    A failed deletion (or one not finished within `deadline_s`) does not stop the others; its Outcome
    carries the reason. Deleted resources are closed in the ledger. Blocks until every deletion finished,
    failed or timed out.
    """
    actions = list(actions)
    outcomes: list[Outcome] = []

    def report(o: Outcome) -> None:
        outcomes.append(o)
        if on_outcome:
            on_outcome(o)

    for a in actions:
        if a.verdict != "delete" or dry_run:
            report(Outcome(a, ok=True, dry_run=dry_run))

    def one(a: Action) -> Outcome:
        started, t0 = time.time(), time.monotonic()
        try:
            r = a.resource
            delete(clients, Undo.of(r), deadline_s=deadline_s, cancel=cancel)
        except TpuctlError as exc:
            return Outcome(a, ok=False, dry_run=False, error=str(exc), seconds=time.monotonic() - t0, started=started)
        if ledger is not None:
            ledger.mark_deleted([key_of(a.resource)])
        return Outcome(a, ok=True, dry_run=False, seconds=time.monotonic() - t0, started=started)

    if dry_run:
        return outcomes
    todo = [a for a in actions if a.verdict == "delete"]
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for kinds in _PHASES:
            for o in pool.map(one, [a for a in todo if a.resource.kind in kinds]):
                report(o)
    return outcomes


# -- one gc run -----------------------------------------------------------------------------------------------


@contextmanager
def exclusive(path: Path, *, wait_s: float = 0.0) -> Iterator[bool]:
    """Hold the gc lock (fcntl, released by the kernel if the process dies). Yields False when another gc
    holds it for longer than `wait_s`: the caller skips this run rather than overlapping."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        deadline = time.monotonic() + wait_s
        delay = 0.05
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class GcResult:
    outcomes: tuple[Outcome, ...]
    scanned: int  # tpuctl resources seen
    locked_out: bool = False  # another gc held the lock; nothing was done

    @property
    def failed(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if not o.ok)


def collect(clients: Clients, policy: Policy, *, catalog: Catalog, ledger: Ledger) -> tuple[list[Resource], list[Action]]:
    """Scan, read statuses, compute accrued costs (only when a budget needs them) and decide; no deletion."""
    resources = scan(clients)
    entries = ledger_entries(clients, resources, ledger, now=policy.now)
    accrued = accrued_by_run(entries, catalog, now=policy.now) if policy.budget_usd is not None else {}
    return resources, decide(resources, statuses(clients, resources), accrued, policy,
                             lost_supervisors=lost_supervisors(clients, resources, now=policy.now))


def run(clients: Clients, policy: Policy, *, dry_run: bool, catalog: Catalog, ledger: Ledger, lock: Path,
        lock_wait_s: float = 0.0, on_outcome: Callable[[Outcome], None] | None = None, deadline_s: float = 900.0,
        cancel: threading.Event | None = None,
        confirm: Callable[[list[Action]], None] | None = None) -> GcResult:
    """One complete gc pass under the lock: scan, decide, delete (or only report with `dry_run`).

    `confirm(deletions)` sees what is about to go, before anything is deleted and only when something is;
    it raises to stop the pass (the CLI asks the user there)."""
    with exclusive(lock, wait_s=lock_wait_s) as held:
        if not held:
            return GcResult(outcomes=(), scanned=0, locked_out=True)
        resources, actions = collect(clients, policy, catalog=catalog, ledger=ledger)
        going = [a for a in actions if a.verdict == "delete"]
        if confirm is not None and going and not dry_run:
            confirm(going)
        outcomes = execute(clients, actions, dry_run=dry_run, ledger=ledger, on_outcome=on_outcome,
                           deadline_s=deadline_s, cancel=cancel)
        return GcResult(outcomes=tuple(outcomes), scanned=len(resources))


# -- running it on a schedule ---------------------------------------------------------------------------------

CRON_MARK = "# tpuctl-gc"


@dataclass(frozen=True)
class Schedule:
    crontab_line: str
    service_unit: str
    timer_unit: str


def _calendar(every_s: float) -> tuple[str, str]:
    """(cron fields, systemd OnCalendar) for every N minutes (1-59) or every N hours (1-24)."""
    minutes = int(every_s // 60)
    if every_s == minutes * 60 and 1 <= minutes <= 59:
        return f"*/{minutes} * * * *", f"*:0/{minutes}"
    hours = int(every_s // 3600)
    if every_s == hours * 3600 and 1 <= hours <= 24:
        return f"0 */{hours} * * *" if hours < 24 else "0 0 * * *", f"0/{hours}:00" if hours < 24 else "daily"
    raise BadInput(f"every {every_s:g} s cannot be scheduled", field="every",
                   hint="use whole minutes from 1m to 59m, or whole hours from 1h to 24h (e.g. --every 10m)")


def schedule(argv: list[str], *, every_s: float, log: Path, env: Mapping[str, str]) -> Schedule:
    """A crontab line and a systemd service+timer that run `argv` (a full `tpuctl gc ...` command line)
    every `every_s` seconds. `env` pins what the command needs (project, TPUCTL_HOME) since neither cron nor
    systemd runs the user's shell profile."""
    cron_when, calendar = _calendar(every_s)
    cmd = shlex.join(argv)
    env_prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    cron = f"{cron_when} {env_prefix + ' ' if env_prefix else ''}{cmd} >> {shlex.quote(str(log))} 2>&1 {CRON_MARK}"
    env_lines = "".join(f"Environment={k}={v}\n" for k, v in sorted(env.items()))
    service = (
        "[Unit]\nDescription=tpuctl gc: delete expired, finished, idle, preempted or over-budget TPU runs\n"
        "After=network-online.target\nWants=network-online.target\n\n"
        f"[Service]\nType=oneshot\n{env_lines}Environment=NO_COLOR=1\nExecStart={cmd}\n"
        # A hung API call must not block the next timer tick forever.
        "TimeoutStartSec=1800\n")
    timer = (
        "[Unit]\nDescription=Run tpuctl gc periodically\n\n"
        f"[Timer]\nOnCalendar={calendar}\nPersistent=true\nRandomizedDelaySec=30\n\n"
        "[Install]\nWantedBy=timers.target\n")
    return Schedule(crontab_line=cron, service_unit=service, timer_unit=timer)


def merge_crontab(existing: str, line: str) -> str:
    """The user's crontab with our line replacing any previous tpuctl-gc line (idempotent)."""
    kept = [ln for ln in existing.splitlines() if not ln.rstrip().endswith(CRON_MARK)]
    return "\n".join([*kept, line]) + "\n"
