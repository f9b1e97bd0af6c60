"""The one table mapping API states (TPU, queued resource, Compute instance) to `State`.

Nothing outside this module compares API enum values or status strings.
"""

from __future__ import annotations

from google.cloud import compute_v1, tpu_v2

from tpuctl.provision.resources import State

_N = tpu_v2.Node.State
NODE = {
    _N.STATE_UNSPECIFIED: State.UNKNOWN, _N.CREATING: State.CREATING, _N.READY: State.READY,
    _N.RESTARTING: State.REPAIRING, _N.REIMAGING: State.REPAIRING, _N.DELETING: State.DELETING,
    _N.REPAIRING: State.REPAIRING, _N.STOPPED: State.STOPPED, _N.STOPPING: State.STOPPING,
    _N.STARTING: State.CREATING, _N.PREEMPTED: State.PREEMPTED, _N.TERMINATED: State.FAILED,
    _N.HIDING: State.DELETING, _N.HIDDEN: State.DELETED, _N.UNHIDING: State.CREATING, _N.UNKNOWN: State.UNKNOWN,
}

_Q = tpu_v2.QueuedResourceState.State
QUEUED = {
    _Q.STATE_UNSPECIFIED: State.UNKNOWN, _Q.CREATING: State.PENDING, _Q.ACCEPTED: State.PENDING,
    _Q.WAITING_FOR_RESOURCES: State.PENDING, _Q.PROVISIONING: State.CREATING, _Q.ACTIVE: State.READY,
    _Q.FAILED: State.FAILED, _Q.DELETING: State.DELETING, _Q.SUSPENDING: State.STOPPING,
    _Q.SUSPENDED: State.PREEMPTED,
}

_I = compute_v1.Instance.Status
INSTANCE = {
    _I.PROVISIONING.name: State.CREATING, _I.STAGING.name: State.CREATING, _I.PENDING.name: State.PENDING,
    _I.RUNNING.name: State.READY, _I.STOPPING.name: State.STOPPING, _I.PENDING_STOP.name: State.STOPPING,
    _I.STOPPED.name: State.STOPPED, _I.SUSPENDING.name: State.STOPPING, _I.SUSPENDED.name: State.STOPPED,
    _I.REPAIRING.name: State.REPAIRING, _I.TERMINATED.name: State.STOPPED, _I.DEPROVISIONING.name: State.DELETING,
}

_OP_DONE = compute_v1.Operation.Status.DONE.name

# States from which a resource will not become READY without someone acting on it.
SETTLED_BAD = frozenset({State.PREEMPTED, State.FAILED, State.DELETED, State.STOPPED})


def node_state(node: tpu_v2.Node) -> State:
    """The node's state, with its health: Google's `UNHEALTHY_MAINTENANCE` is "under maintenance/priority boost
    caused rescheduling and will resume running once rescheduled" (tpu_v2 `Node.Health`), whatever `state` says;
    users report slices that stay READY through it with their workers unreachable. Such a node is REPAIRING:
    waited for, never taken for lost."""
    if node.health == tpu_v2.Node.Health.UNHEALTHY_MAINTENANCE:
        return State.REPAIRING
    return NODE.get(_N(node.state), State.UNKNOWN)


def queued_state(value) -> State:
    return QUEUED.get(_Q(value), State.UNKNOWN) if value is not None else State.UNKNOWN


def instance_state(status: str | None, *, preemptible: bool = False) -> State:
    # A spot/preemptible VM that Compute stopped was preempted; an on-demand TERMINATED one was stopped.
    if preemptible and status == _I.TERMINATED.name:
        return State.PREEMPTED
    return INSTANCE.get(status or "", State.UNKNOWN)


def compute_op_done(status) -> bool:
    name = status.name if hasattr(status, "name") else str(status)
    return name == _OP_DONE
