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
from collections.abc import Callable
from dataclasses import replace

from tpuctl.catalog import Catalog
from tpuctl.errors import CapacityError, WaitTimeout
from tpuctl.errors import NotFound as _NotFound
from tpuctl.provision import bucket as _bucket
from tpuctl.provision import inventory as _inventory
from tpuctl.provision import shapes
from tpuctl.provision import tpu as _tpu
# Imported before `def apply` below: importing the submodule binds the package attribute `apply` to it,
# and the function defined afterwards must win.
from tpuctl.provision.apply import ApplyResult, DownResult, ProgressFn
from tpuctl.provision.apply import apply as _apply
from tpuctl.provision.apply import down as _down
from tpuctl.provision.apply import Undo as _Undo
from tpuctl.provision.apply import delete as _delete_one
from tpuctl.provision import labels as _labels
from tpuctl.provision.clients import Clients, connect
from tpuctl.provision.inventory import RunStatus
from tpuctl.provision.plan import Plan, Step
from tpuctl.provision.plan import make as _make_plan
from tpuctl.provision.resources import Kind, Resource, State, Worker
from tpuctl.provision.shapes.base import (REPAIR_DEADLINE_S, RUN_END_SLACK_S, Ended, RebuildFromPlan, Recreate,
                                          RecoveryAction, Requeue, Wait, run_ended)
from tpuctl.provision.waits import DEFAULT_DEADLINE_S
from tpuctl.spec import RunSpec

__all__ = [
    "ApplyResult", "Clients", "DownResult", "Ended", "Kind", "Plan", "ProgressFn", "RebuildFromPlan", "Recreate",
    "RecoveryAction", "Requeue", "Resource", "RunStatus", "State", "Step", "Wait",
    "REPAIR_DEADLINE_S", "RUN_END_SLACK_S", "Worker", "add_ssh_key", "apply", "authorize_key", "bucket_contents",
    "connect", "delete_node",
    "down", "get_node", "list_resources",
    "plan", "recover", "recovery_action", "recreate_node", "run_ended", "status", "wait_node_ready", "workers",
]


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
         deadline_s: float = 1800.0, spare: tuple[str, ...] = ()) -> DownResult:
    """Delete every resource of `run` in parallel and block until gone, then verify by listing labels.

    Idempotent: a run with nothing left returns an empty result. The bucket (checkpoints) and its IAM
    binding are kept unless `delete_bucket`. Raises CloudError naming anything still present afterwards.
    `spare`: keys of resources left alone (a supervisor VM tearing its run down deletes itself last).
    """
    found = [r for r in _inventory.resources(clients, run, include_iam=True) if r.key not in spare]
    say = progress or (lambda key, state, detail: None)
    # The run's supervisor VM goes first, alone: alive, it would take the TPU's deletion for a preemption and
    # make the TPU again. (Deleted twice: the second, in `_down`, finds it gone, which is done.)
    for r in found:
        if r.kind is Kind.VM and r.labels.get(_labels.ROLE) == _labels.SUPERVISOR:
            _delete_one(clients, _Undo.of(r), deadline_s=deadline_s,
                        progress=lambda state, detail, key=r.key: say(key, state.value, detail))
            say(r.key, State.DELETED.value, "")  # gone before anything else is asked to go
    return _down(clients, run, found, delete_bucket=delete_bucket, progress=progress, deadline_s=deadline_s,
                 spare=spare)


def bucket_contents(clients: Clients, bucket: str) -> _bucket.Contents:
    """Object count, total bytes and a few names, to show before `down --delete-bucket`. Read-only."""
    return _bucket.contents(clients, bucket)


def get_node(clients: Clients, zone: str, name: str) -> Resource:
    """The run's TPU `name` (whatever its shape) with its workers (no host keys). Read-only; NotFound if absent."""
    return _find(clients, zone, name)[1]


def _find(clients: Clients, zone: str, name: str) -> tuple[shapes.Shape, Resource]:
    found = shapes.find(clients, zone, name)
    if found is None:
        raise _NotFound(f"TPU node {name} does not exist in {zone}", field="run")
    return found


def workers(clients: Clients, zone: str, name: str) -> tuple[Worker, ...]:
    """The TPU's workers in index order, with SSH host keys from guest attributes where published, whatever its
    shape (a TPU API node, a Compute Engine TPU VM, a MIG slice). Read-only; NotFound if absent."""
    return _find(clients, zone, name)[0].workers(clients, zone, name)


def add_ssh_key(clients: Clients, zone: str, name: str, user: str, public_key: str, *,
                deadline_s: float = 300.0) -> bool:
    """Add `user:public_key` to the node's `ssh-keys` metadata and block until applied.

    Idempotent: returns False (no API write) when the key is already there.
    """

    return _tpu.add_ssh_key(clients, zone, name, user, public_key, deadline_s=deadline_s)


def authorize_key(clients: Clients, zone: str, name: str, user: str, public_key: str, *,
                  deadline_s: float = 300.0) -> str:
    """Let `public_key` log in to the TPU's workers; returns the login name to use with it.

    With OS Login on (`enable-oslogin` in the TPU's metadata, else the project's) the guest ignores `ssh-keys`:
    the key goes into the caller's OS Login profile and the name is the profile's POSIX user. Otherwise
    `user:public_key` goes into the TPU's `ssh-keys` metadata (blocking until applied) and the name is `user`.
    Idempotent. BadInput at once, before any retry, when OS Login is on and cannot be used (account unknown).
    """
    return _find(clients, zone, name)[0].authorize(clients, zone, name, user, public_key, deadline_s=deadline_s)


def wait_node_ready(clients: Clients, zone: str, name: str, *, deadline_s: float = DEFAULT_DEADLINE_S,
                    progress: Callable[[State, str], None] | None = None,
                    cancel: threading.Event | None = None) -> Resource:
    """Block until the node is READY; raises CapacityError if it settles PREEMPTED/FAILED/STOPPED first."""

    return _tpu.wait_ready(clients, zone, name, deadline_s=deadline_s, progress=progress, cancel=cancel)


def delete_node(clients: Clients, zone: str, name: str, *, deadline_s: float = 900.0,
                progress: Callable[[State, str], None] | None = None) -> None:
    """Delete the TPU `name` (its queued resource, or its slice's MIG, template and policy too); block until
    gone. Idempotent."""
    found = shapes.find(clients, zone, name)
    if found is not None:
        found[0].delete(clients, zone, name, deadline_s=deadline_s, progress=progress)


def recovery_action(clients: Clients, zone: str, name: str, *, last: Resource | None = None) -> RecoveryAction:
    """What brings back the TPU `name`, which its run lost (or saw under maintenance), as its shape's driver
    decides from the TPU's state now: Wait, Recreate, Requeue, RebuildFromPlan or Ended. `last`: the TPU as
    the caller last knew it (what a TPU that is gone was, and the end Google published for it). Read-only."""
    found = shapes.find(clients, zone, name)
    if found is None:
        driver = shapes.of(last) if last is not None else None
        if driver is None:
            return RebuildFromPlan(last, f"TPU node {name} does not exist in {zone}; nothing to recreate from")
        return driver.recovery_action(replace(last, state=State.DELETED))
    driver, now = found
    if last is not None and "ends" in last.detail and "ends" not in now.detail:
        # Google published the end once (tpuctl saw it at create or in a listing); it holds for the TPU now.
        now = replace(now, detail={**now.detail, "ends": last.detail["ends"]})
    return driver.recovery_action(now)


def recover(clients: Clients, action: RecoveryAction, *, force: bool = True, deadline_s: float = DEFAULT_DEADLINE_S,
            progress: Callable[[State, str], None] | None = None,
            cancel: threading.Event | None = None) -> Resource | RebuildFromPlan:
    """Carry out `action` (from `recovery_action`); return the TPU, READY (blocks until then), or the
    RebuildFromPlan it came to: nothing in the cloud can make that TPU again, the run's plan must (`up`).

    A TPU that is READY is returned untouched unless `force` (so two recoveries racing do one recreate; `force`
    when its workers were lost on a READY TPU). Wait waits up to its deadline and returns the TPU (`force`: then
    recreates it anyway); one that does not come back in time gets the driver's `otherwise`. Recreate and
    Requeue make it again as it was, in its zone (CapacityError when the zone has none). Ended raises NotFound:
    Google gave the TPU back as asked, and it is not requested again."""
    tpu = action.tpu
    if tpu is not None and tpu.state is State.READY and not force:
        return tpu
    if isinstance(action, Wait):
        try:
            tpu = shapes.of(tpu).wait_ready(clients, tpu.location, tpu.name, cancel=cancel, progress=progress,
                                            deadline_s=min(deadline_s, action.deadline_s))
            if not force:
                return tpu
        except (WaitTimeout, CapacityError):
            pass  # it did not come back in time (or settled PREEMPTED/FAILED)
        action = action.otherwise
    if isinstance(action, (Recreate, Requeue)):
        return shapes.of(tpu).recreate(clients, tpu.location, tpu.name, deadline_s=deadline_s, cancel=cancel,
                                       progress=progress)
    if isinstance(action, Ended):
        raise _NotFound(f"TPU {tpu.name} in {tpu.location} ended at {tpu.detail['ends']}, its max run duration",
                        field="run", hint="run `tpuctl up` again with the run's spec")
    return action


def recreate_node(clients: Clients, zone: str, name: str, *, force: bool = False,
                  deadline_s: float = DEFAULT_DEADLINE_S, progress: Callable[[State, str], None] | None = None,
                  cancel: threading.Event | None = None) -> Resource:
    """Preemption recovery in one call: `recover(recovery_action(...))`. The TPU is made again exactly as it
    was (same name, zone, type, runtime, labels, metadata incl. ssh-keys, service account), blocking until
    READY; a READY one is returned untouched unless `force`; one under maintenance is waited for, up to
    REPAIR_DEADLINE_S, not deleted; a queued one is re-queued. NotFound when its shape is made again from the
    run's plan instead (it is gone, or a Compute Engine TPU)."""
    got = recover(clients, recovery_action(clients, zone, name), force=force, deadline_s=deadline_s,
                  progress=progress, cancel=cancel)
    if isinstance(got, RebuildFromPlan):
        raise _NotFound(got.why, field="run", hint="run `tpuctl up` again with the run's spec")
    return got
