"""From a RunSpec to a Plan: validated, named, labelled, priced, with the step DAG. No API calls here.

Everything a user can get wrong is caught here, before anything is created: the type exists, every zone
offers it, the runtime fits the generation, names follow GCP rules, zones share the bucket's region.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tpuctl import catalog as catalog_mod
from tpuctl import frameworks as frameworks_mod
from tpuctl.catalog import AcceleratorType, Catalog, region_of
from tpuctl.errors import BadInput
from tpuctl.provision import labels as L
from tpuctl.provision import shapes
from tpuctl.provision.bucket import ROLE
from tpuctl.provision.preflight import quota_checks
from tpuctl.provision.resources import Kind, Step
from tpuctl.spec import RunSpec, VmSpec, format_duration

ALL_FRAMEWORKS = ("tensorflow", "jax")

_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[a-z]{2,}$")


@dataclass(frozen=True)
class Plan:
    run: str
    project: str
    zones: tuple[str, ...]  # failover order, same region first
    region: str
    accelerator: AcceleratorType
    runtime_version: str
    provisioning: str
    valid_until_s: float | None
    bucket: str
    service_account: str  # "default" (resolved at apply) or an email
    network: str
    subnet: str | None
    tags: tuple[str, ...]
    labels: Mapping[str, str]  # the run labels every resource gets
    ttl_s: float
    allow_cross_region: bool
    vms: tuple[VmSpec, ...]
    steps: tuple[Step, ...]
    notes: tuple[str, ...] = field(default=())
    max_run_duration_s: float | None = None  # flex-start: the provider deletes the TPU after this long
    internal_ips: bool = False
    bucket_soft_delete_s: int = 0  # soft delete retention of a bucket tpuctl creates; 0 = off
    framework: str = ""  # "tensorflow" | "jax"; "" when planned without frameworks
    slices: int = 1  # > 1: a multislice queued resource of that many slices (provision/shapes/queued.py)

    @property
    def spot(self) -> bool:
        return self.provisioning in ("spot", "preemptible")

    @property
    def price_per_hour(self) -> float:
        return sum(s.price_per_hour for s in self.steps)

    def vm_name(self, vm: VmSpec) -> str:
        return f"{self.run}-{vm.name}"

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run, "project": self.project, "zones": list(self.zones), "region": self.region,
            "accelerator": self.accelerator.name, "hosts": self.accelerator.hosts, "api": self.accelerator.api,
            "max_run_duration": None if self.max_run_duration_s is None else format_duration(self.max_run_duration_s),
            "runtime_version": self.runtime_version, "framework": self.framework or None,
            "provisioning": self.provisioning, "slices": self.slices,
            "bucket": f"gs://{self.bucket}", "bucket_soft_delete": format_duration(self.bucket_soft_delete_s)
            if self.bucket_soft_delete_s else "0s", "service_account": self.service_account, "ttl": format_duration(self.ttl_s),
            "internal_ips": self.internal_ips,
            # The quota each create of the failover list is checked against (preflight), before anything is asked.
            "quotas": [q.to_json() for q in quota_checks(self.accelerator, self.provisioning, self.zones, self.slices)],
            "labels": dict(self.labels), "price_per_hour": round(self.price_per_hour, 4), "notes": list(self.notes),
            "steps": [{"key": s.key, "kind": s.kind.value, "name": s.name, "location": s.location,
                       "after": list(s.after), "price_per_hour": round(s.price_per_hour, 4), "detail": s.detail}
                      for s in self.steps],
        }


def default_run_name(spec: RunSpec, owner: str) -> str:
    """Deterministic, so re-running `up` with the same inputs adopts instead of duplicating."""
    return L.suggest_name(f"{owner}-{spec.accelerator or 'tpu'}")


def make(spec: RunSpec, *, project: str, catalog: Catalog | None = None, owner: str | None = None,
         now: float | None = None, price_fn=None, frameworks: tuple[str, ...] | None = ALL_FRAMEWORKS) -> Plan:
    """Validate `spec` and lay out the plan. Pure; raises BadInput naming the field.

    `price_fn(accelerator, region, spot) -> $/h` prices the TPU (the cost module's, when present); VMs are
    priced from the catalog. `frameworks`: what the job's template runs (tpuctl.frameworks picks one and
    its runtime from `job.framework`; the type and runtime must run it, `Catalog.check`); None plans no
    framework (the runtime as given or the catalog's default).
    """
    catalog = catalog or catalog_mod.load()
    owner = owner or L.owner()
    if not spec.accelerator:
        raise BadInput("no accelerator type given", field="accelerator",
                       hint="pass --accelerator (e.g. v3-8) or set accelerator: in the spec; see `tpuctl catalog list`")
    t = catalog.accelerator(spec.accelerator)
    if not spec.zones:
        raise BadInput(f"no zone given for {t.name}", field="zone",
                       hint=f"pass --zone; zones offering {t.name}: {', '.join(t.zones)}")
    zones = _order_zones(spec.zones)
    region = region_of(zones[0])
    if not spec.allow_cross_region:
        other = [z for z in zones if region_of(z) != region]
        if other:
            raise BadInput(f"zones {', '.join(other)} are outside {region}, where the bucket will be",
                           field="zone", hint="list zones of one region, or pass --allow-cross-region")
    notes: list[str] = []
    if len(zones) > 1 and region_of(zones[-1]) != region:
        notes.append(f"failover outside {region} leaves the bucket in {region}: cross-region reads cost per GB")
    if spec.provisioning not in t.provisioning:
        raise BadInput(f"{t.name} cannot be provisioned {spec.provisioning}", field="provisioning",
                       hint=f"{t.name} offers: {', '.join(t.provisioning)}")
    shape = shapes.for_tpu(t, spec.provisioning, spec.slices)
    shape.check(t, spec.provisioning, catalog)
    if spec.provisioning == "flex-start" and t.flex_start_zones:
        outside = [z for z in zones if z not in t.flex_start_zones]
        if outside:
            raise BadInput(f"Google sells {t.name} flex-start only in {', '.join(t.flex_start_zones)}, not in "
                           f"{', '.join(outside)}", field="zone",
                           hint=f"pass --zone {t.flex_start_zones[0]}, or another provisioning model")
    runtime, framework = spec.runtime_version or t.default_runtime, ""
    if frameworks is not None:
        job = spec.job
        choice = frameworks_mod.for_run(job.framework if job else "auto", job.sharding if job else "data",
                                        spec.slices, t, spec.runtime_version, frameworks)
        runtime, framework = choice.runtime_version, choice.framework
    for z in zones:
        catalog.check(t.name, z, runtime, framework or None)
    if spec.slices > 1:
        shapes.QUEUED.check_slices(t, spec.slices, spec.provisioning, framework)
    run = default_run_name(spec, owner) if spec.name is None else spec.name  # "" is a name, and a bad one
    L.check_name(run, field="name", max_len=40)
    bucket = L.auto_bucket(project, run) if spec.bucket == "auto" else spec.bucket.removeprefix("gs://").rstrip("/")
    L.check_bucket_name(bucket)
    if spec.service_account != "default" and not _EMAIL.match(spec.service_account):
        raise BadInput(f"{spec.service_account!r} is not a service account email", field="service_account",
                       hint="use default (the project's compute service account) or NAME@PROJECT.iam.gserviceaccount.com")
    L.check_labels(spec.labels)
    reserved = set(spec.labels) & set(L.OURS)
    if reserved:
        raise BadInput(f"labels {', '.join(sorted(reserved))} are set by tpuctl", field="labels")
    labels = L.run_labels(run, owner_name=owner, ttl_s=spec.ttl_s, extra=spec.labels, now=now)
    for i, vm in enumerate(spec.vms):
        L.check_name(f"{run}-{vm.name}", field=f"vms.{i}.name")
        catalog.vm_price_per_hour(vm.machine_type, region)
    for tag in spec.tags:
        L.check_name(tag, field="tags")

    spot = spec.provisioning in ("spot", "preemptible")
    tpu_price = (price_fn or catalog.tpu_price_per_hour)(t.name, region, spot)
    sa_text = "the project's default compute SA" if spec.service_account == "default" else spec.service_account
    steps = [
        Step("bucket", Kind.BUCKET, bucket, region,
             detail=f"uniform access, public access prevention, {_soft_delete_text(spec.bucket_soft_delete_s)}"),
        Step("bucket-iam", Kind.IAM, bucket, region, after=("bucket",),
             detail=f"{ROLE.removeprefix('roles/storage.')} for {sa_text}, on this bucket only"),
        *(step for driver in (shape, shapes.VM)
          for step in driver.plan_steps(spec, t, run=run, zones=zones, runtime=runtime, framework=framework,
                                        price_per_hour=tpu_price, catalog=catalog)),
    ]
    return Plan(run=run, project=project, zones=zones, region=region, accelerator=t, runtime_version=runtime,
                provisioning=spec.provisioning, valid_until_s=spec.valid_until_s, bucket=bucket,
                service_account=spec.service_account, network=spec.network, subnet=spec.subnet,
                tags=tuple(spec.tags), labels=labels, ttl_s=spec.ttl_s, allow_cross_region=spec.allow_cross_region,
                vms=tuple(spec.vms), steps=tuple(steps), notes=tuple(notes),
                max_run_duration_s=spec.max_run_duration_s, internal_ips=spec.internal_ips,
                bucket_soft_delete_s=spec.bucket_soft_delete_s, framework=framework, slices=spec.slices)


def _soft_delete_text(seconds: int) -> str:
    if not seconds:
        return "soft delete off (deleted checkpoints stop billing at once)"
    return f"soft delete {format_duration(seconds)} (deleted and overwritten objects bill {format_duration(seconds)} more)"


def _order_zones(zones: tuple[str, ...]) -> tuple[str, ...]:
    """Same region as the first zone first (the bucket follows the first zone), then the rest in order."""
    region = region_of(zones[0])
    return tuple(sorted(zones, key=lambda z: region_of(z) != region))



def to_record(plan: Plan) -> dict[str, Any]:
    """The plan exactly as resolved (its labels and their times included), as JSON: what a detached run's
    supervisor makes the run's resources again from when Google deleted them (`from_record`). Unlike
    `to_json` (for people), nothing is left out or rounded."""
    doc = asdict(plan)
    doc["vms"] = [vm.model_dump() for vm in plan.vms]
    doc["steps"] = [{**asdict(s), "kind": s.kind.value} for s in plan.steps]
    return doc


def from_record(doc: Mapping[str, Any]) -> Plan:
    """The Plan `to_record` wrote (JSON turned its tuples into lists)."""
    def tuples(d: Mapping[str, Any]) -> dict[str, Any]:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}

    return Plan(**{**tuples(doc), "accelerator": AcceleratorType(**tuples(doc["accelerator"])),
                   "vms": tuple(VmSpec(**v) for v in doc["vms"]),
                   "steps": tuple(Step(**{**tuples(s), "kind": Kind(s["kind"])}) for s in doc["steps"])})
