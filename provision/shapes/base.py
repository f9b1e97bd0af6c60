"""The contract every shape driver keeps, and the recovery answers a driver gives.

A *shape* is one way Google sells the machines of a run: a Cloud TPU API node, a queued resource, a Compute
Engine TPU VM, a managed-instance-group slice of them, a plain VM. Each has one driver (a `Shape` subclass,
one module in this package) that knows its API calls, its resource names and how it fails; everything above
(`apply`, `inventory`, `down`, `gc`, `status`, the jobs layer's node calls, the run's recovery) asks the driver
that `tpuctl.provision.shapes` picks (`for_tpu` from the catalog's `api` and the provisioning model, `of` for
a resource seen in the cloud, `find` for a TPU known by zone and name) and never branches on the shape itself.

Written in the spirit of SkyPilot's `sky/provision/gcp/instance_utils.py` (one handler class per GCP resource
type) and dstack's `Compute` (one abstract class with the calls every backend answers). Raw protos stay in the
API modules (`provision/tpu.py`, `compute_tpu.py`, `vm.py`) that the drivers wrap.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, ClassVar, Union

from tpuctl.errors import BadInput
from tpuctl.errors import NotFound as _NotFound
from tpuctl.provision.resources import Kind, Resource, State, Step, Worker

if TYPE_CHECKING:
    from tpuctl.catalog import AcceleratorType, Catalog
    from tpuctl.provision.clients import Clients
    from tpuctl.provision.plan import Plan
    from tpuctl.provision.preflight import QuotaCheck
    from tpuctl.spec import RunSpec

Progress = Callable[[State, str], None]

# How long a TPU under maintenance (REPAIRING, RESTARTING) is waited for before it is given up and recreated.
REPAIR_DEADLINE_S = 1800.0
# Compute ends a VM at its max run duration, up to 30 s after the published moment
# (compute/docs/instances/limit-vm-runtime), never before: only a laptop clock behind Google's can make it
# look early. Allow that much.
RUN_END_SLACK_S = 30.0


def run_ended(tpu: Resource, *, now: float | None = None) -> bool:
    """True when Google ends `tpu` at a moment it published (a flex-start TPU's max run duration,
    `detail["ends"]`) and that moment has come, within RUN_END_SLACK_S. Such a TPU is not lost: it was given
    back as the user asked. Reads only the resource; no API call."""
    try:
        ends = datetime.fromisoformat(tpu.detail["ends"]).timestamp()
    except (KeyError, ValueError):
        return False
    return (time.time() if now is None else now) >= ends - RUN_END_SLACK_S


# -- what a driver answers when a run lost its TPU (`Shape.recovery_action`) -------------------------------


@dataclass(frozen=True)
class Recreate:
    """Delete the TPU and create it again exactly as it was (same name, zone, type, runtime, labels, metadata)."""

    tpu: Resource


@dataclass(frozen=True)
class Requeue:
    """Delete the TPU's queued resource (taking the TPU along) and queue the same request again."""

    tpu: Resource


@dataclass(frozen=True)
class RebuildFromPlan:
    """Nothing in the cloud says how to make it again (it is gone, or its shape is rebuilt whole): delete what is
    left and run the plan again (`up`, with its zone failover)."""

    tpu: Resource | None
    why: str


@dataclass(frozen=True)
class Wait:
    """Google brings it back by itself (maintenance, a restart): wait up to `deadline_s` for READY; should it not
    come back (or settle PREEMPTED/FAILED), do `otherwise`."""

    tpu: Resource
    otherwise: Recreate | Requeue | RebuildFromPlan
    deadline_s: float = REPAIR_DEADLINE_S


@dataclass(frozen=True)
class Ended:
    """Google ended the TPU at the moment it published (a flex-start max run duration): not lost, not to be
    requested again."""

    tpu: Resource


RecoveryAction = Union[Wait, Recreate, Requeue, RebuildFromPlan, Ended]


@dataclass(frozen=True)
class Listing:
    """One inventory pass's raw listings, made once for all drivers (each API is listed once, concurrently):
    each driver picks its own resources out of them (`Shape.listed`)."""

    nodes: list  # tpu_v2.Node, every location
    queued: list  # tpu_v2.QueuedResource, every location
    instances: list  # compute_v1.Instance with the run label (Compute's aggregated list)
    run: str | None  # only this run's (None: every tpuctl run's)


class Shape(ABC):
    """One shape's driver. Instances are stateless singletons (`tpuctl.provision.shapes` holds them).

    Every call that waits blocks the calling thread with a deadline on the monotonic clock, polls with backoff,
    honours `cancel` and reports through `progress(state, detail)`; none waits forever. Errors are
    `tpuctl.errors` types only (CapacityError makes `apply` try the next zone).
    """

    name: ClassVar[str]  # how README, plans and errors call the shape: "tpu-node", "queued", ...
    kind: ClassVar[Kind]  # what `create` records for rollback and the plan's step shows
    catalog_api: ClassVar[str] = ""  # the catalog `api` whose types it provisions ("": none, a plain VM)
    permissions: ClassVar[tuple[str, ...]] = ()  # IAM permissions its create, get and delete need (preflight)

    def __repr__(self) -> str:
        return self.name

    # -- choosing the driver ---------------------------------------------------------------------------------

    def serves(self, api: str, hosts: int, provisioning: str) -> bool:
        """Whether this driver makes a TPU of the catalog `api` with `hosts` hosts, provisioned so. Pure."""
        return False

    @abstractmethod
    def owns(self, r: Resource) -> bool:
        """Whether `r` (as `get` or `listed` made it) is this driver's to read, delete and recover. Pure."""

    # -- planning (pure: no API call) -------------------------------------------------------------------------

    def check(self, t: AcceleratorType, provisioning: str, catalog: Catalog) -> None:
        """Refuse (BadInput naming the field) what this shape cannot make, before anything is created."""

    def plan_steps(self, spec: RunSpec, t: AcceleratorType, *, run: str, zones: tuple[str, ...], runtime: str,
                   framework: str, price_per_hour: float, catalog: Catalog) -> tuple[Step, ...]:
        """The plan's steps for what this shape creates for `spec` (the TPU's one step, or one per VM)."""
        hosts = f"{t.hosts} host{'s' if t.hosts > 1 else ''}"
        ends = f", deleted after {spec.max_run_duration}" if spec.max_run_duration else ""
        return (Step("tpu", self.kind, run, zones[0], price_per_hour=price_per_hour,
                     detail=f"{t.name} ({hosts}){self.via(t)}, {runtime}" + (f" ({framework})" if framework else "")
                            + f", {spec.provisioning}{ends}"
                            + (f", failover {', '.join(zones[1:])}" if len(zones) > 1 else "")),)

    def via(self, t: AcceleratorType) -> str:
        """What the plan's step adds about how the TPU is made (", Compute Engine tpu7x-standard-4t")."""
        return ""

    def quota_checks(self, t: AcceleratorType, provisioning: str, zones: tuple[str, ...]) -> tuple[QuotaCheck, ...]:
        """The quota each zone's create draws on (preflight checks it before anything is created). Pure."""
        return ()

    # -- the cloud ------------------------------------------------------------------------------------------

    @abstractmethod
    def create(self, clients: Clients, plan: Plan, name: str, zone: str, *, service_account: str,
               deadline_s: float, cancel: threading.Event | None = None, progress: Progress | None = None,
               on_issued: Callable[[], None] | None = None) -> Resource:
        """Create `name` of `plan` in `zone` and block until READY; return it.

        Idempotent: one that exists with the plan's run label is adopted (NameTaken if another's), one that
        settled PREEMPTED/FAILED is replaced. `on_issued` runs just before the first create request goes out
        (the caller records what to roll back). No capacity in the zone raises CapacityError."""

    def exists(self, clients: Clients, zone: str, name: str) -> bool:
        """Whether anything of this shape is called `name` in `zone` (apply tries that zone first). Read-only."""
        return self.get(clients, zone, name) is not None

    def get(self, clients: Clients, zone: str, name: str) -> Resource | None:
        """The resource `name` in `zone` as this driver's API family shows it (the owning driver is
        `shapes.of(r)`), with its workers but no host keys; None when absent. Read-only."""
        raw = self.read(clients, zone, name)
        return None if raw is None else self.to_resource(clients, raw)

    def read(self, clients: Clients, zone: str, name: str):
        """The raw API object `name` in `zone`, or None (what `get` converts). Read-only."""
        raise NotImplementedError(f"{self.name} reads whole resources only (`get`)")

    @abstractmethod
    def listed(self, clients: Clients, listing: Listing) -> list[Resource]:
        """This driver's resources among one inventory pass's raw listings (`to_resource` of each). No API call
        beyond what a resource's detail needs (a flex-start queued resource's end)."""

    @abstractmethod
    def to_resource(self, clients: Clients, raw) -> Resource:
        """One raw API object of this shape as the boundary type. Pure."""

    def workers(self, clients: Clients, zone: str, name: str) -> tuple[Worker, ...]:
        """The TPU's workers in index order, with SSH host keys where published. Read-only; NotFound if absent."""
        found = self.get(clients, zone, name)
        if found is None:
            raise _NotFound(f"{self.name} {name} does not exist in {zone}", field="run")
        return found.workers

    def authorize(self, clients: Clients, zone: str, name: str, user: str, public_key: str, *,
                  deadline_s: float = 300.0) -> str:
        """Let `public_key` log in to every worker; return the login name. Idempotent; blocks until applied
        (`ssh-keys` metadata, or the OS Login profile when the project or the TPU turns OS Login on)."""
        raise BadInput(f"{name} in {zone} is a {self.name}: no job runs on it, so no key is authorized there",
                       field="run")

    @abstractmethod
    def delete(self, clients: Clients, zone: str, name: str, *, deadline_s: float = 900.0,
               cancel: threading.Event | None = None, progress: Progress | None = None) -> None:
        """Delete `name` (and whatever of it this shape made) and block until gone. Idempotent: NotFound, before
        or during, is done."""

    # -- recovery ------------------------------------------------------------------------------------------

    def recovery_action(self, r: Resource) -> RecoveryAction:
        """What brings back `r`, a TPU its run lost (as last read; state DELETED when it is gone). Pure.

        This default: a TPU whose published end came is Ended; anything else is made again from the plan."""
        if run_ended(r):
            return Ended(r)
        return RebuildFromPlan(r, f"{self.name} {r.name} in {r.location} is {r.state.value}: "
                                  "it is recreated from the run's plan")

    def recreate(self, clients: Clients, zone: str, name: str, *, deadline_s: float,
                 cancel: threading.Event | None = None, progress: Progress | None = None) -> Resource:
        """Carry out Recreate / Requeue: delete `name` and make it again as it was; block until READY."""
        raise NotImplementedError(f"{self.name} answers no Recreate or Requeue")

    def wait_ready(self, clients: Clients, zone: str, name: str, *, deadline_s: float,
                   cancel: threading.Event | None = None, progress: Progress | None = None) -> Resource:
        """Carry out Wait: block until READY (returned); CapacityError if it settles PREEMPTED/FAILED first."""
        raise NotImplementedError(f"{self.name} answers no Wait")
