"""What TPUs exist, where, with which runtimes, and what they cost.

The embedded data (`catalog_data.json`) carries its own `as_of` date and sources; `tpuctl catalog refresh`
pulls current prices from the Cloud Billing Catalog API into `tpuctl.paths.catalog_cache()`, and `load()`
lays that cache over the embedded prices. Shapes (chips, cores, hosts, topology) are computed from a few
per-generation rules rather than listed, so the rules are written once and tested once.

Prices a table lacks (a region without a sampled price) are estimated with the highest price known for the
generation: a cost estimate may err high, never low. Multi-host v2/v3 slices bill Google's separate pod SKUs
where the table has them (`pod`). Each generation's figures name their source and date (`price_sources`).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from tpuctl import paths
from tpuctl.errors import BadInput, CloudError, from_google

# Billing Catalog service ids: Cloud TPU (v2/v3/v4) and Compute Engine (where v5e/v5p/v6e SKUs live).
TPU_SERVICE = "services/E000-3F24-B8AA"
COMPUTE_SERVICE = "services/6F81-5844-456A"

# SKU description token -> generation. v2/v3/v4 SKUs not described as per chip are priced per 8-core
# device (4 chips), as the older catalog entries are.
_SKU_GENERATIONS = (("tpuv5e", "v5e"), ("tpuv5p", "v5p"), ("tpuv6e", "v6e"), ("tpu7x", "tpu7x"),
                    ("tpu-v2", "v2"), ("tpu-v3", "v3"), ("tpu-v4", "v4"))
_CHIPS_PER_DEVICE_SKU = {"v2": 4, "v3": 4, "v4": 4}
# v2/v3 multi-host slices bill separate "Pod" SKUs; every v4 slice is a pod slice and v4 is sold by pod SKUs only
# (cloud.google.com/tpu/pricing: "With Cloud TPU v4, all configurations consist of Pod slices").
_POD_PRICED = ("v2", "v3")
# TPU VM images with TensorFlow are named tpu-vm-tf-X.Y.Z[-pod][-pjrt|-se] (cloud.google.com/tpu/docs/runtimes).
TF_RUNTIME_PREFIX = "tpu-vm-tf-"


@dataclass(frozen=True)
class AcceleratorType:
    """One TPU slice shape, e.g. v3-8: 4 chips, 8 TensorCores, 1 host, topology 2x2."""

    name: str
    generation: str
    api_type: str  # tpu_v2.AcceleratorConfig.Type enum NAME
    chips: int
    cores: int
    hosts: int  # TPU VM workers in the slice; every one runs the job
    topology: str
    zones: tuple[str, ...]
    runtimes: tuple[str, ...]
    default_runtime: str
    tensorflow: bool = True  # Google runs TensorFlow on this generation (none from v6e on)
    # Which API provisions it: "tpu-v2" (Cloud TPU API nodes) or "compute" (Compute Engine machine types, TPU7x+).
    api: str = "tpu-v2"
    machine_type: str | None = None  # the Compute Engine machine type of one host, for api == "compute"
    provisioning: tuple[str, ...] = ("on-demand", "spot", "preemptible", "queued")
    # Where flex-start is sold, when Google limits it to some of the type's zones (Cloud TPU API types); () = all.
    flex_start_zones: tuple[str, ...] = ()
    # Zones Google lists for single tenants only (not for general use): offered, and shown as such.
    single_tenant_zones: tuple[str, ...] = ()

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def boots_os_image(self) -> bool:
        """Its "runtime" is an OS image into which jax[tpu] is pip-installed: Compute Engine TPUs (TPU7x) boot an
        accelerator OS image (cloud.google.com/tpu/docs/tpu7x: JAX and PyTorch only), where the Cloud TPU API's
        nodes boot a TPU runtime."""
        return self.api == "compute"

    @property
    def usable_runtimes(self) -> tuple[str, ...]:
        """The runtimes a job runs on: every one where Google runs TensorFlow; from v6e on, the API still accepts
        the `tpu-vm-tf-*` images (localcloud/README.md, "Runtime images") but TensorFlow does not start on them."""
        return self.runtimes if self.tensorflow else tuple(
            r for r in self.runtimes if not r.startswith(TF_RUNTIME_PREFIX))


@dataclass(frozen=True)
class Price:
    on_demand: float
    spot: float | None
    pod: Price | None = None  # what a multi-host slice bills per chip, where Google prices pods apart (v2, v3)

    @classmethod
    def from_json(cls, p: Mapping[str, Any]) -> Price:
        return cls(p["on_demand"], p.get("spot"), cls.from_json(p["pod"]) if p.get("pod") else None)

    def per_chip(self, *, spot: bool, pod: bool) -> float:
        """Spot falls back to on-demand where no spot price is known, a pod to the single-device price:
        both err high or are exact."""
        if pod and self.pod is not None:
            return self.pod.per_chip(spot=spot, pod=False)
        return self.spot if spot and self.spot is not None else self.on_demand


def region_of(zone: str) -> str:
    """`us-central1-b` -> `us-central1`; a region passes through unchanged."""
    parts = zone.split("-")
    if len(parts) >= 3 and len(parts[-1]) == 1:
        return "-".join(parts[:-1])
    return zone


def nearest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The closest valid choices to a mistyped value (difflib), or the first few when nothing is close."""
    options = list(dict.fromkeys(choices))
    # A choice that extends what was typed (a runtime missing its suffix) beats any edit-distance guess.
    extended = [o for o in options if o.startswith(word) and o != word]
    close = difflib.get_close_matches(word, options, n=n, cutoff=0.4)
    return list(dict.fromkeys(extended + close))[:n] or options[:n]


def _did_you_mean(choices: list[str]) -> str:
    return "did you mean " + ", ".join(choices) + "?" if choices else ""


def topology(chips: int, dims: int) -> str:
    """Chip grid of a slice: start from 1x1(x1), double the smallest dimension (the rightmost on ties).

    Matches the published shapes: v3-32 4x4, v2-256 8x16, v4-16 2x2x2, v4-64 2x4x4, v5litepod-8 2x4.
    Two published exceptions: a 4-chip 3-D slice is written 2x2x1, and v5p-12288 (6144 chips) is 16x16x24.
    """
    if dims == 3 and chips == 4:
        return "2x2x1"
    if dims == 3 and chips == 6144:
        return "16x16x24"
    grid = [1] * dims
    while _prod(grid) < chips:
        i = max(k for k, v in enumerate(grid) if v == min(grid))
        grid[i] *= 2
    if _prod(grid) != chips:
        raise ValueError(f"{chips} chips do not tile a {dims}-D torus")
    return "x".join(map(str, grid))


def _prod(xs: Iterable[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


class Catalog:
    """Accelerator types, zones, runtimes and prices; immutable once loaded."""

    def __init__(self, data: Mapping[str, Any], *, prices_from: str | None = None,
                 refreshed: frozenset[str] = frozenset()):
        self._data = data
        self._refreshed = refreshed  # generations whose prices the refresh cache overlaid
        self.as_of: str = data["as_of"]
        self.source: str = "; ".join(data["sources"]) if prices_from is None else (
            f"prices: {prices_from}; shapes and runtimes: embedded catalog as of {data['as_of']}")
        self.prices_from = prices_from or f"embedded catalog as of {data['as_of']}"
        self._types = {t.name: t for t in self._build_types()}

    def _build_types(self) -> Iterable[AcceleratorType]:
        for gen, g in self._data["generations"].items():
            for n in g["sizes"]:
                chips = n // g["cores_per_chip"] if g["name_counts"] == "cores" else n
                hosts = max(1, chips // g["chips_per_host"])
                yield AcceleratorType(
                    name=f"{g['prefix']}-{n}", generation=gen, api_type=g["api_type"], chips=chips,
                    cores=chips * g["cores_per_chip"], hosts=hosts, topology=topology(chips, g["topology_dims"]),
                    # `pod_zones`: where a generation's multi-host slices are offered, when that is fewer zones
                    zones=tuple(g["pod_zones"] if hosts > 1 and "pod_zones" in g else g["zones"]),
                    runtimes=tuple(g["runtimes"]),
                    default_runtime=g["default_runtime_pod"] if hosts > 1 else g["default_runtime"],
                    tensorflow=g.get("tensorflow", True), api=g.get("api", "tpu-v2"),
                    machine_type=g.get("machine_type"),
                    provisioning=tuple(g.get("provisioning", AcceleratorType.provisioning)),
                    flex_start_zones=tuple(g.get("flex_start_zones", ())),
                    single_tenant_zones=tuple(g.get("single_tenant_zones", ())))

    # -- shapes ---------------------------------------------------------------------------------------------

    def accelerators(self) -> list[AcceleratorType]:
        return list(self._types.values())

    def for_machine_type(self, machine_type: str, hosts: int = 1) -> AcceleratorType | None:
        """The Compute Engine TPU type whose hosts are `machine_type` VMs, `hosts` of them (None: not a TPU)."""
        return next((t for t in self._types.values() if t.machine_type == machine_type and t.hosts == hosts), None)

    def generations(self) -> list[str]:
        return list(self._data["generations"])

    def accelerator(self, name: str) -> AcceleratorType:
        """The type named `name`; BadInput(field="accelerator") with the nearest names otherwise."""
        t = self._types.get(str(name).strip().lower())
        if t is None:
            raise BadInput(f"unknown accelerator type {name!r}; {_did_you_mean(nearest(str(name), self._types))}",
                           field="accelerator", hint="list the valid types with `tpuctl catalog list`")
        return t

    def check_zone(self, zone: str) -> None:
        """BadInput(field="zone") with the nearest zones when no TPU type is offered in `zone` at all (a zone
        without a type to check it against: `check` names the zones of the type)."""
        offered = [z for t in self._types.values() for z in t.zones]
        if zone not in offered:
            raise BadInput(f"no TPU type is offered in zone {zone!r}; {_did_you_mean(nearest(zone, offered))}",
                           field="zone", hint="`tpuctl catalog show TYPE` lists the zones offering a type")

    def tensorflow_types(self) -> list[str]:
        """Generations that run TensorFlow, for hints."""
        return [gen for gen in self.generations() if self._data["generations"][gen].get("tensorflow", True)]

    def check(self, accelerator: str, zone: str, runtime_version: str | None,
              framework: str | None = None) -> AcceleratorType:
        """Validate a (type, zone, runtime) triple as `up` will send it; returns the type.

        Raises BadInput naming the field at fault ("accelerator", "zone", "runtime_version") and the nearest
        valid choices. A multi-host slice needs the `-pod` TensorFlow runtime where one exists (`-pod` on a
        single host is accepted: Google's own samples do that). With `framework="tensorflow"` (the job's
        template runs TensorFlow) a type Google runs no TensorFlow on and a runtime without TensorFlow (a
        base image) are refused too.
        """
        t = self.accelerator(accelerator)
        if framework == "tensorflow" and not t.tensorflow:
            raise BadInput(
                f"TensorFlow does not run on {t.generation} ({t.name}): Google supports no TensorFlow from v6e on "
                f"and its TensorFlow runtimes stop at 2.18: the job needs a JAX backend there; use a "
                f"{', '.join(self.tensorflow_types())} type",
                field="accelerator", hint="e.g. --accelerator v5litepod-8 or v3-8; `tpuctl catalog list` shows them")
        if zone not in t.zones:
            same_region = [z for z in t.zones if region_of(z) == region_of(zone)]
            choices = same_region or nearest(zone, t.zones)
            raise BadInput(f"{t.name} is not offered in zone {zone!r}; {_did_you_mean(choices)}", field="zone",
                           hint=f"zones offering {t.name}: {', '.join(t.zones)}")
        if runtime_version is not None:
            if runtime_version not in t.runtimes:
                raise BadInput(
                    f"runtime {runtime_version!r} does not run on {t.generation} ({t.name}); "
                    f"{_did_you_mean(nearest(runtime_version, t.runtimes))}",
                    field="runtime_version", hint=f"the default for {t.name} is {t.default_runtime}")
            if framework == "tensorflow" and not runtime_version.startswith(TF_RUNTIME_PREFIX):
                raise BadInput(
                    f"runtime {runtime_version!r} is a base image without TensorFlow, and the job's template "
                    f"runs TensorFlow only; use runtime {t.default_runtime} (or another {TF_RUNTIME_PREFIX}* "
                    f"runtime of {t.generation})", field="runtime_version",
                    hint=f"`tpuctl catalog show {t.name}` lists the runtimes that run on {t.name}")
            twin = _pod_twin(runtime_version)
            if t.multi_host and twin in t.runtimes:
                raise BadInput(
                    f"{t.name} has {t.hosts} hosts and needs the multi-host runtime; did you mean {twin}?",
                    field="runtime_version", hint=f"the default for {t.name} is {t.default_runtime}")
        return t

    # -- prices ---------------------------------------------------------------------------------------------

    @cached_property
    def _tpu_prices(self) -> dict[str, dict[str, Price]]:
        return {gen: {region: Price.from_json(p) for region, p in regions.items()}
                for gen, regions in self._data["tpu_prices_per_chip_hour"].items()}

    def tpu_prices(self, generation: str) -> dict[str, Price]:
        """Sampled per-chip-hour prices of a generation by region (after any refresh overlay)."""
        return dict(self._tpu_prices.get(generation, {}))

    def price_source(self, generation: str) -> str:
        """Where a generation's prices come from, with the date of the copy read."""
        embedded = self._data.get("price_sources", {}).get(generation, f"embedded catalog as of {self.as_of}")
        if generation in self._refreshed:
            return f"{self.prices_from}; regions it did not price: {embedded}"
        return embedded

    def chip_price_per_hour(self, generation: str, region: str, spot: bool, *, pod: bool = False) -> float:
        """USD per chip-hour; `pod` for a multi-host slice, which v2/v3 bill at their pod SKUs."""
        by_region = self._tpu_prices.get(generation)
        if not by_region:
            raise BadInput(f"no prices for TPU generation {generation!r}", field="accelerator")
        p = by_region.get(region)
        if p is None:
            # Unknown region: take the dearest known one so the estimate errs high.
            return max(x.per_chip(spot=spot, pod=pod) for x in by_region.values())
        return p.per_chip(spot=spot, pod=pod)

    def tpu_price_per_hour(self, accelerator: str, region: str, spot: bool) -> float:
        """USD per hour for the whole slice (chips x per-chip price)."""
        t = self.accelerator(accelerator)
        return t.chips * self.chip_price_per_hour(t.generation, region_of(region), spot, pod=t.multi_host)

    def vm_price_per_hour(self, machine_type: str, region: str) -> float:
        base = self._data["vm_prices_per_hour_us_central1"]
        if machine_type not in base:
            raise BadInput(f"no price for machine type {machine_type!r}; {_did_you_mean(nearest(machine_type, base))}",
                           field="machine_type", hint="small VMs suffice: e2-standard-2 or n1-standard-1")
        mult = self._data["vm_region_multiplier"]
        return base[machine_type] * mult.get(region_of(region), max(mult.values()))

    def vm_machine_types(self) -> list[str]:
        return list(self._data["vm_prices_per_hour_us_central1"])

    def disk_price_per_gb_month(self, disk_type: str = "pd-standard") -> float:
        return self._data["disk_price_per_gb_month"][disk_type]

    def storage_price_per_gb_month(self, region: str) -> float:
        table = self._data["storage_price_per_gb_month"]
        return table.get(region_of(region), max(table.values()))

    def to_json(self) -> dict[str, Any]:
        return {"as_of": self.as_of, "source": self.source, "prices_from": self.prices_from,
                "accelerators": [accelerator_json(t, self) for t in self.accelerators()]}


def accelerator_json(t: AcceleratorType, cat: Catalog) -> dict[str, Any]:
    """A type plus its prices, as `catalog list/show --json` prints it."""
    billed = {region: p.pod if t.multi_host and p.pod else p for region, p in cat.tpu_prices(t.generation).items()}
    prices = {region: {"on_demand": round(t.chips * p.on_demand, 4),
                       "spot": None if p.spot is None else round(t.chips * p.spot, 4)}
              for region, p in billed.items()}
    return {"name": t.name, "generation": t.generation, "api_type": t.api_type, "api": t.api,
            "machine_type": t.machine_type, "provisioning": list(t.provisioning),
            "flex_start_zones": list(t.flex_start_zones or (t.zones if "flex-start" in t.provisioning else ())),
            "chips": t.chips, "cores": t.cores,
            "hosts": t.hosts, "topology": t.topology, "zones": list(t.zones),
            "single_tenant_zones": list(t.single_tenant_zones), "runtimes": list(t.runtimes),
            "usable_runtimes": list(t.usable_runtimes),
            "default_runtime": t.default_runtime, "tensorflow": t.tensorflow, "price_per_hour_by_region": prices,
            "price_source": cat.price_source(t.generation)}


def _pod_twin(runtime: str) -> str | None:
    """`tpu-vm-tf-2.17.0-pjrt` -> `tpu-vm-tf-2.17.0-pod-pjrt`; None for pod and base images."""
    m = re.match(r"^(tpu-vm-tf-\d+\.\d+\.\d+)(?!-pod)(.*)$", runtime)
    return f"{m.group(1)}-pod{m.group(2)}" if m else None


def embedded_data() -> dict[str, Any]:
    return json.loads(resources.files("tpuctl").joinpath("catalog_data.json").read_text())


def load(cache: Path | None = None) -> Catalog:
    """The embedded catalog with the user's refreshed prices (if any) laid over it.

    A cache that cannot be read is ignored (the embedded prices still hold), never fatal.
    """
    data = embedded_data()
    cache = cache or paths.catalog_cache()
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        return Catalog(data)
    prices = data["tpu_prices_per_chip_hour"]
    refreshed = frozenset(gen for gen in cached.get("tpu_prices_per_chip_hour", {}) if gen in data["generations"])
    for gen in refreshed:
        by_region = prices.setdefault(gen, {})
        for region, p in cached["tpu_prices_per_chip_hour"][gen].items():
            by_region[region] = _overlay(by_region.get(region, {}), p)
    return Catalog(data, prices_from=f"{cached.get('source', 'Cloud Billing Catalog API')} "
                                     f"fetched {cached.get('fetched_at', '?')}", refreshed=refreshed)


def _overlay(prev: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A refreshed region price over the embedded one: each kind the SKUs priced wins, the rest stays."""
    out = {"on_demand": new.get("on_demand", prev.get("on_demand")), "spot": new.get("spot", prev.get("spot"))}
    if out["on_demand"] is None:  # a spot-only SKU for a region we had no price for
        out["on_demand"] = out["spot"]
    if new.get("pod") or prev.get("pod"):
        out["pod"] = _overlay(prev.get("pod") or {}, new.get("pod") or {})
    if out["on_demand"] is None and "pod" in out:  # pod SKUs only: the best estimate of a single device's price
        out["on_demand"], out["spot"] = out["pod"]["on_demand"], out["pod"]["spot"]
    return out


# -- refresh from the Cloud Billing Catalog API ------------------------------------------------------------


@dataclass(frozen=True)
class RefreshResult:
    path: Path
    skus_read: int
    prices: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)

    @property
    def prices_set(self) -> int:
        return sum(len(kinds) - ("pod" in kinds) + len(kinds.get("pod", {}))
                   for regions in self.prices.values() for kinds in regions.values())


def _sku_generation(description: str) -> str | None:
    d = description.lower().replace(" ", "")
    for token, gen in _SKU_GENERATIONS:
        if token in d:
            return gen
    return None


def prices_from_skus(skus: Iterable[Any]) -> tuple[int, dict[str, dict[str, dict[str, Any]]]]:
    """Per-chip-hour prices by generation, region and kind from billing SKUs (proto-plus `Sku` objects).

    Returns (SKUs read, prices). Only TPU SKUs count; VM SKUs are priced per vCPU and GB, not per machine
    type, so VM prices stay the embedded ones.

    v2/v3 "Pod" SKUs price their multi-host slices and land under `pod`; v4 is sold by pod SKUs only, which
    are its price.
    """
    out: dict[str, dict[str, dict[str, Any]]] = {}
    n = 0
    for sku in skus:
        n += 1
        desc = sku.description or ""
        gen = _sku_generation(desc)
        if gen is None or not sku.pricing_info:
            continue
        rates = sku.pricing_info[0].pricing_expression.tiered_rates
        if not rates:
            continue
        money = rates[0].unit_price
        price = (money.units or 0) + (money.nanos or 0) / 1e9
        if "chip" not in desc.lower():
            price /= _CHIPS_PER_DEVICE_SKU.get(gen, 1)
        kind = "spot" if ("preemptible" in desc.lower() or "spot" in desc.lower()) else "on_demand"
        pod = gen in _POD_PRICED and "pod" in desc.lower().replace("litepod", "")
        for region in sku.service_regions:
            entry = out.setdefault(gen, {}).setdefault(region, {})
            (entry.setdefault("pod", {}) if pod else entry)[kind] = round(price, 6)
    return n, out


def refresh(client: Any, *, cache: Path | None = None, source: str = "Cloud Billing Catalog API") -> RefreshResult:
    """Pull TPU prices with a `billing_v1.CloudCatalogClient` and write them to the user's cache atomically.

    Idempotent: a second refresh overwrites the cache with the same content. Blocks for the API calls.
    """
    from google.api_core import exceptions as gexc

    cache = cache or paths.catalog_cache()
    skus: list[Any] = []
    for service in (TPU_SERVICE, COMPUTE_SERVICE):
        try:
            skus.extend(client.list_skus(parent=service))
        except gexc.GoogleAPICallError as exc:
            raise from_google(exc, what=f"list billing SKUs of {service}") from exc
    n, prices = prices_from_skus(skus)
    if not prices:
        raise CloudError(f"the Billing Catalog returned {n} SKUs but none priced a TPU",
                         hint="the embedded prices stay in use; see `tpuctl catalog list`")
    record = {"fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "source": source,
              "tpu_prices_per_chip_hour": prices}
    write_json_atomic(cache, record)
    return RefreshResult(path=cache, skus_read=n, prices=prices)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write-then-rename so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
