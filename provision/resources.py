"""The boundary type every other layer reads: a cloud resource tpuctl made, in our own vocabulary.

Raw protos stay inside `tpuctl.provision`; jobs, gc, cost and the CLI see only these frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Mapping


class Kind(str, Enum):
    TPU = "tpu"
    QUEUED = "queued-resource"
    VM = "vm"
    BUCKET = "bucket"
    IAM = "bucket-iam"


class State(str, Enum):
    PENDING = "pending"
    CREATING = "creating"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    REPAIRING = "repairing"
    DELETING = "deleting"
    DELETED = "deleted"
    FAILED = "failed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Worker:
    """One TPU VM host of a slice: where to SSH (port 22 on GCP, the emulated worker's port locally)."""

    index: int
    ip: str
    port: int
    host_key: str | None = None  # "ssh-ed25519 AAAA..." from guest attributes, when published
    # The machine's identity, which a key trusted on first use is recorded under (gcloud's HostKeyAlias:
    # `tpu.<node id>-<worker>` for a TPU VM, `compute.<instance id>` for an instance). Addresses are reused
    # by later machines; ids are not, so a new machine is never checked against an old one's key.
    host_key_alias: str | None = None


@dataclass(frozen=True)
class Resource:
    kind: Kind
    name: str
    project: str
    location: str  # zone, or region for buckets
    state: State
    labels: Mapping[str, str]
    created: datetime | None
    run: str | None  # from the tpuctl-run label
    accelerator: str | None = None
    machine_type: str | None = None
    spot: bool = False
    workers: tuple[Worker, ...] = ()
    detail: Mapping[str, str] = field(default_factory=dict)  # e.g. runtime_version, member, role

    @property
    def key(self) -> str:
        """Stable display/identity key: `tpu/europe-west4-a/run1`."""
        return f"{self.kind.value}/{self.location}/{self.name}"


@dataclass(frozen=True)
class Step:
    """One node of a plan's DAG: create `name` (of `kind`) after the steps named in `after`."""

    key: str  # "bucket", "bucket-iam", "tpu", "vm:NAME"
    kind: Kind
    name: str
    location: str  # zone (first choice) or region
    after: tuple[str, ...] = ()
    price_per_hour: float = 0.0
    detail: str = ""
