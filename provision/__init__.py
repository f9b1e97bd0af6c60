"""The provisioning layer's contract: plan, apply, down, inspect, and single-node recovery.

Everything other layers (jobs, gc, cost, the CLI) need from the cloud goes through these typed functions;
raw protos never leave `tpuctl.provision`. Conventions, in the spirit of SkyPilot's `sky/provision`:

- Creates are idempotent: a resource with the run's `tpuctl-run` label is adopted, never duplicated; a name
  taken by something else is BadInput.
- Deletes are idempotent: NotFound (before or during) counts as done.
- Every call that waits blocks the calling thread with a deadline on the monotonic clock, polls with
  backoff + jitter, retries 429/503, and reports through an optional progress callback; none waits forever.
- Errors are `tpuctl.errors` types only (BadInput, CapacityError, QuotaError, CloudError, WaitTimeout, ...).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime

from tpuctl import catalog as _catalog
from tpuctl.catalog import Catalog
from tpuctl.errors import CapacityError, WaitTimeout
from tpuctl.errors import NotFound as _NotFound
from tpuctl.provision import bucket as _bucket
from tpuctl.provision import compute_tpu as _compute_tpu
from tpuctl.provision import inventory as _inventory
from tpuctl.provision import oslogin as _oslogin
from tpuctl.provision import tpu as _tpu
# Imported before `def apply` below: importing the submodule binds the package attribute `apply` to it,
# and the function defined afterwards must win.
from tpuctl.provision.apply import ApplyResult, DownResult, ProgressFn
from tpuctl.provision.apply import apply as _apply
from tpuctl.provision.apply import down as _down
from tpuctl.provision.clients import Clients, connect
from tpuctl.provision.inventory import RunStatus
from tpuctl.provision.plan import Plan, Step
from tpuctl.provision.plan import make as _make_plan
from tpuctl.provision.resources import Kind, Resource, State, Worker
from tpuctl.provision.waits import DEFAULT_DEADLINE_S
from tpuctl.spec import RunSpec

__all__ = [
    "ApplyResult", "Clients", "DownResult", "Kind", "Plan", "ProgressFn", "Resource", "RunStatus", "State", "Step",
    "Worker", "add_ssh_key", "apply", "authorize_key", "bucket_contents", "connect", "delete_node",
    "down", "get_node", "list_resources",
    "plan", "recreate_node", "status", "wait_node_ready", "workers",
]


# How long a node under maintenance (REPAIRING, RESTARTING) is waited for before it is given up and recreated.
REPAIR_DEADLINE_S = 1800.0


def plan(spec: RunSpec, *, project: str, catalog: Catalog | None = None, owner: str | None = None,
         now: float | None = None, price_fn: Callable[[str, str, bool], float] | None = None,
         frameworks: tuple[str, ...] | None = ("tensorflow", "jax"), framework: str | None = "") -> Plan:
    """Validate `spec` and lay out the step DAG with its $/hour. Pure: no API call, never blocks.

    Raises BadInput naming the field (unknown type, zone not offering it, runtime of another generation,
    bad names/labels, zones outside the bucket's region, a framework Google does not run on the type) so that
    nothing is created on bad input. `frameworks`: what the job's template runs (None: plan no framework);
    `framework` ("tensorflow", or None) is shorthand for a template that runs only that one.
    """
    if framework != "":
        frameworks = (framework,) if framework else None
    return _make_plan(spec, project=project, catalog=catalog, owner=owner, now=now, price_fn=price_fn,
                      frameworks=frameworks)


def apply(clients: Clients, plan: Plan, *, progress: ProgressFn | None = None, keep_on_failure: bool = False,
          deadline_s: float = DEFAULT_DEADLINE_S, cancel: threading.Event | None = None,
          on_rollback: Callable[[list[str]], None] | None = None,
          on_gone: Callable[[list], None] | None = None) -> ApplyResult:
    """Create what `plan` needs and block until all of it is READY; returns what exists and what was made.

    Idempotent (adopts the run's existing resources, creates only what is missing). Independent steps run
    concurrently; the TPU fails over to the plan's next zone on capacity errors. On failure, `cancel` or
    KeyboardInterrupt everything this call created is deleted (unless `keep_on_failure`) before the error
    propagates; a second KeyboardInterrupt stops the cleanup and the error's hint is `tpuctl down RUN`.
    `progress(key, state, detail)` is called from worker threads. `on_gone(entries)` hears, as cost ledger
    entries, of what this call created and deleted again (rolled back, or a zone without capacity).
    """
    return _apply(clients, plan, progress=progress, keep_on_failure=keep_on_failure, deadline_s=deadline_s,
                  cancel=cancel, on_rollback=on_rollback, on_gone=on_gone)


def check_bucket(clients: Clients, plan: Plan) -> None:
    """The refusal `apply` makes before creating anything, for a dry run to make too: an existing bucket outside
    the TPU's region (unless the plan allows it). Read-only; raises BadInput naming `bucket`."""
    existing = _bucket.lookup(clients, plan.bucket)
    if existing is not None:
        _bucket.check_region(existing, plan.region, allow_cross_region=plan.allow_cross_region)


def list_resources(clients: Clients, run: str | None = None, *, include_iam: bool = False) -> list[Resource]:
    """Every resource carrying the tpuctl run label (of `run`, when given), across all zones. Read-only; blocks
    for the list calls (made concurrently)."""
    return _inventory.resources(clients, run, include_iam=include_iam)


def status(clients: Clients, run: str | None = None, *,
           price: Callable[[Resource], float] | None = None) -> list[RunStatus]:
    """Runs (all, or just `run`) with their resources, state, zone, age, workers and accrued cost.

    `price(resource)` gives $/hour for accrual (the cost module's function); without it costs read 0.
    Raises NotFound when `run` is given and nothing carries its label. Read-only.
    """
    found = _inventory.runs(_inventory.resources(clients, run, include_iam=run is not None), price=price)
    if run is not None and not found:
        raise _NotFound(f"no resources carry the label tpuctl-run={run}", field="run",
                        hint="see `tpuctl list` for the runs that exist")
    return found


def down(clients: Clients, run: str, *, delete_bucket: bool = False, progress: ProgressFn | None = None,
         deadline_s: float = 1800.0) -> DownResult:
    """Delete every resource of `run` in parallel and block until gone, then verify by listing labels.

    Idempotent: a run with nothing left returns an empty result. The bucket (checkpoints) and its IAM
    binding are kept unless `delete_bucket`. Raises CloudError naming anything still present afterwards.
    """
    found = _inventory.resources(clients, run, include_iam=True)
    return _down(clients, run, found, delete_bucket=delete_bucket, progress=progress, deadline_s=deadline_s)


def bucket_contents(clients: Clients, bucket: str) -> _bucket.Contents:
    """Object count, total bytes and a few names, to show before `down --delete-bucket`. Read-only."""
    return _bucket.contents(clients, bucket)


def get_node(clients: Clients, zone: str, name: str) -> Resource:
    """The TPU node (or Compute Engine TPU) with its workers (no host keys). Read-only; NotFound if absent."""

    node = _tpu.get_node(clients, zone, name)
    if node is None:
        return _compute_tpu_or_not_found(_compute_tpu.get, clients, zone, name)
    return _tpu.to_resource(node, local=clients.local)


def _compute_tpu_or_not_found(lookup, clients: Clients, zone: str, name: str):
    """`lookup` (compute_tpu.get or .workers) of a TPU the TPU API does not have; NotFound when Compute has none."""
    found = lookup(clients, zone, name, catalog=_catalog.load())
    if found is None:
        raise _NotFound(f"TPU node {name} does not exist in {zone}", field="run")
    return found


def workers(clients: Clients, zone: str, name: str) -> tuple[Worker, ...]:
    """The node's workers in index order, with SSH host keys from guest attributes where published.
    A Compute Engine TPU (one instance, or a MIG slice) answers the same way. Read-only; NotFound if absent."""

    node = _tpu.get_node(clients, zone, name)
    if node is None:
        return _compute_tpu_or_not_found(_compute_tpu.workers, clients, zone, name)
    keys = _tpu.host_keys(clients, zone, name)
    return tuple(replace(w, host_key=keys[w.index] if w.index < len(keys) else None)
                 for w in _tpu.to_resource(node, local=clients.local).workers)


def add_ssh_key(clients: Clients, zone: str, name: str, user: str, public_key: str, *,
                deadline_s: float = 300.0) -> bool:
    """Add `user:public_key` to the node's `ssh-keys` metadata and block until applied.

    Idempotent: returns False (no API write) when the key is already there.
    """

    return _tpu.add_ssh_key(clients, zone, name, user, public_key, deadline_s=deadline_s)


def authorize_key(clients: Clients, zone: str, name: str, user: str, public_key: str, *,
                  deadline_s: float = 300.0) -> str:
    """Let `public_key` log in to the node's workers; returns the login name to use with it.

    With OS Login on (`enable-oslogin` in the node's metadata, else the project's) the guest ignores `ssh-keys`:
    the key goes into the caller's OS Login profile and the name is the profile's POSIX user. Otherwise
    `user:public_key` goes into the node's `ssh-keys` metadata (blocking until applied) and the name is `user`.
    Idempotent. BadInput at once, before any retry, when OS Login is on and cannot be used (account unknown).
    """

    node = _tpu.get_node(clients, zone, name)
    if node is None:
        catalog = _catalog.load()
        found = _compute_tpu.instances_of(clients, zone, name, catalog=catalog)
        if found is None or not found[0]:
            raise _NotFound(f"TPU node {name} does not exist in {zone}", field="run")
        if _oslogin.enabled(_oslogin.project_metadata(clients), _compute_tpu.metadata_of(found[0][0])):
            return _oslogin.login_user(clients, public_key)
        _compute_tpu.add_ssh_key(clients, zone, name, user, public_key, catalog=catalog, deadline_s=deadline_s)
        return user
    if _oslogin.enabled(_oslogin.project_metadata(clients), dict(node.metadata)):
        return _oslogin.login_user(clients, public_key)
    _tpu.add_ssh_key(clients, zone, name, user, public_key, deadline_s=deadline_s)
    return user


def wait_node_ready(clients: Clients, zone: str, name: str, *, deadline_s: float = DEFAULT_DEADLINE_S,
                    progress: Callable[[State, str], None] | None = None,
                    cancel: threading.Event | None = None) -> Resource:
    """Block until the node is READY; raises CapacityError if it settles PREEMPTED/FAILED/STOPPED first."""

    return _tpu.wait_ready(clients, zone, name, deadline_s=deadline_s, progress=progress, cancel=cancel)


def delete_node(clients: Clients, zone: str, name: str, *, deadline_s: float = 900.0,
                progress: Callable[[State, str], None] | None = None) -> None:
    """Delete one TPU node (its queued resource too, if it came from one); block until gone. Idempotent."""

    node = _tpu.get_node(clients, zone, name)
    if node is not None and node.queued_resource:
        _tpu.delete_queued(clients, zone, node.queued_resource.rsplit("/", 1)[-1], deadline_s=deadline_s,
                           progress=progress)
    elif node is not None:
        _tpu.delete_node(clients, zone, name, deadline_s=deadline_s, progress=progress)
    else:
        found = _compute_tpu.instances_of(clients, zone, name, catalog=_catalog.load())
        if found is not None and found[1]:
            _compute_tpu.delete_slice(clients, zone, name, deadline_s=deadline_s, progress=progress)
        elif found is not None:
            _compute_tpu.delete(clients, zone, name, deadline_s=deadline_s, progress=progress)


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


def recreate_node(clients: Clients, zone: str, name: str, *, force: bool = False,
                  deadline_s: float = DEFAULT_DEADLINE_S, progress: Callable[[State, str], None] | None = None,
                  cancel: threading.Event | None = None) -> Resource:
    """Preemption recovery: delete the node and create it again exactly as it was (same name, zone, type,
    runtime, labels, metadata incl. ssh-keys, service account); block until READY and return it.

    A node that is READY is returned untouched unless `force` (so two recoveries racing do one recreate).
    A node under maintenance (REPAIRING/RESTARTING) is waited for, up to REPAIR_DEADLINE_S, not deleted.
    A node from a queued resource is re-queued. NotFound when the node is gone (its definition went with it).
    """

    node = _tpu.get_node(clients, zone, name)
    if node is None:
        current = _compute_tpu.get(clients, zone, name, catalog=_catalog.load())
        if current is not None and current.state is State.READY and not force:
            return current
        # A Compute Engine TPU is made again from the run's plan (`tpuctl run` deletes it and runs `up`).
        raise _NotFound(f"TPU node {name} does not exist in {zone}; nothing to recreate from" if current is None
                        else f"TPU VM {name} in {zone} is {current.state.value}: it is recreated from the run's plan",
                        field="run", hint="run `tpuctl up` again with the run's spec")
    current = _tpu.to_resource(node, local=clients.local)
    if current.state is State.REPAIRING:
        # Maintenance, a repair or a restart: Google brings the node back by itself. Deleting it would
        # throw an on-demand node (and its place in the zone) away; wait for it instead.
        try:
            current = _tpu.wait_ready(clients, zone, name, deadline_s=min(deadline_s, REPAIR_DEADLINE_S),
                                      cancel=cancel, progress=progress)
            if not force:
                return current
        except (WaitTimeout, CapacityError):
            pass  # it did not come back in time (or settled PREEMPTED/FAILED): recreate it below
    if current.state is State.READY and not force:
        return current
    req = _tpu.request_of(node)
    if node.queued_resource:
        qr_name = node.queued_resource.rsplit("/", 1)[-1]
        _tpu.delete_queued(clients, zone, qr_name, deadline_s=deadline_s, cancel=cancel, progress=progress)
        return _tpu.create_queued(clients, req, deadline_s=deadline_s, cancel=cancel, progress=progress)
    _tpu.delete_node(clients, zone, name, deadline_s=deadline_s, cancel=cancel, progress=progress)
    return _tpu.create_node(clients, req, deadline_s=deadline_s, cancel=cancel, progress=progress)
