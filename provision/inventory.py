"""What exists, found by label: every tpuctl resource of a project, grouped into runs.

Labels are the truth; nothing here reads the local ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from tpuctl.provision import bucket, shapes, tpu, vm
from tpuctl.provision import labels as L
from tpuctl.provision.clients import Clients
from tpuctl.provision.resources import Kind, Resource, State

# Worst first: the state a run shows is the worst of its billable resources.
_SEVERITY = (State.FAILED, State.PREEMPTED, State.UNKNOWN, State.REPAIRING, State.DELETING, State.STOPPING,
             State.PENDING, State.CREATING, State.STOPPED, State.READY, State.DELETED)
_BILLABLE = (Kind.TPU, Kind.QUEUED, Kind.VM)
BUCKET_KEPT = "bucket kept"


@dataclass(frozen=True)
class RunStatus:
    run: str
    owner: str | None
    created: float | None  # unix seconds (tpuctl-created label)
    expires: float | None  # unix seconds (tpuctl-expires label)
    zone: str | None
    state: State
    resources: tuple[Resource, ...]
    price_per_hour: float
    accrued: float  # USD since the run's resources were created, estimated

    @property
    def age_s(self) -> float | None:
        return None if self.created is None else max(0.0, time.time() - self.created)

    @property
    def workers(self) -> int:
        return sum(len(r.workers) for r in self.resources if r.kind is Kind.TPU)

    @property
    def bucket_kept(self) -> bool:
        """Only the bucket (checkpoints, data, logs) is left: the TPU and VMs are gone. `expires` is then the
        bucket's TTL label, after which `tpuctl gc --buckets` may delete it."""
        return (not any(r.kind in _BILLABLE for r in self.resources)
                and any(r.kind is Kind.BUCKET for r in self.resources))

    @property
    def state_text(self) -> str:
        """The run's state as shown: `bucket kept` rather than the bucket's own `ready` when nothing else is left."""
        return BUCKET_KEPT if self.bucket_kept else self.state.value

    def to_json(self) -> dict:
        return {"run": self.run, "owner": self.owner, "created": self.created, "expires": self.expires,
                "zone": self.zone, "state": self.state_text, "age_s": self.age_s, "workers": self.workers,
                "price_per_hour": round(self.price_per_hour, 4), "accrued_usd": round(self.accrued, 4),
                "resources": [resource_json(r) for r in self.resources]}


def resource_json(r: Resource) -> dict:
    return {"kind": r.kind.value, "name": r.name, "location": r.location, "state": r.state.value,
            "labels": dict(r.labels), "created": r.created.isoformat() if r.created else None, "run": r.run,
            "accelerator": r.accelerator, "machine_type": r.machine_type, "spot": r.spot,
            "workers": [{"index": w.index, "ip": w.ip, "port": w.port} for w in r.workers], "detail": dict(r.detail)}


def resources(clients: Clients, run: str | None = None, *, include_iam: bool = False) -> list[Resource]:
    """Every tpuctl-labelled resource (of `run` when given): what each shape driver finds in one listing of TPU
    nodes, queued resources and instances, and the buckets.

    Lists the four concurrently; with `include_iam`, also the run's bindings on its buckets.
    Blocks for the API calls; retries 429/503.
    """
    with ThreadPoolExecutor(max_workers=4) as pool:
        nodes = pool.submit(tpu.list_nodes, clients)
        queued = pool.submit(tpu.list_queued, clients)
        vms = pool.submit(vm.list_all, clients, run)
        buckets = pool.submit(bucket.list_labelled, clients, run)
        listing = shapes.Listing(nodes=nodes.result(), queued=queued.result(), instances=vms.result(), run=run)
        out = [r for driver in shapes.DRIVERS for r in driver.listed(clients, listing)]
        out += [bucket.to_resource(b, project=clients.project) for b in buckets.result()]
    if include_iam:
        for b in [r for r in out if r.kind is Kind.BUCKET]:
            out += [bucket.iam_resource(clients.project, b.name, m.removeprefix("serviceAccount:"), run=b.run,
                                        region=b.location)
                    for role, m in bucket.bindings(clients, b.name)
                    if role in (bucket.ROLE, *bucket.FORMER_ROLES) and m.startswith("serviceAccount:")]
    return out


def runs(found: Iterable[Resource], *, price: Callable[[Resource], float] | None = None,
         now: float | None = None) -> list[RunStatus]:
    """Group resources into runs (newest first), with a state, a zone and an accrued-cost estimate."""
    now = time.time() if now is None else now
    by_run: dict[str, list[Resource]] = {}
    for r in found:
        if r.run:
            by_run.setdefault(r.run, []).append(r)
    out = []
    for run, rs in by_run.items():
        billable = [r for r in rs if r.kind in _BILLABLE] or rs
        created = _label_float(rs, L.CREATED)
        per_hour = sum(price(r) for r in rs) if price else 0.0
        accrued = sum(price(r) * max(0.0, _end(r, now) - _start(r, created, now)) / 3600 for r in rs
                      if r.kind in _BILLABLE and r.state not in _NOT_BILLING) if price else 0.0
        tpus = [r for r in rs if r.kind is Kind.TPU] or [r for r in rs if r.kind is Kind.QUEUED]
        out.append(RunStatus(
            run=run, owner=next((r.labels.get(L.OWNER) for r in rs if r.labels.get(L.OWNER)), None),
            created=created, expires=_label_float(rs, L.EXPIRES),
            zone=tpus[0].location if tpus else None,
            state=worst(r.state for r in billable),
            resources=tuple(sorted(rs, key=lambda r: (list(Kind).index(r.kind), r.name))),
            price_per_hour=per_hour, accrued=accrued))
    return sorted(out, key=lambda s: -(s.created or 0))


def worst(states: Iterable[State]) -> State:
    """The state to show for several resources (a run, or a slice's hosts): the worst of them."""
    return min(states, key=_SEVERITY.index)


def _label_float(rs: Sequence[Resource], key: str) -> float | None:
    values = [float(r.labels[key]) for r in rs if r.labels.get(key, "").isdigit()]
    return min(values) if values else None


def _end(r: Resource, now: float) -> float:
    """Now, or earlier when the provider ends the resource by itself (a flex-start TPU's max run duration)."""
    try:
        return min(now, datetime.fromisoformat(r.detail["ends"]).timestamp())
    except (KeyError, ValueError):
        return now


# Not billing now (tpuctl.cost: a TPU bills while READY, an instance while RUNNING).
_NOT_BILLING = (State.STOPPED, State.PREEMPTED, State.PENDING, State.CREATING)


def _start(r: Resource, run_created: float | None, now: float) -> float:
    """When `r` began billing: when it was seen READY or Compute says it started, else its creation."""
    try:
        return datetime.fromisoformat(r.detail["ready"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        pass
    if r.created is not None:
        return r.created.astimezone(timezone.utc).timestamp() if r.created.tzinfo else r.created.replace(
            tzinfo=timezone.utc).timestamp()
    return run_created if run_created is not None else now


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"


def utc(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
