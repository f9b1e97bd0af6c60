"""The shape drivers, and how the rest of tpuctl picks one (provision/README.md says how to add a shape).

`for_tpu(type, provisioning)`: the driver that makes a catalog type's TPU; `of(resource)`: the driver that owns a
resource seen in the cloud; `find(clients, zone, name)`: the TPU called `name` and its driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpuctl.provision.resources import Resource
from tpuctl.provision.shapes.base import (REPAIR_DEADLINE_S, Ended, Listing, RebuildFromPlan, Recreate, RecoveryAction,
                                          Requeue, Shape, Wait, run_ended)
from tpuctl.provision.shapes.compute_tpu import COMPUTE_TPU
from tpuctl.provision.shapes.mig_slice import MIG_SLICE
from tpuctl.provision.shapes.queued import QUEUED
from tpuctl.provision.shapes.tpu_node import API as DEFAULT_API
from tpuctl.provision.shapes.tpu_node import TPU_NODE
from tpuctl.provision.shapes.vm import VM

if TYPE_CHECKING:
    from tpuctl.catalog import AcceleratorType
    from tpuctl.provision.clients import Clients

__all__ = ["DRIVERS", "Ended", "Listing", "REPAIR_DEADLINE_S", "RebuildFromPlan", "Recreate", "RecoveryAction",
           "Requeue", "Shape", "TPUS", "VM", "Wait", "find", "for_tpu", "of", "run_ended"]

# Every driver that makes a run's TPU; `for_tpu` asks each in turn whether it serves a type.
TPUS: tuple[Shape, ...] = (TPU_NODE, QUEUED, COMPUTE_TPU, MIG_SLICE)
DRIVERS: tuple[Shape, ...] = (*TPUS, VM)
# One driver per API family to look a TPU up by name with (a name is unique within a family: the TPU API's
# nodes, Compute Engine's instances and MIGs); `of` then names the driver that owns what it found.
# A multislice queued resource is looked up last, by its own name (its slices are NAME-0 .. NAME-(N-1)).
_LOOKUPS: tuple[Shape, ...] = (TPU_NODE, COMPUTE_TPU, QUEUED)


def for_tpu(t: AcceleratorType | None, provisioning: str = "on-demand", slices: int = 1) -> Shape:
    """The driver that makes a TPU of `t` provisioned so (None: a Cloud TPU API type, not known yet); several
    `slices` are one multislice queued resource, whatever the provisioning. Pure."""
    api, hosts = (t.api, t.hosts) if t is not None else (DEFAULT_API, 1)
    if slices > 1:
        return QUEUED
    found = next((d for d in TPUS if d.serves(api, hosts, provisioning)), None)
    if found is None:
        raise ValueError(f"no shape driver makes {api} TPUs of {hosts} host(s) provisioned {provisioning}")
    return found


def of(r: Resource) -> Shape | None:
    """The driver that owns `r` (None for a bucket or its IAM binding: provision/bucket.py handles those). Pure."""
    return next((d for d in DRIVERS if d.owns(r)), None)


def find(clients: Clients, zone: str, name: str) -> tuple[Shape, Resource] | None:
    """The TPU called `name` in `zone` (a TPU API node first, as `up` names one) and its driver; None when
    there is none. Read-only."""
    for lookup in _LOOKUPS:
        r = lookup.get(clients, zone, name)
        if r is not None:
            return of(r), r
    return None
