"""What a run will cost before it starts, what it has cost so far, and the report behind `tpuctl cost`.

All figures come from catalog prices times the wall-clock time each resource billed, as Google documents it:

- A Cloud TPU API node bills while it is READY: "Charges for Cloud TPU accrue while your TPU node is in a READY
  state" (https://cloud.google.com/tpu/pricing). Not while CREATING, so a create that stocked out, or was
  rolled back before the node became READY, costs nothing. A preemptible or Spot node "preempted in the first
  minute after you create them" costs nothing (https://cloud.google.com/tpu/docs/preemptible).
- A queued resource itself costs nothing: while WAITING_FOR_RESOURCES nothing is allocated to the project, and
  once "the requested resource becomes available, it's assigned to your Google Cloud project"
  (https://cloud.google.com/tpu/docs/queued-resources); the node it makes bills as above, from READY.
- A Compute Engine instance (a VM, or a TPU7x VM) bills its uptime: "the number of seconds between when you
  start an instance and when you stop an instance, the latter being when the instance state is TERMINATED"
  (https://cloud.google.com/compute/vm-instance-pricing), i.e. from RUNNING, never while PENDING,
  PROVISIONING or STAGING. Its boot disk is counted with it.

When each resource became READY or RUNNING comes from the API where it says so, else from what tpuctl watched
(`tpuctl.ledger.entry_of`): Compute's `lastStartTimestamp` and `lastStopTimestamp`; for a TPU node, whose API
publishes only `createTime` (tpu v2 and v2alpha1 discovery documents: no READY time, no preemption time, and a
queued resource no state history; an operation has `endTime`), the `endTime` of the create operation tpuctl
waited on, else the moment its own wait saw it turn READY (a queued resource's node, made by Google: up to a
poll interval late). A node tpuctl did not watch (adopted, or first seen by a later `cost`/`gc` already READY)
is assumed to have billed from its `createTime`: this overcounts its minutes in CREATING, never undercounts. A
node seen PREEMPTED or STOPPED is assumed to have stopped billing when tpuctl first saw it so; one started
again after a stop is counted across the gap. A node bills until tpuctl saw its deletion done (Google's
DELETING minutes are counted with it). One deleted while tpuctl did not watch (a detached run's supervisor tore it
down while the laptop slept) bills until its run's timeline says its teardown was over, else until the scan that
found it gone (`tpuctl.api.cost_entries`). Compute's one-minute minimum is not applied.

A bucket's accrued cost is left out of running totals because it depends on bytes stored, not on time alive;
the estimate includes it from a size the caller gives. The soft-deleted bytes a deleted bucket leaves behind
are counted: they bill at the storage rate until their hard delete time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from tpuctl import spec as spec_mod
from tpuctl.catalog import Catalog, region_of
from tpuctl.errors import BadInput
from tpuctl.ledger import SOFT_DELETED, Entry

HOURS_PER_MONTH = 730.0  # Google's billing convention for per-month prices
GROUPINGS = ("run", "owner", "type")



def parse_duration(text: str, *, field: str = "duration") -> float:
    """"90m", "2h", "1h30m", "7d", "3600" -> seconds (the spec's grammar); BadInput naming `field` otherwise."""
    try:
        return spec_mod.parse_duration(text)
    except ValueError as exc:
        raise BadInput(str(exc), field=field, hint="write it like 90m, 2h, 1h30m, 7d or 3600 (seconds)") from exc


# -- prices of one resource ---------------------------------------------------------------------------------


def hourly(e: Entry, catalog: Catalog) -> float:
    """USD per hour the resource bills while it exists."""
    if e.kind == "tpu" and e.accelerator:
        return catalog.tpu_price_per_hour(e.accelerator, e.location, e.spot)
    if e.kind == "vm" and e.machine_type:
        disk = e.disk_gb * catalog.disk_price_per_gb_month() / HOURS_PER_MONTH
        return catalog.vm_price_per_hour(e.machine_type, e.location) + disk
    if e.kind == SOFT_DELETED:
        return e.gb * catalog.storage_price_per_gb_month(e.location) / HOURS_PER_MONTH
    return 0.0


# tpu/docs/preemptible: a preemptible (or Spot) TPU preempted in the first minute after its creation is free.
PREEMPTED_FREE_S = 60.0


def lifetime_hours(e: Entry, *, since: float, now: float) -> float:
    """Hours the resource billed inside the window [since, now] (the module docstring says when it bills)."""
    end = now if e.deleted is None else min(e.deleted, now)
    if e.ends is not None:  # a flex-start TPU is deleted by Google at its end, whenever we noticed
        end = min(end, e.ends)
    if e.billed_until is not None:
        end = min(end, e.billed_until)
        # A TPU API node (Compute's TPU VMs have a machine type) that stopped billing while alive was
        # preempted: Spot and preemptible nodes cannot be stopped.
        if e.kind == "tpu" and e.spot and e.machine_type is None and e.billed_until - e.created <= PREEMPTED_FREE_S:
            return 0.0
    start = e.created if e.billed_from is None else e.billed_from
    return max(0.0, end - max(start, since)) / 3600.0


def accrued(e: Entry, catalog: Catalog, *, now: float, since: float = 0.0) -> float:
    """USD the resource has cost while it billed, from `since` to `now`."""
    return hourly(e, catalog) * lifetime_hours(e, since=since, now=now)


def accrued_by_run(entries: Iterable[Entry], catalog: Catalog, *, now: float, since: float = 0.0) -> dict[str, float]:
    """USD per run over each resource's lifetime from `since` (default: all of it; what `status`/`list` show,
    and budgets check)."""
    out: dict[str, float] = {}
    for e in entries:
        if e.run:
            out[e.run] = out.get(e.run, 0.0) + accrued(e, catalog, now=now, since=since)
    return out


# -- estimate before spending -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineItem:
    what: str  # "tpu v3-8 (spot) in europe-west4-a", "vm driver e2-standard-2 + 20 GB disk", ...
    usd_per_hour: float


@dataclass(frozen=True)
class Estimate:
    items: tuple[LineItem, ...]
    usd_per_hour: float
    hours: float | None  # set when the spec bounds the run
    bound: str | None  # what bounds it: "ttl 2h", "2000 steps x 0.5 s"
    total_usd: float | None
    prices_from: str

    def to_json(self) -> dict[str, Any]:
        return {"usd_per_hour": round(self.usd_per_hour, 4), "hours": self.hours, "bound": self.bound,
                "total_usd": None if self.total_usd is None else round(self.total_usd, 2),
                "items": [{"what": i.what, "usd_per_hour": round(i.usd_per_hour, 4)} for i in self.items],
                "prices_from": self.prices_from}


@dataclass(frozen=True)
class VmPlan:
    name: str
    machine_type: str
    disk_gb: int = 0


def estimate(catalog: Catalog, *, accelerator: str, zone: str, spot: bool, vms: Sequence[VmPlan] = (),
             bucket_gb: float = 0.0, hours: float | None = None, bound: str | None = None,
             slices: int = 1) -> Estimate:
    """$/hour of a plan and, when `hours` bounds it, the total (`slices` of the TPU: a multislice). Pure: no
    API calls."""
    kind = " (spot)" if spot else ""
    many = f"{slices} x " if slices > 1 else ""
    items = [LineItem(f"tpu {many}{accelerator}{kind} in {zone}",
                      slices * catalog.tpu_price_per_hour(accelerator, zone, spot))]
    for vm in vms:
        e = Entry(kind="vm", name=vm.name, project="", location=zone, run=None, owner=None, created=0.0,
                  machine_type=vm.machine_type, disk_gb=vm.disk_gb)
        disk = f" + {vm.disk_gb} GB disk" if vm.disk_gb else ""
        items.append(LineItem(f"vm {vm.name} {vm.machine_type}{disk}", hourly(e, catalog)))
    if bucket_gb:
        per_hour = bucket_gb * catalog.storage_price_per_gb_month(region_of(zone)) / HOURS_PER_MONTH
        items.append(LineItem(f"bucket ~{bucket_gb:g} GB", per_hour))
    per_hour = sum(i.usd_per_hour for i in items)
    return Estimate(items=tuple(items), usd_per_hour=per_hour, hours=hours, bound=bound,
                    total_usd=None if hours is None else per_hour * hours, prices_from=catalog.prices_from)


def run_bound(*, steps: int | None = None, step_seconds: float | None = None,
              ttl: str | None = None, max_run_duration: str | None = None) -> tuple[float | None, str | None]:
    """Hours a run can last and why: steps x expected step time when both are known, the TTL, and a flex-start
    TPU's max run duration (Google deletes it then).

    The smallest bound wins: the TTL deletes the run even if the steps are not done, and so does Google at a
    flex-start TPU's end.
    """
    bounds: list[tuple[float, str]] = []
    if steps and step_seconds:
        bounds.append((steps * step_seconds / 3600.0, f"{steps} steps x {step_seconds:g} s"))
    if ttl:
        bounds.append((parse_duration(ttl, field="ttl") / 3600.0, f"ttl {ttl}"))
    if max_run_duration:
        bounds.append((parse_duration(max_run_duration, field="max_run_duration") / 3600.0,
                       f"flex-start max run duration {max_run_duration}"))
    if not bounds:
        return None, None
    return min(bounds)


def estimate_spec(spec: Any, catalog: Catalog, *, step_seconds: float | None = None,
                  bucket_gb: float = 0.0) -> Estimate:
    """The estimate for a `tpuctl.spec.RunSpec` in its first zone; `step_seconds` is the caller's expected
    time per training step (the job config's `steps`/`train_steps` give the count)."""
    zones = getattr(spec, "zones", None) or [spec.zone]
    zone = zones[0] if isinstance(zones, (list, tuple)) else zones
    job = getattr(spec, "job", None)
    config = dict(getattr(job, "config", None) or {})
    steps = config.get("steps") or config.get("train_steps")
    hours, bound = run_bound(steps=int(steps) if steps else None, step_seconds=step_seconds,
                             ttl=getattr(spec, "ttl", None), max_run_duration=getattr(spec, "max_run_duration", None))
    vms = [VmPlan(v.name, v.machine_type, int(getattr(v, "disk_gb", 0) or 0)) for v in (spec.vms or ())]
    return estimate(catalog, accelerator=spec.accelerator, zone=zone,
                    spot=spec.provisioning in ("spot", "preemptible"), vms=vms, bucket_gb=bucket_gb,
                    hours=hours, bound=bound, slices=getattr(spec, "slices", 1))


# -- the report behind `tpuctl cost` ------------------------------------------------------------------------


@dataclass(frozen=True)
class CostRow:
    key: str  # a run name, an owner, or a type ("v3-8", "e2-standard-2")
    resources: int
    live: int
    hours: float  # resource-hours inside the window
    usd: float
    usd_per_hour_now: float  # what the live ones bill per hour right now
    rolled_back: int = 0  # of `resources`: created and deleted again by a failed or interrupted `up`
    rolled_back_usd: float = 0.0  # of `usd`: what those billed (nothing if they never became READY/RUNNING)


@dataclass(frozen=True)
class CostReport:
    by: str
    since: float
    until: float
    rows: tuple[CostRow, ...]
    total_usd: float
    usd_per_hour_now: float
    prices_from: str

    def to_json(self) -> dict[str, Any]:
        return {"by": self.by, "since": self.since, "until": self.until, "total_usd": round(self.total_usd, 4),
                "usd_per_hour_now": round(self.usd_per_hour_now, 4), "prices_from": self.prices_from,
                "rows": [{"key": r.key, "resources": r.resources, "live": r.live, "hours": round(r.hours, 4),
                          "usd": round(r.usd, 4), "usd_per_hour_now": round(r.usd_per_hour_now, 4),
                          "rolled_back": r.rolled_back, "rolled_back_usd": round(r.rolled_back_usd, 4)}
                         for r in self.rows]}


def _group_key(e: Entry, by: str) -> str:
    if by == "run":
        return e.run or "(no run)"
    if by == "owner":
        return e.owner or "(no owner)"
    return e.accelerator or e.machine_type or e.kind


def report(entries: Iterable[Entry], catalog: Catalog, *, since: float, now: float, by: str = "run") -> CostReport:
    """Cost per run/owner/type of every resource alive at some point in [since, now], dearest first.
    Rolled-back resources count like any other (what they billed before their deletion; nothing if they never
    became READY/RUNNING) and are also counted apart."""
    if by not in GROUPINGS:
        raise BadInput(f"cannot group by {by!r}", field="by", hint=f"use one of: {', '.join(GROUPINGS)}")
    acc: dict[str, list[float]] = {}
    for e in entries:
        if e.created > now or (e.deleted is not None and e.deleted < since):
            continue
        per_hour = hourly(e, catalog)
        hours = lifetime_hours(e, since=since, now=now)
        live = e.deleted is None or e.deleted > now  # soft-deleted bytes bill until a known future time
        row = acc.setdefault(_group_key(e, by), [0, 0, 0.0, 0.0, 0.0, 0, 0.0])
        row[0] += 1
        row[1] += live
        row[2] += hours
        row[3] += per_hour * hours
        billing = live and (e.billed_until is None or e.billed_until > now)  # not PREEMPTED, not CREATING
        row[4] += per_hour if billing else 0.0
        row[5] += e.rolled_back
        row[6] += per_hour * hours if e.rolled_back else 0.0
    rows = tuple(sorted((CostRow(k, int(v[0]), int(v[1]), v[2], v[3], v[4], int(v[5]), v[6])
                         for k, v in acc.items()),
                        key=lambda r: (-r.usd, r.key)))
    return CostReport(by=by, since=since, until=now, rows=rows, total_usd=sum(r.usd for r in rows),
                      usd_per_hour_now=sum(r.usd_per_hour_now for r in rows), prices_from=catalog.prices_from)
