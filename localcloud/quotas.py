"""TPU quota: the Cloud TPU API's per-zone quotas, served through the Cloud Quotas API (`quotaInfos.get`) and
enforced at create, from the project's shape (`tpu_quotas`). localcloud's own table, from Google's sources
(localcloud/README.md, "TPU quota"):

- quota ids are TPU{GEN}[Serving][Preemptible][Pod]PerProjectPerZoneForTPUAPI, GEN V2s/V3s/V4s/V5sLitepod/
  V5P/V6E: spot and preemptible nodes draw on the Preemptible quota, v2/v3 single devices (-8) and pods have
  separate quotas, every v4 slice is a pod slice, v5e slices of 1, 4 or 8 chips draw on the Serving quota;
- a node counts TensorCores for v2 and v3 (the number in its type's name), chips for v4 and v5p (half that
  number) and for v5e and v6e (the number: one TensorCore each);
- flex-start queued resources draw on the Preemptible quota like spot ones (tpu/docs/request-using-flex-start:
  "make sure that you have sufficient preemptible quota"; tpu/docs/consumption-options);
- TPUs sold as Compute Engine machine types (TPU7x) draw on Compute Engine's regional TPU quotas, in chips,
  served as service compute.googleapis.com (compute/resource-usage, "TPU quota"): on-demand VMs on
  TPUS-PER-TPU-FAMILY-per-project-region (dimension tpu_family), Spot and flex-start VMs on the generation's
  preemptible quota; a flex-start VM uses the standard quota when the preemptible one has no room
  (compute/docs/instances/provisioning-models);
- an unshaped project is fully set up, as everywhere in localcloud: every quota is GENEROUS (Google's own
  defaults are 16 on-demand and 48 preemptible TensorCores of v2-8/v3-8 and 0 of everything else).
"""

from __future__ import annotations

from . import facts
from .core import ApiError

SERVICE = "tpu.googleapis.com"
COMPUTE_SERVICE = "compute.googleapis.com"
GENEROUS = 100_000
# Compute Engine's TPU quotas (regional, chips): the standard one is shared by every TPU family and selected by
# its tpu_family dimension; each generation has its own preemptible one. generation -> (tpu_family, preemptible id)
FAMILY_QUOTA = "TPUS-PER-TPU-FAMILY-per-project-region"
COMPUTE_TPU = {"tpu7x": ("tpu7x", "PREEMPTIBLE-TPU7X-per-project-region")}
_GEN = {"v2": "V2s", "v3": "V3s", "v4": "V4s", "v5litepod": "V5sLitepod", "v5p": "V5P", "v6e": "V6E"}
_SERVING = {"v5litepod-1", "v5litepod-4", "v5litepod-8"}


def quota_id(accelerator_type: str, spot: bool) -> str | None:
    """The quota a node of `accelerator_type` draws on; None for types outside the table."""
    prefix, _, size = accelerator_type.partition("-")
    gen = _GEN.get(prefix)
    if gen is None or not size.isdigit():
        return None
    pre = "Preemptible" if spot else ""
    if prefix == "v5litepod":
        kind = ("Serving" if accelerator_type in _SERVING else "") + pre
    elif prefix in ("v2", "v3", "v4"):
        kind = pre + ("Pod" if prefix == "v4" or int(size) > 8 else "")
    else:
        kind = pre
    return f"TPU{gen}{kind}PerProjectPerZoneForTPUAPI"


def known_ids() -> set[str]:
    types = {f"{p}-{n}" for p in _GEN for n in (1, 4, 8, 16)}
    return {quota_id(t, spot) for t in types for spot in (False, True)} - {None}


def compute_quotas(generation: str, provisioning_model: str) -> tuple[str, ...]:
    """The Compute Engine quotas a TPU VM of `generation` may draw on, in the order Compute tries them: SPOT the
    preemptible one, FLEX_START the preemptible then the standard one, STANDARD the standard one; () for a
    generation outside the table."""
    if generation not in COMPUTE_TPU:
        return ()
    preemptible = COMPUTE_TPU[generation][1]
    return {"SPOT": (preemptible,), "FLEX_START": (preemptible, FAMILY_QUOTA)}.get(provisioning_model, (FAMILY_QUOTA,))


def units(accelerator_type: str) -> int:
    """What a node counts against its quota: v2/v3 TensorCores (the number in the name), v4 and v5p chips (the
    name counts TensorCores, two per chip), v5e/v6e chips (the number in the name)."""
    prefix, _, size = accelerator_type.partition("-")
    return int(size) // 2 if prefix in ("v4", "v5p") else int(size)


def limit(shape: dict, quota: str, where: str) -> int:
    """The project's limit of `quota` in `where` (a zone for the Cloud TPU API's quotas, a region for Compute
    Engine's): an int in the shape applies everywhere, a dict per zone or region."""
    value = (shape.get("tpu_quotas") or {}).get(quota, GENEROUS)
    if isinstance(value, dict):
        value = value.get(where, GENEROUS)
    return int(value)


def quota_info(project: str, quota: str, shape: dict, service: str = SERVICE) -> dict:
    """The QuotaInfo of `quota`: per-location entries first (most specific), then the one for every other
    location. Cloud TPU API quotas are per zone; Compute Engine's per region (the family quota also carries
    the tpu_family its limit is for: localcloud shapes only TPU7x's)."""
    compute = service == COMPUTE_SERVICE
    known = ({FAMILY_QUOTA} | {q for _, q in COMPUTE_TPU.values()}) if compute else known_ids()
    if quota not in known:
        raise ApiError("NOT_FOUND", f"QuotaInfo {quota} of service {service} was not found.")
    value = (shape.get("tpu_quotas") or {}).get(quota, GENEROUS)
    per_place = value if isinstance(value, dict) else {}
    everywhere = GENEROUS if isinstance(value, dict) else int(value)
    family = {"tpu_family": COMPUTE_TPU["tpu7x"][0]} if quota == FAMILY_QUOTA else {}
    infos = [{"dimensions": {"region": where, **family} if compute else {"region": facts.region_of(where), "zone": where},
              "details": {"value": str(int(n))}, "applicableLocations": [where]} for where, n in sorted(per_place.items())]
    places = {facts.region_of(z) for z in facts.all_zones()} if compute else set(facts.all_zones())
    infos.append({"dimensions": {}, "details": {"value": str(everywhere)},
                  "applicableLocations": sorted(places - set(per_place))})
    dimensions = ["region", *family] if compute else ["region", "zone"]
    return {"name": f"projects/{facts.project_number(project)}/locations/global/services/{service}/quotaInfos/{quota}",
            "quotaId": quota, "metric": f"{service}/{quota}", "service": service, "isPrecise": True,
            "containerType": "PROJECT", "dimensions": dimensions, "quotaDisplayName": quota,
            "metricUnit": "1", "quotaIncreaseEligibility": {"isEligible": True}, "isFixed": False,
            "dimensionsInfos": infos, "isConcurrent": False}


def exceeded(quota: str, zone: str | None, limit_value: int, *, project: str | None = None,
             service: str = SERVICE, details: bool = True) -> ApiError:
    """Google's refusal of a create past the quota: HTTP 429 RESOURCE_EXHAUSTED with a QuotaFailure naming
    it. A quota never granted reads as gcloud shows it ("Quota limit '...' has been exceeded. Limit: 0 in
    zone Z"); one used up as SkyPilot quotes it ("Quota '...' exhausted. Limit N in zone Z").

    The details follow google/rpc/error_details.proto and error_reason.proto: the violation's `quotaId` is the
    quota ("Also know as 'limit name'"), its `subject` the project the check failed on ("project:<Google
    developer project id>"); the ErrorInfo's reason for a resource quota is RESOURCE_QUOTA_EXCEEDED, with
    `consumer`, `service` and `quota_limit` as its examples carry them (the quota metric's name is not
    published for Cloud TPU, so it is left out)."""
    where = f" in zone {zone}" if zone else ""
    message = (f"Quota limit '{quota}' has been exceeded. Limit: 0{where}." if limit_value == 0
               else f"Quota '{quota}' exhausted. Limit {limit_value}{where}")
    violation = {"quotaId": quota, "description": message,
                 **({"subject": f"project:{project}"} if project else {}),
                 **({"quotaDimensions": {"zone": zone}} if zone else {})}
    info = {"service": service, "quota_limit": quota,
            **({"consumer": f"projects/{facts.project_number(project)}"} if project else {})}
    return ApiError("RESOURCE_EXHAUSTED", message, http=429, reason="rateLimitExceeded", details=[
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [violation]},
        {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "RESOURCE_QUOTA_EXCEEDED",
         "domain": "googleapis.com", "metadata": info}] if details else None)

def compute_exceeded(quota: str, region: str, limit_value: float) -> ApiError:
    """Compute Engine's refusal of an insert past a quota: HTTP 403 with `errors[].reason` "quotaExceeded" and
    "Quota 'Q' exceeded.  Limit: N in region R." (docs.cloud.google.com/docs/quotas/troubleshoot)."""
    return ApiError("PERMISSION_DENIED", f"Quota '{quota}' exceeded.  Limit: {float(limit_value)} in region {region}.",
                    reason="quotaExceeded")
