"""The run's Cloud Storage bucket and its one IAM binding (on the bucket, never on the project)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from google.api_core import exceptions as gexc

from tpuctl.errors import BadInput, NotFound, TpuctlError
from tpuctl.provision import labels as L
from tpuctl.provision import waits
from tpuctl.provision.clients import Clients
from tpuctl.provision.resources import Kind, Resource, State

ROLE = "roles/storage.objectAdmin"
Progress = Callable[[State, str], None]
CROSS_REGION_WHY = ("reads from another region are billed per GB (inter-region egress) and starve the TPU's "
                    "input pipeline")


@dataclass(frozen=True)
class Contents:
    objects: int
    bytes: int
    sample: tuple[str, ...]


def member(service_account: str) -> str:
    return f"serviceAccount:{service_account}"


def default_service_account(clients: Clients) -> str:
    """The project's default compute service account: `NUMBER-compute@developer.gserviceaccount.com`."""
    project = waits.call(lambda: clients.projects.get_project(name=f"projects/{clients.project}"),
                         what=f"read project {clients.project}")
    number = project.name.rsplit("/", 1)[-1]
    return f"{number}-compute@developer.gserviceaccount.com"


def lookup(clients: Clients, name: str):
    """The bucket, or None. Retries 429/503."""
    return waits.call(lambda: clients.storage.lookup_bucket(name), what=f"look up bucket {name}")


def check_region(bucket, region: str, *, allow_cross_region: bool) -> None:
    """Refuse an existing bucket outside the TPU's region unless explicitly allowed."""
    where = (bucket.location or "").lower()
    if where != region.lower() and not allow_cross_region:
        raise BadInput(f"bucket {bucket.name} is in {where or 'an unknown location'}, the TPU in {region}: "
                       f"{CROSS_REGION_WHY}", field="bucket",
                       hint=f"use a bucket in {region} (or bucket: auto), or pass --allow-cross-region")


def to_resource(bucket, *, project: str) -> Resource:
    labels = dict(bucket.labels or {})
    return Resource(kind=Kind.BUCKET, name=bucket.name, project=project, location=(bucket.location or "").lower(),
                    state=State.READY, labels=labels, created=bucket.time_created, run=labels.get(L.RUN),
                    detail={"url": f"gs://{bucket.name}"})


def ensure(clients: Clients, name: str, region: str, labels: Mapping[str, str], *,
           allow_cross_region: bool = False, cancel: threading.Event | None = None,
           progress: Progress | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Create the bucket in `region` with uniform access, public access prevention and labels, or adopt it.

    Idempotent. An existing bucket keeps its own run label (it may hold another run's checkpoints); missing
    tpuctl labels are added. Refuses a bucket in another region unless `allow_cross_region`.
    """
    what = f"create bucket {name} in {region}"
    b = lookup(clients, name)
    if b is None:
        if on_issued is not None:
            on_issued()
        if progress:
            progress(State.CREATING, "requested")
        b = clients.storage.bucket(name)
        b.iam_configuration.uniform_bucket_level_access_enabled = True
        b.iam_configuration.public_access_prevention = "enforced"
        b.labels = dict(labels)
        try:
            b = waits.call(lambda: clients.storage.create_bucket(b, location=region), what=what, cancel=cancel)
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.Conflict):
                raise
            b = lookup(clients, name)
            if b is None:
                raise BadInput(f"bucket name {name} is taken by another project", field="bucket",
                               hint="bucket names are global: choose another, or use bucket: auto") from exc
    check_region(b, region, allow_cross_region=allow_cross_region)
    missing = {k: v for k, v in labels.items() if k not in (b.labels or {})}
    iam = b.iam_configuration
    if missing or not iam.uniform_bucket_level_access_enabled or iam.public_access_prevention != "enforced":
        # Some storage backends ignore these at create; a patch sets them (and adopts pre-existing buckets).
        b.labels = {**(b.labels or {}), **missing}
        b.iam_configuration.uniform_bucket_level_access_enabled = True
        b.iam_configuration.public_access_prevention = "enforced"
        waits.call(b.patch, what=f"label bucket {name}", cancel=cancel)
    return to_resource(b, project=clients.project)


def grant(clients: Clients, name: str, service_account: str, *, run: str, region: str,
          cancel: threading.Event | None = None, on_issued: Callable[[], None] | None = None) -> Resource:
    """Grant ROLE on bucket `name` (only) to `service_account`. Idempotent; retries etag races.

    `on_issued` runs just before the policy write (not at all when the binding already exists)."""
    b = clients.storage.bucket(name)
    who = member(service_account)

    def read_modify_write() -> None:
        policy = b.get_iam_policy(requested_policy_version=3)
        for binding in policy.bindings:
            if binding["role"] == ROLE and not binding.get("condition") and who in binding["members"]:
                return
        policy.version = 3
        policy.bindings.append({"role": ROLE, "members": {who}})
        if on_issued is not None:
            on_issued()
        b.set_iam_policy(policy)

    for _ in range(5):
        try:
            waits.call(read_modify_write, what=f"grant {ROLE} on bucket {name}", cancel=cancel)
            break
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.PreconditionFailed):
                raise
    return iam_resource(clients.project, name, service_account, run=run, region=region)


def revoke(clients: Clients, name: str, service_account: str, *, cancel: threading.Event | None = None) -> None:
    """Remove ROLE for `service_account` from bucket `name`. Idempotent: no binding, or no bucket, is done."""
    b = clients.storage.bucket(name)
    who = member(service_account)

    def read_modify_write() -> None:
        policy = b.get_iam_policy(requested_policy_version=3)
        changed = False
        for binding in policy.bindings:
            if binding["role"] == ROLE and who in binding["members"]:
                binding["members"].discard(who)
                changed = True
        if changed:
            policy.bindings = [bd for bd in policy.bindings if bd["members"]]
            b.set_iam_policy(policy)

    for _ in range(5):
        try:
            waits.call(read_modify_write, what=f"revoke {ROLE} on bucket {name}", cancel=cancel)
            return
        except NotFound:
            return
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.PreconditionFailed):
                raise


def iam_resource(project: str, bucket: str, service_account: str, *, run: str | None, region: str) -> Resource:
    return Resource(kind=Kind.IAM, name=f"{bucket}/{service_account}", project=project, location=region,
                    state=State.READY, labels={L.RUN: run} if run else {}, created=None, run=run,
                    detail={"bucket": bucket, "role": ROLE, "member": member(service_account)})


def bindings(clients: Clients, name: str) -> list[tuple[str, str]]:
    """(role, member) pairs on the bucket."""
    policy = waits.call(lambda: clients.storage.bucket(name).get_iam_policy(requested_policy_version=3),
                        what=f"read IAM policy of bucket {name}")
    return [(bd["role"], m) for bd in policy.bindings for m in sorted(bd["members"])]


def list_labelled(clients: Clients, run: str | None = None) -> list:
    """Buckets in the project carrying the tpuctl run label (of `run` when given)."""
    return [b for b in waits.call(lambda: list(clients.storage.list_buckets(project=clients.project)),
                                  what="list buckets") if L.matches(b.labels, run)]


def contents(clients: Clients, name: str, *, sample: int = 10) -> Contents:
    n = size = 0
    names: list[str] = []
    for blob in waits.call(lambda: list(clients.storage.list_blobs(name)), what=f"list objects in {name}"):
        n += 1
        size += blob.size or 0
        if len(names) < sample:
            names.append(blob.name)
    return Contents(objects=n, bytes=size, sample=tuple(names))


def delete(clients: Clients, name: str, *, cancel: threading.Event | None = None,
           progress: Progress | None = None) -> None:
    """Delete every object, then the bucket. Idempotent: a missing bucket is success. Blocks."""
    try:
        blobs = waits.call(lambda: list(clients.storage.list_blobs(name)), what=f"list objects in {name}",
                           cancel=cancel)
    except NotFound:
        return
    if progress:
        progress(State.DELETING, f"{len(blobs)} objects")

    def drop(blob) -> None:
        try:
            waits.call(blob.delete, what=f"delete gs://{name}/{blob.name}", cancel=cancel)
        except NotFound:
            pass

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(drop, blobs))
    try:
        waits.call(lambda: clients.storage.bucket(name).delete(), what=f"delete bucket {name}", cancel=cancel)
    except NotFound:
        pass

