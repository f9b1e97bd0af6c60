"""Apply a Plan: independent steps in parallel threads, zone failover for the TPU, and guaranteed undo.

Whatever this invocation creates is recorded *before* its create request goes out; on failure, cancel or
Ctrl-C those names are deleted (NotFound counts as done) unless the caller keeps them. Adopted resources
(made by an earlier `up`) are never rolled back. What was created and then deleted again (rolled back, or a
zone attempt that ran out of capacity) billed from when it became READY (if it did) to its end; `on_gone`
hears of it as ledger entries, since no label is left to find it by.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from tpuctl.errors import CapacityError, CloudError, Interrupted, NameTaken, TpuctlError, Unexpected, capacity_hint
from tpuctl.ledger import Entry, entry_of
from tpuctl.provision import bucket, preflight, shapes
from tpuctl.provision.clients import Clients
from tpuctl.provision.plan import Plan
from tpuctl.provision.resources import Kind, Resource, State
from tpuctl.provision.waits import DEFAULT_DEADLINE_S, Cancelled

# key, state, detail: callers turn these into tpuctl.events.ResourceChanged (events.resource_progress).
ProgressFn = Callable[[str, str, str], None]


@dataclass(frozen=True)
class Undo:
    """Enough to delete one thing this invocation created."""

    kind: Kind
    name: str
    location: str
    service_account: str | None = None  # IAM: the member to revoke
    shape: shapes.Shape | None = None  # the driver that deletes it; None: a bucket or its IAM binding

    @classmethod
    def of(cls, r: Resource) -> Undo:
        """How to delete an existing resource."""
        return cls(r.kind, r.name, r.location, shape=shapes.of(r))

    @property
    def key(self) -> str:
        return f"{self.kind.value}/{self.location}/{self.name}"


@dataclass(frozen=True)
class ApplyResult:
    run: str
    zone: str  # where the TPU landed
    service_account: str
    resources: tuple[Resource, ...]
    created: tuple[str, ...]  # keys of what this invocation created
    adopted: tuple[str, ...]  # keys of what already existed

    def get(self, kind: Kind) -> Resource | None:
        return next((r for r in self.resources if r.kind is kind), None)


class _Created:
    """Thread-safe record of creates issued by this invocation, in issue order, with when each went out,
    and of those it deleted again (as ledger entries of resources that existed and billed)."""

    def __init__(self, clients: Clients, plan: Plan) -> None:
        self._lock = threading.Lock()
        self._items: list[Undo] = []
        self._issued: dict[Undo, float] = {}
        self._ready: dict[Undo, float] = {}  # when each began billing (tpuctl.cost), once it is READY
        self._gone: list[Entry] = []
        self._project, self._plan = clients.project, plan

    def add(self, undo: Undo) -> None:
        with self._lock:
            if undo not in self._items:
                self._items.append(undo)
                self._issued.setdefault(undo, time.time())

    def ready(self, undo: Undo, r: Resource) -> None:
        """`undo`'s create finished: `r` is READY and billing."""
        with self._lock:
            self._ready[undo] = entry_of(r).billed_from or time.time()

    def forget(self, undo: Undo) -> None:
        """`undo`'s create was refused (NameTaken): nothing to roll back, nothing billed."""
        with self._lock:
            if undo in self._items:
                self._items.remove(undo)

    def retire(self, undo: Undo, *, ended: float) -> None:
        """`undo` is gone (deleted by this invocation, or never became a resource that lasts): drop it from
        what a rollback must delete and remember its lifetime for the cost ledger."""
        with self._lock:
            if undo not in self._items:
                return
            self._items.remove(undo)
            if undo.kind is not Kind.IAM:
                self._gone.append(self._entry(undo, ended))

    def _entry(self, undo: Undo, ended: float) -> Entry:
        plan = self._plan
        vm = next((v for v in plan.vms if plan.vm_name(v) == undo.name), None) if undo.kind is Kind.VM else None
        # A queued resource costs nothing itself; what billed is the node it made, under the same name.
        kind = Kind.TPU if undo.kind is Kind.QUEUED else undo.kind
        return Entry(kind=kind.value, name=undo.name, project=self._project, location=undo.location,
                     run=plan.run, owner=plan.labels.get("tpuctl-owner"), created=self._issued[undo], deleted=ended,
                     accelerator=plan.accelerator.name if undo.kind in (Kind.TPU, Kind.QUEUED) else None,
                     machine_type=vm.machine_type if vm else None, spot=plan.spot and kind is Kind.TPU,
                     disk_gb=int(vm.disk_gb) if vm else 0, rolled_back=True,
                     billed_from=self._ready.get(undo, ended))  # never READY: it billed nothing

    def items(self) -> list[Undo]:
        with self._lock:
            return list(self._items)

    def gone(self) -> list[Entry]:
        with self._lock:
            return list(self._gone)


def _wait_all(futures: list[Future], cancel: threading.Event) -> None:
    """Wait for every future, waking often so Ctrl-C reaches the main thread; the first error cancels the rest."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            cancel.set()
            wait(pending)
            break
    errors = [f.exception() for f in futures if f.done() and f.exception() is not None]
    real = [e for e in errors if not isinstance(e, Cancelled)]
    if real or errors:
        raise (real or errors)[0]


def apply(clients: Clients, plan: Plan, *, progress: ProgressFn | None = None, keep_on_failure: bool = False,
          deadline_s: float = DEFAULT_DEADLINE_S, cancel: threading.Event | None = None,
          on_rollback: Callable[[list[str]], None] | None = None,
          on_gone: Callable[[list[Entry]], None] | None = None) -> ApplyResult:
    """Create everything in `plan` that does not exist yet; block until all of it is READY.

    Idempotent: existing resources with the run's label are adopted. Steps run concurrently (the bucket and
    its IAM binding alongside the TPU and VMs). On any failure (any exception: one that is no TpuctlError is
    raised as `Unexpected`), on `cancel`, or on KeyboardInterrupt, what this call created is deleted (unless
    `keep_on_failure`) and the error is re-raised with the list of what was removed; `on_rollback(keys)` is
    told first. A second KeyboardInterrupt during that cleanup stops it and
    raises Interrupted whose hint is the `tpuctl down RUN` command that finishes the job.
    `on_gone(entries)` is told, on success and on failure, of every resource this call created and deleted
    again (rolled back, or a zone that ran out of capacity), each billed from when it became READY (if it did)
    to its end.
    """
    cancel = cancel or threading.Event()
    created = _Created(clients, plan)
    say = progress or (lambda key, state, detail: None)
    n_threads = 4 + len(plan.vms)
    pool = ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix=f"up-{plan.run}")
    try:
        try:
            result = _run(clients, plan, pool, created, say, cancel, deadline_s)
            pool.shutdown(wait=True)
            return result
        except (Exception, KeyboardInterrupt) as exc:
            # Any exception, not only ours: an unexpected one (a response without a field we need, a client's
            # own error) must not leave what this call created running and billed.
            cancel.set()
            _drain(pool, plan)
            if keep_on_failure:
                raise _annotate(exc, f"kept what was created ({_names(created.items()) or 'nothing'}); "
                                     f"remove it with `tpuctl down {plan.run}`") from exc
            undo = created.items()
            if on_rollback is not None:
                on_rollback([u.key for u in undo])
            rollback(clients, undo, say, plan, created=created)
            raise _annotate(exc, f"removed what this run created: {_names(undo) or 'nothing'}") from exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if on_gone is not None and created.gone():
            on_gone(created.gone())


def _drain(pool: ThreadPoolExecutor, plan: Plan) -> None:
    """Let in-flight create calls return before deleting, so a delete cannot overtake its create."""
    try:
        pool.shutdown(wait=True, cancel_futures=True)
    except KeyboardInterrupt:
        raise _second_interrupt(plan) from None


def _second_interrupt(plan: Plan) -> Interrupted:
    return Interrupted(f"interrupted again: cleanup of run {plan.run} was stopped",
                       hint=f"finish it with `tpuctl down {plan.run} --yes`")


def _annotate(exc: BaseException, suffix: str) -> TpuctlError:
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(f"interrupted; {suffix}")
    if isinstance(exc, Cancelled):
        return Interrupted(f"{exc.message}; {suffix}")
    exc = Unexpected.of(exc)
    return type(exc)(f"{exc.message}; {suffix}", hint=exc.hint, field=exc.field)


def _names(undo: list[Undo]) -> str:
    return ", ".join(u.key for u in undo)


def _run(clients: Clients, plan: Plan, pool: ThreadPoolExecutor, created: _Created, say: ProgressFn,
         cancel: threading.Event, deadline_s: float) -> ApplyResult:
    # Read-only preflight, in parallel: refuse a project that cannot work (APIs, network, service account,
    # permissions, OS Login) or a cross-region bucket before anything is created.
    ready_f = pool.submit(preflight.require, clients, preflight.Target.of_plan(plan))
    sa_f = pool.submit(_service_account, clients, plan)
    existing_f = pool.submit(bucket.lookup, clients, plan.bucket)
    _wait_all([ready_f, sa_f, existing_f], cancel)
    existing = existing_f.result()
    if existing is not None:
        bucket.check_region(existing, plan.region, allow_cross_region=plan.allow_cross_region)
    sa = sa_f.result()
    adopted: list[str] = []

    def bucket_step() -> Resource:
        undo = Undo(Kind.BUCKET, plan.bucket, plan.region)
        r = bucket.ensure(clients, plan.bucket, plan.region, plan.labels, allow_cross_region=plan.allow_cross_region,
                          soft_delete_s=plan.bucket_soft_delete_s, cancel=cancel, progress=lambda s, d: say(undo.key, s.value, d),
                          on_issued=lambda: created.add(undo))
        say(undo.key, State.READY.value, "adopted" if existing is not None else "created")
        if existing is not None:
            adopted.append(undo.key)
        return r

    bucket_f = pool.submit(bucket_step)

    def iam_step() -> Resource:
        bucket_f.result()
        undo = Undo(Kind.IAM, plan.bucket, plan.region, service_account=sa)
        say(undo.key, State.CREATING.value, bucket.ROLE)
        r = bucket.grant(clients, plan.bucket, sa, run=plan.run, region=plan.region, cancel=cancel,
                         on_issued=lambda: created.add(undo))
        say(undo.key, State.READY.value, f"{bucket.ROLE} for {sa}")
        return r

    futures = [bucket_f, pool.submit(iam_step), pool.submit(_tpu_step, clients, plan, sa, created, adopted, say,
                                                             cancel, deadline_s)]
    for spec in plan.vms:
        futures.append(pool.submit(_vm_step, clients, plan, spec, sa, created, adopted, say, cancel, deadline_s))
    _wait_all(futures, cancel)
    resources = tuple(f.result() for f in futures)
    tpu_r = next(r for r in resources if r.kind is Kind.TPU)
    return ApplyResult(run=plan.run, zone=tpu_r.location, service_account=sa, resources=resources,
                       created=tuple(u.key for u in created.items()), adopted=tuple(adopted))


def _service_account(clients: Clients, plan: Plan) -> str:
    return bucket.default_service_account(clients) if plan.service_account == "default" else plan.service_account


def _tpu_step(clients: Clients, plan: Plan, sa: str, created: _Created, adopted: list[str], say: ProgressFn,
              cancel: threading.Event, deadline_s: float) -> Resource:
    """Create the TPU (its shape's driver: a node, a queued resource, a Compute Engine VM or slice) in the first
    zone with capacity; adopt one from an earlier `up`."""
    return _failover(clients, plan, shapes.for_tpu(plan.accelerator, plan.provisioning, plan.slices), plan.run, sa, created,
                     adopted, say, cancel, deadline_s, what=plan.accelerator.name, hint=capacity_hint(plan.provisioning))


def _failover(clients: Clients, plan: Plan, shape: shapes.Shape, name: str, sa: str, created: _Created,
              adopted: list[str], say: ProgressFn, cancel: threading.Event, deadline_s: float, *, what: str,
              hint: str, ready: Callable[[Resource], str] = lambda r: f"{len(r.workers)} worker(s)") -> Resource:
    """Create `name` with `shape`'s driver zone by zone (an existing one's zone first) until one has capacity.

    What the driver issued in a zone without capacity is deleted before the next zone is tried."""
    zones = list(plan.zones)
    for z in zones:
        if shape.exists(clients, z, name):
            zones.remove(z)
            zones.insert(0, z)
            break
    failures: list[str] = []
    for zone in zones:
        undo = Undo(shape.kind, name, zone, shape=shape)
        issued = threading.Event()

        def on_issued(undo: Undo = undo, issued: threading.Event = issued) -> None:
            issued.set()
            created.add(undo)

        try:
            r = shape.create(clients, plan, name, zone, service_account=sa, deadline_s=deadline_s, cancel=cancel,
                             progress=lambda s, d, k=undo.key: say(k, s.value, d), on_issued=on_issued)
        except CapacityError as exc:
            failed_at = time.time()  # what was issued ended with its failed create
            failures.append(f"{zone}: {exc.message}")
            say(undo.key, State.FAILED.value, "no capacity" + (", trying the next zone" if zone != zones[-1] else ""))
            if issued.is_set():
                delete(clients, undo, cancel=cancel)
                created.retire(undo, ended=failed_at)
            continue
        except NameTaken:
            created.forget(undo)  # the name is another's: a rollback must not delete it
            raise
        if not issued.is_set():
            adopted.append(undo.key)
        created.ready(undo, r)
        say(undo.key, State.READY.value, ready(r))
        return r
    raise CapacityError(f"no capacity for {what} in {', '.join(zones)}: " + "; ".join(failures), hint=hint)


def _vm_step(clients: Clients, plan: Plan, spec, sa: str, created: _Created, adopted: list[str], say: ProgressFn,
             cancel: threading.Event, deadline_s: float) -> Resource:
    """Create (or adopt) one VM in the first zone with capacity (ZONE_RESOURCE_POOL_EXHAUSTED fails over)."""
    name = plan.vm_name(spec)
    return _failover(clients, plan, shapes.VM, name, sa, created, adopted, say, cancel, deadline_s,
                     what=f"VM {name} ({spec.machine_type})", ready=lambda r: spec.machine_type,
                     hint="add zones with --zone (comma-separated, same region first) or give the VM another "
                          "machine_type")


def delete(clients: Clients, target: Undo, *, deadline_s: float = 900.0, cancel: threading.Event | None = None,
           progress: Callable[[State, str], None] | None = None) -> None:
    """Delete one resource (an IAM target revokes its binding) and block until it is gone.

    Idempotent: NotFound, before or during, is done. `deadline_s` bounds the wait on each operation."""
    if target.shape is not None:
        target.shape.delete(clients, target.location, target.name, deadline_s=deadline_s, cancel=cancel,
                            progress=progress)
    elif target.kind is Kind.BUCKET:
        bucket.delete(clients, target.name, cancel=cancel, progress=progress)
    elif target.kind is Kind.IAM:
        bucket.revoke(clients, target.name, target.service_account or "", cancel=cancel)


# Compute first, the bucket last: a TPU or VM that is still running may be writing checkpoints, and a bucket
# deleted under it would lose them (or, after a kill -9 mid-teardown, leave compute without its bucket).
# A queued resource's node is never in the same list: the queued resource's force delete takes it along.
_TEARDOWN_ORDER = ((Kind.QUEUED, Kind.TPU, Kind.VM), (Kind.IAM,), (Kind.BUCKET,))


def _delete_in_order(clients: Clients, todo: list[Undo], say: ProgressFn, *, done_detail: str, pool_name: str,
                     deadline_s: float) -> None:
    """Delete `todo`, in parallel within each stage of _TEARDOWN_ORDER; block until done.

    The first failure stops before the next stage (the bucket outlives compute that could not be deleted)
    and is raised. On Ctrl-C the deletes still waiting give up and KeyboardInterrupt is re-raised."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=max(1, len(todo)), thread_name_prefix=pool_name)
    try:
        for kinds in _TEARDOWN_ORDER:
            stage = [u for u in todo if u.kind in kinds]
            futures = [pool.submit(delete, clients, u, deadline_s=deadline_s, cancel=stop,
                                   progress=lambda s, d, k=u.key: say(k, s.value, d)) for u in stage]
            for u, f in zip(stage, futures):
                f.add_done_callback(lambda f, k=u.key: say(k, State.DELETED.value if f.exception() is None
                                                           else State.FAILED.value, done_detail))
            _wait_all(futures, threading.Event())
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=not stop.is_set(), cancel_futures=True)


def rollback(clients: Clients, undo: list[Undo], say: ProgressFn, plan: Plan, *,
             created: _Created | None = None) -> None:
    """Delete `undo` (an IAM binding only when its bucket stays), compute first. Blocks; a second Ctrl-C stops it.
    Each one deleted is retired in `created` at the moment its deletion finished (it billed until then)."""
    buckets = {u.name for u in undo if u.kind is Kind.BUCKET}
    todo = [u for u in undo if not (u.kind is Kind.IAM and u.name in buckets)]
    by_key = {u.key: u for u in undo}

    def noting(key: str, state: str, detail: str) -> None:
        if created is not None and state == State.DELETED.value and key in by_key:
            created.retire(by_key[key], ended=time.time())
        say(key, state, detail)

    try:
        _delete_in_order(clients, todo, noting, done_detail="rolled back", pool_name=f"undo-{plan.run}",
                         deadline_s=900.0)
    except KeyboardInterrupt:
        raise _second_interrupt(plan) from None
    except Exception as exc:  # whatever stopped the cleanup, the user must hear how to finish it
        error = Unexpected.of(exc)
        raise type(error)(f"cleanup of run {plan.run} failed: {error.message}",
                          hint=f"finish it with `tpuctl down {plan.run} --yes`") from exc


@dataclass(frozen=True)
class DownResult:
    run: str
    deleted: tuple[Resource, ...]
    kept: tuple[Resource, ...]  # the bucket, unless delete_bucket


def down(clients: Clients, run: str, found: list[Resource], *, delete_bucket: bool = False,
         progress: ProgressFn | None = None, deadline_s: float = 1800.0, spare: tuple[str, ...] = ()) -> DownResult:
    """Delete `found` (the run's resources) in parallel, compute before the bucket, then verify by listing
    that none remain (but those `spare` names)."""
    from tpuctl.provision import inventory

    say = progress or (lambda key, state, detail: None)
    keep = [r for r in found if r.kind in (Kind.BUCKET, Kind.IAM) and not delete_bucket]
    todo: list[Undo] = []
    for r in found:
        undo = Undo.of(r)
        # One delete per driver and name: a driver deletes all of it (a queued resource's force delete takes
        # its node along, listed as a resource of its own).
        if r not in keep and r.kind is not Kind.IAM and not any(
                undo.shape is not None and (u.shape, u.location, u.name) == (undo.shape, undo.location, undo.name)
                for u in todo):
            todo.append(undo)
    try:
        _delete_in_order(clients, todo, say, done_detail="", pool_name=f"down-{run}", deadline_s=deadline_s)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted: run {run} is partly deleted",
                          hint=f"run `tpuctl down {run} --yes` again to finish") from None
    left = [r for r in inventory.resources(clients, run)
            if not (r.kind is Kind.BUCKET and not delete_bucket) and r.key not in spare]
    if left:
        raise CloudError(f"run {run}: still present after delete: " + ", ".join(r.key for r in left),
                         hint=f"run `tpuctl down {run} --yes` again")
    deleted = tuple(r for r in found if r not in keep)
    return DownResult(run=run, deleted=deleted, kept=tuple(keep))

