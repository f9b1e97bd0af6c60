"""Cloud Resource Manager v3 `projects.get` and the Cloud Billing v1 catalog (services, SKUs).

Any project id exists; its number is derived deterministically so the default compute service account
`NUMBER-compute@developer.gserviceaccount.com` is stable. The SKU list is small and priced from
localcloud's own facts table so `tpuctl catalog refresh` can be tested end to end.
"""

from __future__ import annotations

import hashlib
import re

from . import facts
from .core import ApiError, World
from .tpu import paginate

TPU_SERVICE = "E000-3F24-B8AA"
COMPUTE_SERVICE = "6F81-5844-456A"
STORAGE_SERVICE = "95FF-2EF5-5EA1"
SERVICES = {
    TPU_SERVICE: "Cloud TPU",
    COMPUTE_SERVICE: "Compute Engine",
    STORAGE_SERVICE: "Cloud Storage",
}
# How each generation's SKUs are described, and under which service they are listed (as on the real catalog).
_TPU_SKU = {
    "v2": (TPU_SERVICE, "Tpu-v2"), "v3": (TPU_SERVICE, "Tpu-v3"), "v4": (TPU_SERVICE, "Tpu-v4"),
    "v5e": (COMPUTE_SERVICE, "TpuV5e"), "v5p": (COMPUTE_SERVICE, "TpuV5p"), "v6e": (COMPUTE_SERVICE, "TpuV6e"),
}
_PROJECT_RE = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")


class AccountsService:
    name = "accounts"

    def __init__(self, world: World):
        self.w = world

    # ---------------------------------------------------------------------------------- resource manager
    def projects_get(self, p: dict, q: dict, body: None) -> dict:
        project = p["projectsId"]
        if project.isdigit():
            raise ApiError("PERMISSION_DENIED", f"Permission denied on resource project {project} (localcloud "
                           "derives numbers from ids and cannot look a number up).")
        if not _PROJECT_RE.match(project):
            raise ApiError("PERMISSION_DENIED", f"Permission denied on resource project {project}.")
        number = facts.project_number(project)
        return {"name": f"projects/{number}", "projectId": project, "state": "ACTIVE", "displayName": project,
                "parent": "organizations/0", "createTime": "2024-01-01T00:00:00.000Z",
                "etag": hashlib.sha1(project.encode()).hexdigest()[:16]}

    # ---------------------------------------------------------------------------------- billing catalog
    def services_list(self, p: dict, q: dict, body: None) -> dict:
        items = [{"name": f"services/{sid}", "serviceId": sid, "displayName": name,
                  "businessEntityName": "businessEntities/GCP"} for sid, name in SERVICES.items()]
        page, token = paginate(items, q.get("pageSize"), q.get("pageToken"))
        return {"services": page, **({"nextPageToken": token} if token else {})}

    def skus_list(self, p: dict, q: dict, body: None) -> dict:
        sid = p["servicesId"]
        if sid not in SERVICES:
            raise ApiError("NOT_FOUND", f"Service services/{sid} not found.")
        skus = [s for s in all_skus() if s["name"].startswith(f"services/{sid}/")]
        page, token = paginate(skus, q.get("pageSize"), q.get("pageToken"))
        return {"skus": page, **({"nextPageToken": token} if token else {})}


def _money(usd: float) -> dict:
    units = int(usd)
    return {"currencyCode": "USD", "units": str(units), "nanos": int(round((usd - units) * 1e9))}


def _sku(service: str, description: str, family: str, group: str, usage: str, region: str, usd: float,
         unit: str, unit_desc: str, base_unit: str, factor: float) -> dict:
    sku_id = hashlib.sha1(f"{service}/{description}".encode()).hexdigest()[:12].upper()
    sku_id = f"{sku_id[:4]}-{sku_id[4:8]}-{sku_id[8:12]}"
    return {
        "name": f"services/{service}/skus/{sku_id}", "skuId": sku_id, "description": description,
        "category": {"serviceDisplayName": SERVICES[service], "resourceFamily": family,
                     "resourceGroup": group, "usageType": usage},
        "serviceRegions": [region],
        "pricingInfo": [{
            "effectiveTime": "2026-11-01T00:00:00Z", "summary": "",
            "pricingExpression": {
                "usageUnit": unit, "usageUnitDescription": unit_desc, "baseUnit": base_unit,
                "baseUnitDescription": base_unit, "baseUnitConversionFactor": factor, "displayQuantity": 1,
                "tieredRates": [{"startUsageAmount": 0, "unitPrice": _money(usd)}],
            },
            "currencyConversionRate": 1,
        }],
        "serviceProviderName": "Google",
        "geoTaxonomy": {"type": "REGIONAL", "regions": [region]},
    }


def all_skus() -> list[dict]:
    """Every SKU localcloud sells: TPU chip-hours (on-demand and Preemptible), VMs, Standard storage."""
    out = []
    # v2/v3 multi-host slices have their own "Pod" SKUs (the billing copy's "Tpu-v2 Pod" / "Tpu-v3 Pod"; the exact
    # description wording here is inferred, per chip as the device SKUs are served).
    for table, kind in ((facts.TPU_PRICES, ""), (facts.TPU_POD_PRICES, " Pod")):
        for region, gens in sorted(table.items()):
            for gen, (on_demand, spot) in sorted(gens.items()):
                if gen not in _TPU_SKU:  # TPU7x: no published SKU was found; its meter price is an estimate
                    continue
                service, label = _TPU_SKU[gen]
                for usage, price, prefix in (("OnDemand", on_demand, ""), ("Preemptible", spot, "Preemptible ")):
                    if price is None:
                        continue
                    out.append(_sku(service, f"{prefix}{label}{kind} chip running in {region}", "Compute", "TPU",
                                    usage, region, price, "h", "hour", "s", 3600))
    for mt, (_, _, _, usd) in sorted(facts.MACHINE_TYPES.items()):
        for region in ("us-central1", "europe-west4"):
            out.append(_sku(COMPUTE_SERVICE, f"{mt} instance running in {region}", "Compute", mt.split("-")[0].upper(),
                            "OnDemand", region, usd, "h", "hour", "s", 3600))
    for region in sorted(facts.TPU_PRICES):
        out.append(_sku(STORAGE_SERVICE, f"Standard Storage {region}", "Storage", "RegionalStorage", "OnDemand",
                        region, facts.STORAGE_PRICE_PER_GB_MONTH, "GiBy.mo", "gibibyte month", "By.s",
                        2**30 * 3600 * 24 * 30.4375))
    return out
