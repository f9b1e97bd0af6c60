"""Preflight: is the project ready for a run? The checks `tpuctl doctor` prints and every `up` makes first.

Each check is a few read-only GETs; all run at once in threads, so the whole preflight costs about one round
trip. A check that finds a problem says what is wrong and how to fix it; `require` raises PreflightFailed
(exit 2) before anything is created, so a project that cannot work never starts billing for a TPU. A check
that cannot be made (the caller may not read Service Usage or the org policy) is "unknown" and stops nothing.

Checks (their primary sources are cited in localcloud/README.md, which answers them from its own state):
- apis: Service Usage `services.batchGet` for the APIs a run calls;
- network, subnetwork: Compute `networks.get` / `subnetworks.get` (the subnetwork in every region of the
  zone failover list: a failover creates there);
- service-account: IAM `serviceAccounts.get` of the TPU's account (the default compute account exists only
  once the Compute Engine API was enabled);
- permissions: Resource Manager `projects.testIamPermissions` for what `up` and `down` do (a TPU sold as a
  Compute Engine machine type, TPU7x, needs Compute Engine's instead of the TPU API's);
- external-ips: Org Policy `getEffectivePolicy` of constraints/compute.vmExternalIpAccess, unless the workers
  get internal IPs only (`--internal-ips`);
- os-login: Compute `projects.get`; with `enable-oslogin` TRUE tpuctl must know the caller's account;
- tpu-quota: Cloud Quotas `quotaInfos.get` of the quota the slice draws on, in each zone of the plan: the
  Cloud TPU API's (per zone; spot, preemptible and flex-start slices its preemptible quota), or for TPU7x
  Compute Engine's (per region, `quota_checks`).
  A slice larger than the zone's limit can never be created there, so `up` stops (exit 3) when no zone of
  the plan has room, naming the quota and where to raise it. QuotaInfo carries limits, not usage (usage
  lives in Cloud Monitoring), so a slice that fits the limit but not what is left of it still meets
  Google's 429 at create. A quota that cannot be read (Cloud Quotas disabled, no permission, an id Google
  does not know) is "unknown" and stops nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

from google.api_core import exceptions as gexc

from tpuctl.catalog import AcceleratorType, Catalog, region_of
from tpuctl.errors import EXIT_BAD_INPUT, QUOTAS_PAGE, QuotaError, TpuctlError
from tpuctl.provision import bucket, oslogin, waits
from tpuctl.provision.clients import Clients

SERVICES = ("tpu.googleapis.com", "compute.googleapis.com", "storage.googleapis.com", "iam.googleapis.com")
# What `up` (TPU, bucket, bucket IAM, acting as the TPU's service account) and `down` need on the project.
# What every run needs besides its TPU's own permissions (each shape driver's `permissions`, provision/shapes/).
PERMISSIONS = (
    "storage.buckets.create", "storage.buckets.get", "storage.buckets.getIamPolicy", "storage.buckets.setIamPolicy",
    "iam.serviceAccounts.actAs",
)
EXTERNAL_IP_CONSTRAINT = "compute.vmExternalIpAccess"


# The API each check calls: when it is disabled the check reports that, not the 403 it got.
NEEDS = {"network": "compute.googleapis.com", "subnetwork": "compute.googleapis.com",
         "os-login": "compute.googleapis.com", "service-account": "iam.googleapis.com"}

QUOTA_SERVICE = "tpu.googleapis.com"
COMPUTE_QUOTA_SERVICE = "compute.googleapis.com"
# Compute Engine's TPU quotas (compute/resource-usage, "TPU quota"; sources in localcloud/README.md), per region
# and in chips: on-demand VMs draw on the quota every TPU family shares (its tpu_family dimension picks the
# family's limit), Spot and flex-start VMs on the generation's preemptible quota, and a flex-start VM on the
# standard quota when the preemptible one has no room (compute/docs/instances/provisioning-models).
COMPUTE_FAMILY_QUOTA = "TPUS-PER-TPU-FAMILY-per-project-region"
_COMPUTE_QUOTA = {"tpu7x": ("tpu7x", "PREEMPTIBLE-TPU7X-per-project-region")}  # generation: (tpu_family, preemptible)
# Provisioning models that draw on preemptible quota: flex-start too (tpu/docs/request-using-flex-start: "make
# sure that you have sufficient preemptible quota"; compute/docs/instances/provisioning-models).
PREEMPTIBLE_QUOTA = ("spot", "preemptible", "flex-start")
QUOTA_DOCS = {QUOTA_SERVICE: "cloud.google.com/tpu/docs/quota",
              COMPUTE_QUOTA_SERVICE: "cloud.google.com/compute/resource-usage#tpu_quota"}
# The Cloud TPU API's quota ids, as Google's 429s and `gcloud quotas info list --service=tpu.googleapis.com`
# name them (sources in localcloud/README.md, "TPU quota"): TPU{GEN}[Preemptible][Pod]PerProjectPerZoneForTPUAPI.
# Spot and preemptible slices draw on the Preemptible quota (cloud.google.com/tpu/docs/quota); v2/v3 single
# devices and pods have separate quotas; v5e slices of 1, 4 or 8 chips draw on the Serving quota.
_QUOTA_GEN = {"v2": "V2s", "v3": "V3s", "v4": "V4s", "v5e": "V5sLitepod", "v5p": "V5P", "v6e": "V6E"}
_SERVING_V5E = {"v5litepod-1", "v5litepod-4", "v5litepod-8"}


class PreflightFailed(TpuctlError):
    """The project is not ready; nothing was created. The message lists each problem, the hint each fix."""

    exit_code = EXIT_BAD_INPUT


def tpu_quota_id(accelerator: AcceleratorType, spot: bool) -> str | None:
    """The Cloud TPU API quota a slice of `accelerator` draws on; None for types
    provisioned through Compute Engine (TPU7x: their quota is Compute's)."""
    gen = _QUOTA_GEN.get(accelerator.generation)  # TPU7x and later have none: Compute Engine sells them
    if gen is None:
        return None
    pre = "Preemptible" if spot else ""
    if accelerator.generation == "v5e":
        kind = f"Serving{pre}" if accelerator.name in _SERVING_V5E else pre
    elif accelerator.generation in ("v2", "v3", "v4"):
        # v2/v3 single devices (-8) have their own quota; every v4 slice is a pod slice.
        pod = accelerator.generation == "v4" or accelerator.cores > 8
        kind = pre + ("Pod" if pod else "")
    else:
        kind = pre
    return f"TPU{gen}{kind}PerProjectPerZoneForTPUAPI"


def quota_units(accelerator: AcceleratorType) -> int:
    """The least the slice can count against its quota. Google counts v2/v3 in TensorCores and v5e/v6e in
    chips (one core each); v4/v5p quota "can be specified in terms of chips or TensorCores", so the chips:
    a slice refused on this count is refused in either unit."""
    return accelerator.cores if accelerator.generation in ("v2", "v3") else accelerator.chips


def limit_in(info: dict, dimensions: Mapping[str, str]) -> int | None:
    """The limit a QuotaInfo (REST JSON) sets where `dimensions` (zone, region, tpu_family) say; None when
    unlimited or no entry applies. `dimensionsInfos` run from most to least specific; an entry applies when
    each of its dimensions matches."""
    for entry in info.get("dimensionsInfos") or []:
        if all(dimensions.get(k) == v for k, v in (entry.get("dimensions") or {}).items()):
            value = int((entry.get("details") or {}).get("value", -1))
            return None if value < 0 else value
    return None


@dataclass(frozen=True)
class QuotaCheck:
    """What a create in `zone` is checked against: Cloud Quotas' `service` and the `quotas` it draws on, in the
    order Google tries them (a second one only for flex-start on Compute Engine), each with the dimensions
    that pick its limit there, and the `need` in the quota's unit."""

    zone: str
    service: str
    quotas: tuple[str, ...]
    dimensions: tuple[Mapping[str, str], ...]
    need: int

    @property
    def where(self) -> str:
        """Where the limit applies: the zone (Cloud TPU API) or its region (Compute Engine)."""
        return self.dimensions[0].get("zone") or self.dimensions[0]["region"]

    def to_json(self) -> dict:
        first, *rest = ({"quota": q, "dimensions": dict(d)} for q, d in zip(self.quotas, self.dimensions))
        return {"zone": self.zone, "service": self.service, **first, "needs": self.need,
                **({"fallback": rest} if rest else {})}


def quota_checks(accelerator: AcceleratorType, provisioning: str, zones: tuple[str, ...],
                 slices: int = 1) -> tuple[QuotaCheck, ...]:
    """The quota each create of the zone failover list is checked against (the TPU's shape driver knows which
    API's quota it draws on); () for a type with no known quota."""
    from tpuctl.provision import shapes

    # A multislice draws on the quota for every one of its slices at once.
    return tuple(replace(q, need=q.need * slices) for q in
                 shapes.for_tpu(accelerator, provisioning, slices).quota_checks(accelerator, provisioning, zones))


def compute_quota_checks(accelerator: AcceleratorType, provisioning: str,
                         zones: tuple[str, ...]) -> tuple[QuotaCheck, ...]:
    """Compute Engine's TPU quotas (per region, in chips) for a TPU sold as a machine type."""
    if accelerator.generation not in _COMPUTE_QUOTA:
        return ()
    family, preemptible_id = _COMPUTE_QUOTA[accelerator.generation]
    if provisioning == "flex-start":
        ids = (preemptible_id, COMPUTE_FAMILY_QUOTA)
    else:
        ids = (preemptible_id,) if provisioning in PREEMPTIBLE_QUOTA else (COMPUTE_FAMILY_QUOTA,)
    return tuple(QuotaCheck(z, COMPUTE_QUOTA_SERVICE, ids, tuple(
        {"region": region_of(z), **({"tpu_family": family} if q == COMPUTE_FAMILY_QUOTA else {})} for q in ids),
        accelerator.chips) for z in zones)


def tpu_api_quota_checks(accelerator: AcceleratorType, provisioning: str,
                         zones: tuple[str, ...]) -> tuple[QuotaCheck, ...]:
    """The Cloud TPU API's quota (per zone) for a slice it creates."""
    quota = tpu_quota_id(accelerator, provisioning in PREEMPTIBLE_QUOTA)
    if quota is None:
        return ()
    return tuple(QuotaCheck(z, QUOTA_SERVICE, (quota,), ({"region": region_of(z), "zone": z},),
                            quota_units(accelerator)) for z in zones)


@dataclass(frozen=True)
class Target:
    """What a run will use, as far as the checks care."""

    region: str | None = None  # None: the subnetwork (needs a region) is not checked
    network: str = "default"
    subnet: str | None = None
    service_account: str = "default"
    queued: bool = False
    vms: bool = False
    internal_ips: bool = False
    accelerator: AcceleratorType | None = None  # None: the TPU quota is not checked
    zones: tuple[str, ...] = ()
    provisioning: str = "on-demand"
    slices: int = 1  # a multislice: that many slices of `accelerator` in one queued resource

    @property
    def regions(self) -> tuple[str, ...]:
        """Every region the zone failover list reaches, the first zone's first."""
        return tuple(dict.fromkeys([*([self.region] if self.region else []), *map(region_of, self.zones)]))

    @classmethod
    def of_plan(cls, plan) -> Target:
        return cls(region=plan.region, network=plan.network, subnet=plan.subnet,
                   service_account=plan.service_account, queued=plan.provisioning == "queued", vms=bool(plan.vms),
                   internal_ips=plan.internal_ips, accelerator=plan.accelerator, zones=tuple(plan.zones),
                   provisioning=plan.provisioning, slices=plan.slices)

    @classmethod
    def of_spec(cls, spec, catalog: Catalog) -> Target:
        """What `tpuctl doctor` checks for a spec that was not planned (no accelerator: no quota check)."""
        known = spec.accelerator in {t.name for t in catalog.accelerators()}
        return cls(region=region_of(spec.zones[0]) if spec.zones else None, network=spec.network,
                   subnet=spec.subnet, service_account=spec.service_account, queued=spec.provisioning == "queued",
                   vms=bool(spec.vms), internal_ips=spec.internal_ips,
                   accelerator=catalog.accelerator(spec.accelerator) if known else None, zones=tuple(spec.zones),
                   provisioning=spec.provisioning, slices=spec.slices)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "ok"; "problem" (stops `up`); "unknown" (could not be read, e.g. no permission to: never stops `up`)
    detail: str
    fix: str | None = None
    missing: tuple[str, ...] = ()  # the disabled APIs, the permissions not held

    @property
    def ok(self) -> bool:
        return self.status != "problem"

    def to_json(self) -> dict:
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v not in (None, ())}
        return {**out, "ok": self.ok}


def _last(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _apis(clients: Clients, target: Target) -> Check:
    resp = waits.call(lambda: clients.service_usage.batch_get_services(request={
        "parent": f"projects/{clients.project}", "names": [f"projects/{clients.project}/services/{s}" for s in SERVICES]}),
        what=f"read which APIs project {clients.project} has enabled")
    disabled = sorted(_last(s.name) for s in resp.services if s.state.name != "ENABLED")
    if disabled:
        return Check("apis", "problem", f"disabled: {', '.join(disabled)}",
                     f"gcloud services enable {' '.join(disabled)} --project {clients.project}", tuple(disabled))
    return Check("apis", "ok", f"enabled: {', '.join(SERVICES)}")


def _network(clients: Clients, target: Target) -> Check:
    name = _last(target.network)
    try:
        waits.call(lambda: clients.networks.get(project=clients.project, network=name),
                   what=f"read network {name}")
    except TpuctlError as exc:
        if not isinstance(exc.__cause__, gexc.NotFound):
            raise
        fix = (f"gcloud compute networks create default --subnet-mode=auto --project {clients.project}"
               if name == "default" else f"create network {name}, or name an existing one with --network/`network:`")
        return Check("network", "problem", f"network {name} does not exist in project {clients.project}", fix)
    return Check("network", "ok", f"network {name} exists")


def _subnetwork(clients: Clients, target: Target) -> Check:
    """The subnetwork in every region of the zone failover list: a create that fails over creates there."""
    name = _last(target.subnet or target.network)
    missing = []
    for region in target.regions:
        try:
            waits.call(lambda r=region: clients.subnetworks.get(project=clients.project, region=r, subnetwork=name),
                       what=f"read subnetwork {name} in {region}")
        except TpuctlError as exc:
            if not isinstance(exc.__cause__, gexc.NotFound):
                raise
            missing.append(region)
    if missing:
        return Check("subnetwork", "problem", f"subnetwork {name} in {', '.join(missing)} does not exist",
                     f"create it (gcloud compute networks subnets create {name} --network {_last(target.network)} "
                     f"--region REGION --range 10.128.0.0/20 for each of {', '.join(missing)}), or name another "
                     "with --subnet/`subnet:`, or drop the zones there")
    return Check("subnetwork", "ok", f"subnetwork {name} in {', '.join(target.regions)} exists")


def _service_account(clients: Clients, target: Target) -> Check:
    email = (bucket.default_service_account(clients) if target.service_account == "default"
             else target.service_account)

    try:
        waits.call(lambda: clients.get_json("iam", f"v1/projects/-/serviceAccounts/{email}"),
                   what=f"read service account {email}")
    except TpuctlError as exc:
        if not isinstance(exc.__cause__, gexc.NotFound):
            raise
        fix = (f"enable the Compute Engine API (it creates {email}): gcloud services enable compute.googleapis.com "
               f"--project {clients.project}" if target.service_account == "default"
               else f"create it, or pass --service-account with one that exists")
        return Check("service-account", "problem", f"service account {email} does not exist", fix)
    return Check("service-account", "ok", f"service account {email} exists")


def permissions_for(target: Target) -> tuple[str, ...]:
    """What `up` and `down` of `target` need on the project: a TPU sold as a Compute Engine machine type needs
    Compute Engine's permissions (a multi-host one its MIG's too) instead of the TPU API's, a queued or Cloud
    TPU flex-start one the queued-resource permissions."""
    from tpuctl.provision import shapes

    tpu = shapes.for_tpu(target.accelerator, target.provisioning, target.slices)
    return tuple(dict.fromkeys((*tpu.permissions, *PERMISSIONS, *(shapes.VM.permissions if target.vms else ()))))


def _permissions(clients: Clients, target: Target) -> Check:
    wanted = permissions_for(target)
    resp = waits.call(lambda: clients.projects.test_iam_permissions(
        request={"resource": f"projects/{clients.project}", "permissions": list(wanted)}),
        what=f"test your permissions on project {clients.project}")
    missing = [p for p in wanted if p not in set(resp.permissions)]
    if missing:
        return Check("permissions", "problem", f"missing on project {clients.project}: {', '.join(missing)}",
                     "ask for TPU Admin, Storage Admin and Service Account User (and Compute Instance Admin for VMs "
                     "and TPU7x) on the project", tuple(missing))
    return Check("permissions", "ok", f"{len(wanted)} permissions held")


def _external_ips(clients: Clients, target: Target) -> Check:
    if target.internal_ips:
        return Check("external-ips", "ok", "not used: workers get internal IPs only (run tpuctl from inside the VPC)")
    # The Org Policy API is often disabled or unreadable to the caller: then the check is unknown (see `checks`).
    policy = waits.call(lambda: clients.get_json(
        "orgpolicy", f"v2/projects/{clients.project}/policies/{EXTERNAL_IP_CONSTRAINT}:getEffectivePolicy"),
        what=f"read the organization policy {EXTERNAL_IP_CONSTRAINT}")
    rules = (policy.get("spec") or {}).get("rules") or []
    if any(r.get("denyAll") or (r.get("values") or {}).get("allowedValues") for r in rules):
        return Check("external-ips", "problem", f"the organization policy constraints/{EXTERNAL_IP_CONSTRAINT} denies "
                     "external IPs to new VMs", "pass --internal-ips (`internal_ips: true`) and run tpuctl from inside "
                     "the VPC, or ask for an exception to the constraint")
    return Check("external-ips", "ok", "external IPs allowed")


def _os_login(clients: Clients, target: Target) -> Check:
    meta = oslogin.project_metadata(clients)
    problem = oslogin.unusable(clients, meta)
    if problem:
        return Check("os-login", "problem", problem, oslogin.fix_for(problem))
    if oslogin.enabled(meta):
        return Check("os-login", "ok", f"on: tpuctl logs in as {clients.account}'s OS Login user")
    return Check("os-login", "ok", "off: keys go into the TPU's ssh-keys metadata")


def _tpu_quota(clients: Clients, target: Target) -> Check:
    acc = target.accelerator
    wanted = quota_checks(acc, target.provisioning, target.zones, target.slices)
    if not wanted:
        return Check("tpu-quota", "unknown", f"not checked: no known quota for {acc.name}")
    infos: dict[str, dict] = {}
    for quota in dict.fromkeys(q for w in wanted for q in w.quotas):
        path = f"v1/projects/{clients.project}/locations/global/services/{wanted[0].service}/quotaInfos/{quota}"
        try:
            infos[quota] = waits.call(lambda p=path: clients.get_json("cloudquotas", p), what=f"read the quota {quota}")
        except TpuctlError as exc:
            # Reading quota is optional: the create itself reports a quota it meets (exit 3).
            return Check("tpu-quota", "unknown", f"not checked: {exc.message}",
                         f"to have it checked before create: gcloud services enable cloudquotas.googleapis.com "
                         f"--project {clients.project}, and roles/cloudquotas.viewer")
    need, names = wanted[0].need, " or ".join(wanted[0].quotas)
    # Per zone, the limit of each quota the create may draw on (None: unlimited); it fits if any has room.
    limits = {w.zone: [limit_in(infos[q], d) for q, d in zip(w.quotas, w.dimensions)] for w in wanted}
    short = [w for w in wanted if all(n is not None and n < need for n in limits[w.zone])]
    shown = ", ".join(f"{z} {'/'.join('unlimited' if n is None else str(n) for n in ns)}" for z, ns in limits.items())
    if len(short) == len(wanted):
        where = ", ".join(dict.fromkeys(w.where for w in short))
        return Check("tpu-quota", "problem", f"{acc.name} needs {need} of quota {names}; its limit is {shown}",
                     f"raise {names} in {where} on the Quotas page, {QUOTAS_PAGE}?project={clients.project} "
                     f"({QUOTA_DOCS[wanted[0].service]}), or pick a smaller type or another zone", wanted[0].quotas)
    note = f" (not enough in {', '.join(w.zone for w in short)})" if short else ""
    return Check("tpu-quota", "ok", f"{names}: {shown} for {need} needed{note}")


def checks(clients: Clients, target: Target) -> list[Check]:
    """Every check, run concurrently; a check that could not be made at all fails with the reason. Read-only."""
    fns: list[tuple[str, Callable[[Clients, Target], Check]]] = [
        ("apis", _apis), ("network", _network), ("service-account", _service_account),
        ("permissions", _permissions), ("external-ips", _external_ips), ("os-login", _os_login)]
    if target.accelerator is not None and target.zones:
        fns.append(("tpu-quota", _tpu_quota))
    if target.region:
        fns.insert(2, ("subnetwork", _subnetwork))

    def run(name: str, fn: Callable[[Clients, Target], Check]) -> Check:
        # A check that cannot be made (no permission to read it, an API error after retries) does not stop a
        # run that may well work: the create itself would say what is wrong.
        try:
            return fn(clients, target)
        except TpuctlError as exc:
            return Check(name, "unknown", f"not checked: {exc.message}", exc.hint)

    with ThreadPoolExecutor(max_workers=len(fns), thread_name_prefix="preflight") as pool:
        results = list(pool.map(lambda nf: run(*nf), fns))
    apis = results[0]
    disabled = set(apis.missing)
    return [Check(c.name, "unknown", f"not checked: it needs {NEEDS[c.name]}, which is disabled", apis.fix)
            if c.status != "ok" and NEEDS.get(c.name) in disabled else c for c in results]


def failure(project: str, results: list[Check]) -> TpuctlError | None:
    """The error the failed checks amount to: QuotaError (exit 3) when quota is all that is missing, else
    PreflightFailed (exit 2) naming every failed check and its fix; None when none failed."""
    failed = [c for c in results if not c.ok]
    if not failed:
        return None
    message = f"project {project} is not ready: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)
    hint = "; ".join(c.fix for c in failed if c.fix)
    if all(c.name == "tpu-quota" for c in failed):
        return QuotaError(message, field="accelerator", hint=hint)
    return PreflightFailed(message, field="project", hint=hint)


def require(clients: Clients, target: Target) -> list[Check]:
    """`checks`, raising `failure`'s error when any check fails. Read-only."""
    results = checks(clients, target)
    error = failure(clients.project, results)
    if error is not None:
        raise error
    return results
