"""What localcloud believes Google offers: accelerator types, zones, runtime versions, machine types, prices.

This table is localcloud's own (from /work/shared/tpu-facts.md, sampled 2026-11) and deliberately shares
no code or data with tpuctl's catalog: a wrong entry there is caught by this oracle, not mirrored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# tpu_v2.AcceleratorConfig.Type wire numbers are not contiguous; these are the proto's own.
API_TYPE = {"v2": "V2", "v3": "V3", "v4": "V4", "v5e": "V5LITE_POD", "v5p": "V5P", "v6e": "V6E"}

# Zones per generation: docs.cloud.google.com/tpu/docs/regions-zones as re-read on 2026-11-28 (the copy that lists
# TPU7x and AI zones). Zones only older copies list are gone (v5e us-east1-b/c, us-west4-b and Asia, v6e
# us-central1-a/c, v5p us-east1-d, v2-8/v3-8 us-central1-f): Google refuses them as any zone without the type.
# Europe's and Asia's zone names are the older copies' where the current copy's were not readable.
_V5E_ZONES = ("us-central1-a", "us-east5-a", "us-east5-b", "us-east5-c", "us-west4-a", "europe-west4-a", "europe-west4-b")
# Kept although the current copy omits them: zones an older copy marks single-tenant, not for general use (v5e
# us-east5-a/b/c, v5p us-east5-b/c, v6e us-east5-c). localcloud serves them as for a project Google admitted as
# a tenant there (inferred: no source shows how Google refuses a project that is not).
# v2 and v3 zones depend on the size (tpu/docs/regions-zones): v2-8 in us-central1-b, -c, europe-west4-a and
# asia-east1-c, v2-32 to v2-512 in us-central1-a and europe-west4-a; v3-8 in us-central1-a, -b and
# europe-west4-a, v3-32 to v3-2048 in europe-west4-a only.
_V2_8_ZONES = ("us-central1-b", "us-central1-c", "europe-west4-a", "asia-east1-c")
_V2_POD_ZONES = ("us-central1-a", "europe-west4-a")
_V3_8_ZONES = ("us-central1-a", "us-central1-b", "europe-west4-a")
_V3_POD_ZONES = ("europe-west4-a",)
ZONES_BY_GENERATION: dict[str, tuple[str, ...]] = {
    "v2": tuple(dict.fromkeys(_V2_8_ZONES + _V2_POD_ZONES)),
    "v3": _V3_8_ZONES,
    "v4": ("us-central2-b",),
    "v5e": _V5E_ZONES,
    "v5p": ("us-central1-a", "us-east5-a", "us-east5-b", "us-east5-c", "europe-west4-b"),
    "v6e": ("us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "us-east5-c", "europe-west4-a",
            "asia-northeast1-b"),
}

# Runtime versions (TPU software versions) the TPU API accepts per generation, and the software each image
# carries. Sources, in the order they were trusted:
# - cloud.google.com/tpu/docs/runtimes: the `tpu-vm-tf-x.y.z[-pod][-pjrt|-se]` naming, `-pod` for multi-host
#   slices, PJRT from TF 2.15 on; base images for JAX/PyTorch per generation (v2-alpha-tpuv6e, v2-alpha-tpuv5,
#   v2-alpha-tpuv5-lite, tpu-ubuntu2204-base); "starting with TPU v6e, TensorFlow is no longer supported";
#   TF runtimes stop at 2.18 (libtpu 1.12); the TF -> libtpu table.
# - cloud.google.com/tpu/docs/supported-tpu-versions (older copy): tpu-vm-tf-2.16.1-pjrt, 2.15.x-pjrt/-se,
#   tpu-vm-tf-2.14.1 and earlier (stream executor only).
# - GoogleCloudPlatform/python-docs-samples tpu/*.py: `tpu-vm-tf-2.17.0-pjrt` (v2-8, v3-8, queued
#   resources) and `v2-tpuv5-litepod` (v5litepod-4, spot and queued).
# - public gcloud scripts (e.g. a v5e/v6e TF test log): `tpu-vm-tf-2.18.0-pjrt-v5p-and-below` on v2-8,
#   `tpu-vm-tf-2.18.0-[pod-]pjrt-v5e-and-v6` and `tpu-vm-tf-2.16.1-pod-pjrt` on v5litepod-8/-16; the API
#   also CREATES v6e-4 with `tpu-vm-tf-2.16.1-pjrt` and `...-v5e-and-v6`, where TensorFlow then fails to find
#   or initialise the TPU: the API accepts TF images on v6e, TensorFlow does not run there.
# `tpu-vm-tf-2.18.0-pod-pjrt-v5p-and-below` is inferred from its single-host and v5e twins.
# The patch releases 2.15.1, 2.16.2 and 2.17.1 are in tpu/docs/runtimes' TF -> libtpu table ("each TensorFlow
# version has its own TPU software version"); their names follow the page's naming rule, as their twins'.
_TF_OLD = ("tpu-vm-tf-2.14.1", "tpu-vm-tf-2.14.1-pod")


def _tf_pjrt(*versions: str) -> tuple[str, ...]:
    return tuple(f"tpu-vm-tf-{v}{pod}-pjrt" for v in versions for pod in ("", "-pod"))


_TF_PJRT = _tf_pjrt("2.15.0", "2.15.1", "2.16.1", "2.16.2", "2.17.0", "2.17.1")
# Stream-executor images, v2 to v4 only ("TPU v5e and future TPU generations only support PJRT"): the releases
# tpu/docs/supported-tpu-versions names (`tpu-vm-tf-2.16.1-se` on the current copy, 2.15.0-se and 2.15.1-se on
# an older one), and their multi-host twins by its naming rule `tpu-vm-tf-x.y.z[-pod][-{device_api}]`.
_TF_SE = tuple(f"tpu-vm-tf-{v}{pod}-se" for v in ("2.15.0", "2.15.1", "2.16.1") for pod in ("", "-pod"))
_TF_218_V5P = ("tpu-vm-tf-2.18.0-pjrt-v5p-and-below", "tpu-vm-tf-2.18.0-pod-pjrt-v5p-and-below")
_TF_218_V5E = ("tpu-vm-tf-2.18.0-pjrt-v5e-and-v6", "tpu-vm-tf-2.18.0-pod-pjrt-v5e-and-v6")
RUNTIMES_BY_GENERATION: dict[str, tuple[str, ...]] = {
    "v2": (*_TF_OLD, *_TF_PJRT, *_TF_SE, *_TF_218_V5P, "tpu-ubuntu2204-base", "tpu-vm-base"),
    "v3": (*_TF_OLD, *_TF_PJRT, *_TF_SE, *_TF_218_V5P, "tpu-ubuntu2204-base", "tpu-vm-base"),
    # v2-alpha-tpuv4: the gcloud reference's queued-resources example (v4-8 in us-central2-b).
    "v4": (*_TF_OLD, *_TF_PJRT, *_TF_SE, *_TF_218_V5P, "tpu-ubuntu2204-base", "tpu-vm-v4-base", "v2-alpha-tpuv4"),
    "v5e": (*_TF_PJRT, *_TF_218_V5E, "v2-alpha-tpuv5-lite", "v2-tpuv5-litepod"),
    "v5p": (*_TF_PJRT, *_TF_218_V5P, "v2-alpha-tpuv5"),
    "v6e": (*_tf_pjrt("2.16.1", "2.16.2", "2.17.0", "2.17.1"), *_TF_218_V5E, "v2-alpha-tpuv6e"),
}
# Where TensorFlow runs at all (tpu/docs/runtimes: none from v6e on; TPU7x is JAX and PyTorch only).
TENSORFLOW_GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p")


@dataclass(frozen=True)
class Software:
    """What a runtime image carries, and what a local worker runs in its place.

    `keras` is the image's Keras: TF <= 2.15 bundles Keras 2 (`tf.keras`); from TF 2.16 `tensorflow`
    depends on `keras>=3` and the image holds the Keras 3 that pip resolved when it was built (not
    published: `local_keras` pins the release current when that TF shipped). `libtpu` says where the TPU
    library lives on the image.
    """

    python: str
    tensorflow: str | None
    keras: str | None
    local_keras: str | None
    libtpu: str
    libtpu_version: str | None
    source: str


_PY = "3.10"  # Ubuntu 22.04's python3 on every current TPU VM image (a v2-tpuv5-litepod VM reports 3.10)
_LIBTPU_PIP = "pip package libtpu (site-packages/libtpu/libtpu.so), a dependency of tensorflow-tpu / jax[tpu]"
_LIBTPU_LIB = "/lib/libtpu.so, installed with the image"
_DOC = "cloud.google.com/tpu/docs/runtimes"
# TF version -> (image Keras, local Keras pin, libtpu version). A patch release keeps its family's Keras
# requirement and local pin; its libtpu is the table's.
_TF_SOFTWARE = {
    "2.14.1": ("2.14.0 (Keras 2, tf.keras)", "2.14.0", "1.8.1", _LIBTPU_LIB),
    "2.15.0": ("2.15.0 (Keras 2, tf.keras)", "2.15.0", "1.9.0", _LIBTPU_PIP),
    "2.15.1": ("2.15.0 (Keras 2, tf.keras)", "2.15.0", "1.9.0", _LIBTPU_PIP),
    "2.16.1": ("3.x (keras>=3.0.0)", "3.1.1", "1.10.1", _LIBTPU_PIP),
    "2.16.2": ("3.x (keras>=3.0.0)", "3.1.1", "1.10.1", _LIBTPU_PIP),
    "2.17.0": ("3.x (keras>=3.2.0)", "3.4.1", "1.11.0", _LIBTPU_PIP),
    "2.17.1": ("3.x (keras>=3.2.0)", "3.4.1", "1.11.1", _LIBTPU_PIP),
    "2.18.0": ("3.x (keras>=3.5.0)", "3.6.0", "1.12.0", _LIBTPU_PIP),
}


def _software(runtime: str) -> Software:
    for tf, (keras, local_keras, libtpu_version, libtpu) in _TF_SOFTWARE.items():
        if runtime.startswith(f"tpu-vm-tf-{tf}"):
            return Software(_PY, tf, keras, local_keras, libtpu, libtpu_version,
                            f"{_DOC} (TF {tf}, libtpu {libtpu_version}); Keras from tensorflow {tf}'s requirements")
    return Software(_PY, None, None, None, "none until `pip install jax[tpu]` (or torch_xla) brings " + _LIBTPU_PIP,
                    None, f"{_DOC}: base image for JAX and PyTorch, no framework installed")


RUNTIME_SOFTWARE: dict[str, Software] = {r: _software(r) for rs in RUNTIMES_BY_GENERATION.values() for r in rs}


def runtimes_in_zone(zone: str) -> list[str]:
    """What `runtimeVersions.list` answers for a zone: every runtime of every generation offered there."""
    return sorted({r for gen, zones in ZONES_BY_GENERATION.items() if zone in zones for r in RUNTIMES_BY_GENERATION[gen]})


# USD per chip-hour: (on-demand, spot); None where the region does not sell that generation. Figures: Google's
# billing price list (Cloud Billing Catalog SKUs) as skypilot-org/skypilot-catalog catalogs/v8/gcp/vms.csv
# copies it (read 2026-11-28), v2/v3/v4 device SKUs divided by their 4 chips.
TPU_PRICES: dict[str, dict[str, tuple[float, float | None]]] = {
    "us-central1": {"v2": (1.125, 0.3375), "v3": (2.00, 0.51), "v5e": (1.20, 0.245), "v5p": (4.20, 0.836), "v6e": (2.70, 0.544)},
    "us-central2": {"v4": (3.22, 0.92)},
    "us-east1": {"v5e": (1.20, 0.245), "v5p": (4.20, 0.836), "v6e": (2.70, 0.544)},
    "us-east5": {"v5e": (1.20, 0.60), "v5p": (4.20, 1.68), "v6e": (2.70, 1.215)},
    "us-west4": {"v5e": (1.20, 0.48)},
    "europe-west4": {"v2": (1.2375, None), "v3": (2.20, 0.561), "v5e": (1.56, 0.445), "v5p": (4.2525, 1.348), "v6e": (2.97, 1.037)},
    "asia-east1": {"v2": (1.305, 0.3915)},
    "asia-northeast1": {"v5e": (1.541, 0.424), "v6e": (3.24, 0.944)},
}
# v2 and v3 multi-host slices bill apart, per chip, at the "Tpu-v2 Pod" / "Tpu-v3 Pod" SKUs (same copy; Google's
# older tpu/pricing page: "TPU Pod type pricing for clusters of TPU devices", separate from single devices).
TPU_POD_PRICES: dict[str, dict[str, tuple[float, float | None]]] = {
    "us-central1": {"v2": (1.50, 0.3825)},
    "europe-west4": {"v2": (1.50, 0.3825), "v3": (2.00, 0.66)},
}

# name -> (vCPUs, memory MB, shared core, USD/h on demand). One price for every region (simplification).
MACHINE_TYPES: dict[str, tuple[int, int, bool, float]] = {
    "n1-standard-1": (1, 3840, False, 0.0475),
    "n1-standard-2": (2, 7680, False, 0.095),
    "e2-small": (2, 2048, True, 0.0168),
    "e2-medium": (2, 4096, True, 0.0335),
    "e2-standard-2": (2, 8192, False, 0.067),
    "e2-standard-4": (4, 16384, False, 0.134),
    "e2-standard-8": (8, 32768, False, 0.268),
    "e2-standard-16": (16, 65536, False, 0.536),
}

STORAGE_PRICE_PER_GB_MONTH = 0.020


@dataclass(frozen=True)
class TpuMachineType:
    """A TPU sold as a Compute Engine machine type (not through the Cloud TPU API): one VM = one host."""

    name: str
    generation: str
    chips: int
    vcpus: int
    memory_mb: int
    zones: tuple[str, ...]
    provisioning_models: tuple[str, ...]  # Scheduling.provisioningModel values Compute accepts for it


# compute/docs/tpus/tpu-machines and tpu/docs/tpu7x (read 2026-11-23): TPU7x is only a Compute Engine machine
# type, 4 chips per VM with 224 vCPUs and 960 GB; us-central1-c is where Google's and practitioners' TPU7x and
# flex-start samples run.
TPU_MACHINE_TYPES: dict[str, TpuMachineType] = {
    "tpu7x-standard-4t": TpuMachineType("tpu7x-standard-4t", "tpu7x", 4, 224, 960 * 1024, ("us-central1-c",),
                                        ("STANDARD", "SPOT", "FLEX_START")),
}
# cloud.google.com/tpu/pricing lists TPU7x (Ironwood) in us-central1 (Iowa) at 12.00 per chip-hour on demand, as
# public notes quote it (retrieved 2026-09-24 and 2026-09-25); no source gives a spot price: 6.00 (half) is an
# estimate, the same figures tpuctl's catalog states; flex-start bills on-demand.
TPU_PRICES["us-central1"]["tpu7x"] = (12.00, 6.00)
# Flex-start VMs run for at most 7 days (tpu/docs/request-using-flex-start); maxRunDuration is at least 30 s.
FLEX_START_MAX_RUN_S = (30, 7 * 86400)
# How long a flex-start VM insert may wait for capacity (`params.requestValidForDuration`): "persist in a queue
# for up to two hours" (cloud.google.com/blog/products/compute/introducing-flex-start-vms-for-the-compute-engine-instance-api).
FLEX_START_MAX_WAIT_S = 2 * 3600
# Flex-start through the Cloud TPU API (queued resources, v2alpha1 provisioningModel FLEX_START): only these
# generations in these zones (tpu/docs/request-using-flex-start, "Limitations": v6e asia-northeast1-b and
# us-east5-a; v5e us-west4-a for training and us-central1-a for serving).
TPU_FLEX_START_ZONES: dict[str, tuple[str, ...]] = {
    "v6e": ("asia-northeast1-b", "us-east5-a"),
    "v5e": ("us-west4-a", "us-central1-a"),
}

# Cloud Storage locations (cloud.google.com/storage/docs/locations, 2026-11): multi-regions, predefined
# dual-regions, and regions. us-central2 is listed because it is where TPU v4 lives and Google's v4 guides
# create the training bucket there.
GCS_MULTI_REGIONS = frozenset({"US", "EU", "ASIA"})
GCS_DUAL_REGIONS = frozenset({"ASIA1", "EUR4", "EUR5", "EUR7", "EUR8", "NAM4"})
GCS_REGIONS = frozenset(r.upper() for r in (
    "northamerica-northeast1", "northamerica-northeast2", "northamerica-south1", "us-central1", "us-central2",
    "us-east1", "us-east4", "us-east5", "us-south1", "us-west1", "us-west2", "us-west3", "us-west4",
    "southamerica-east1", "southamerica-west1",
    "europe-central2", "europe-north1", "europe-north2", "europe-southwest1", "europe-west1", "europe-west2",
    "europe-west3", "europe-west4", "europe-west6", "europe-west8", "europe-west9", "europe-west10",
    "europe-west12",
    "asia-east1", "asia-east2", "asia-northeast1", "asia-northeast2", "asia-northeast3", "asia-south1",
    "asia-south2", "asia-southeast1", "asia-southeast2",
    "me-central1", "me-central2", "me-west1", "australia-southeast1", "australia-southeast2", "africa-south1",
))

# Soft delete (cloud.google.com/storage/docs/soft-delete): on by default for 7 days; a policy is 0 (off) or
# 7 to 90 days.
SOFT_DELETE_DEFAULT_S = 7 * 86400
SOFT_DELETE_MIN_S = 7 * 86400
SOFT_DELETE_MAX_S = 90 * 86400

# Which storage permissions each predefined role grants on a bucket (cloud.google.com/storage/docs/
# access-control/iam-roles; the legacy roles as google-cloud-storage's Java StorageRoles lists them).
# storage.buckets.get is in none of the object roles.
_OBJECT_ALL = ("storage.objects.create", "storage.objects.delete", "storage.objects.get", "storage.objects.list",
               "storage.objects.update", "storage.objects.getIamPolicy", "storage.objects.setIamPolicy")
STORAGE_ROLES: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    "roles/storage.admin": (*_OBJECT_ALL, "storage.buckets.get", "storage.buckets.update",
                            "storage.buckets.delete", "storage.buckets.getIamPolicy",
                            "storage.buckets.setIamPolicy"),
    "roles/storage.objectAdmin": _OBJECT_ALL,
    "roles/storage.objectUser": _OBJECT_ALL[:5],
    "roles/storage.objectCreator": ("storage.objects.create",),
    "roles/storage.objectViewer": ("storage.objects.get", "storage.objects.list"),
    "roles/storage.legacyBucketOwner": ("storage.buckets.get", "storage.buckets.update",
                                        "storage.buckets.getIamPolicy", "storage.buckets.setIamPolicy",
                                        "storage.objects.list", "storage.objects.create", "storage.objects.delete"),
    "roles/storage.legacyBucketWriter": ("storage.buckets.get", "storage.objects.list", "storage.objects.create",
                                         "storage.objects.delete"),
    "roles/storage.legacyBucketReader": ("storage.buckets.get", "storage.objects.list"),
    "roles/storage.legacyObjectOwner": ("storage.objects.get", "storage.objects.update",
                                        "storage.objects.getIamPolicy", "storage.objects.setIamPolicy"),
    "roles/storage.legacyObjectReader": ("storage.objects.get",),
}.items()}

_SIZES = {
    "v2": (8, 32, 128, 256, 512),
    "v3": (8, 32, 64, 128, 256, 512, 1024, 2048),
    "v4": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
    "v5e": (1, 4, 8, 16, 32, 64, 128, 256),
    "v5p": (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6144, 12288),
    "v6e": (1, 4, 8, 16, 32, 64, 128, 256),
}
_PREFIX = {"v2": "v2", "v3": "v3", "v4": "v4", "v5e": "v5litepod", "v5p": "v5p", "v6e": "v6e"}


@dataclass(frozen=True)
class TpuType:
    name: str
    generation: str
    chips: int
    cores: int
    hosts: int
    topology: str

    @property
    def api_type(self) -> str:
        return API_TYPE[self.generation]

    @property
    def zones(self) -> tuple[str, ...]:
        """Where the type is offered: per generation, except v2 and v3, whose slices are in fewer zones."""
        if self.generation in ("v2", "v3"):
            single = _V2_8_ZONES if self.generation == "v2" else _V3_8_ZONES
            return single if self.hosts == 1 else (_V2_POD_ZONES if self.generation == "v2" else _V3_POD_ZONES)
        return ZONES_BY_GENERATION[self.generation]

    @property
    def runtimes(self) -> tuple[str, ...]:
        return RUNTIMES_BY_GENERATION[self.generation]


def _topology(chips: int, dims: int) -> str:
    if dims == 2:
        a = 2 ** int(math.log2(chips) // 2)
        return f"{a}x{chips // a}"
    if chips <= 4:
        return "2x2x1"
    shape = [2, 2, 1]
    while math.prod(shape) < chips:
        shape[shape.index(min(shape))] *= 2
    return "x".join(map(str, sorted(shape)))


def _build() -> dict[str, TpuType]:
    out = {}
    for gen, sizes in _SIZES.items():
        for n in sizes:
            if gen in ("v5e", "v6e"):
                chips, cores, per_host, dims = n, n, 8, 2
            else:
                chips, cores, per_host, dims = n // 2, n, 4, 3 if gen in ("v4", "v5p") else 2
            hosts = max(1, chips // per_host)
            name = f"{_PREFIX[gen]}-{n}"
            out[name] = TpuType(name, gen, chips, cores, hosts, _topology(chips, dims))
    return out


TPU_TYPES: dict[str, TpuType] = _build()


def tpu_type_for_config(api_type: str, topology: str) -> TpuType | None:
    """The type an `acceleratorConfig {type, topology}` denotes, if any."""
    for t in TPU_TYPES.values():
        if t.api_type == api_type and t.topology == topology:
            return t
    return None


def all_zones() -> list[str]:
    return sorted({z for zs in ZONES_BY_GENERATION.values() for z in zs})


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def tpu_price(generation: str, region: str, spot: bool, *, pod: bool = False) -> float | None:
    """USD per chip-hour, or None where the region does not sell it; `pod` for a multi-host slice, which v2 and
    v3 bill at their pod SKUs."""
    pair = (pod and TPU_POD_PRICES.get(region, {}).get(generation)) or TPU_PRICES.get(region, {}).get(generation)
    if pair is None:
        return None
    return pair[1] if spot else pair[0]


def project_number(project_id: str) -> str:
    """A stable 12-digit project number for any project id (the real one is assigned at creation)."""
    import hashlib

    digest = int(hashlib.sha256(project_id.encode()).hexdigest(), 16)
    return str(100000000000 + digest % 900000000000)
