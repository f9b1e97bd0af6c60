"""The run spec: one YAML file (or flags alone) describing what to provision and what to train.

`RunSpec` is strict (`extra="forbid"`): a misspelt key is an error naming the key, never silently ignored.
Legacy TPU Node requests (the v1 API, `tensorflow_version`) are recognised and refused with the reason:
Google retired TPU Nodes on 2025-04-15. With `migrate=True` they become the equivalent TPU VM request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tpuctl.errors import BadInput
from tpuctl.events import EventSink, Note, ignore

TPU_NODE_RETIRED = "2025-04-15"
PROVISIONING = ("on-demand", "spot", "preemptible", "queued", "flex-start")
SHARDINGS = ("auto", "data", "zero1", "fsdp")  # job.sharding, `--sharding`
# Flex-start VMs run for at most 7 days (tpu/docs/request-using-flex-start); Compute takes a maxRunDuration of
# at least 30 s (compute/docs/instances/limit-vm-runtime).
FLEX_START_MAX_RUN_S = (30.0, 7 * 86400.0)
# A flex-start request waits for capacity for at most 2 hours ("persist in a queue for up to two hours", Google's
# flex-start VM announcement); `valid_until` bounds it. Unset, a Compute Engine flex-start VM (TPU7x) waits
# 30 minutes: half of `up`'s one-hour deadline, leaving the rest for the VM to boot.
FLEX_START_MAX_WAIT_S = 2 * 3600.0
FLEX_START_WAIT_S = 1800.0
DEFAULT_TTL_S = 24 * 3600.0
# Cloud Storage soft delete retention: 0 or 7 to 90 days (cloud.google.com/storage/docs/soft-delete).
SOFT_DELETE_MIN_S = 7 * 86400
SOFT_DELETE_MAX_S = 90 * 86400

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SECONDS = re.compile(r"^\d+(?:\.\d+)?$")
_DURATION_PARTS = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
# Keys and values that only a legacy TPU Node request carries.
_LEGACY_KEYS = ("tensorflow_version", "tensorflowVersion", "tpu_node", "api_version")
# What a POSIX shell accepts as a variable name; anything else could not be exported on the workers.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENV_NAME_RULE = "use letters, digits and underscores, not starting with a digit"
PROFILE_STEPS = re.compile(r"^(\d+)\s*-\s*(\d+)$")  # job.profile, `--profile`: FIRST-LAST training steps
_LEGACY_RUNTIME = re.compile(r"^(\d+\.\d+(\.\d+)?|nightly|pytorch-[\d.]+|tpu-vm-base-legacy)$")


def bad_env_names(env: Mapping[str, str]) -> list[str]:
    return [k for k in env if not ENV_NAME.fullmatch(k)]


def parse_duration(value: Any) -> float:
    """`2h`, `90m`, `1h30m`, `1.5h`, `7d`, `45s`, or seconds (`3600`, as a number or as text) -> seconds.

    The one duration grammar of tpuctl: spec fields, TPUCTL_* variables and flags all come through here, so a
    value that works in one place works in all. Zero is refused with its own reason (it would mean "already
    over"), and so are a fraction of a second and anything negative or not a duration; ValueError says which.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and _SECONDS.fullmatch(text := value.strip().lower().replace(" ", "")):
        seconds = float(text)
    elif isinstance(value, str) and text and _DURATION_PARTS.sub("", text) == "":
        seconds = sum(float(n) * _UNITS[u] for n, u in _DURATION_PARTS.findall(text))
    else:
        raise ValueError(f"{value!r} is not a duration; write e.g. 2h, 90m, 1d12h or 3600 (seconds)")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{value!r} is not a duration; write e.g. 2h, 90m, 1d12h or 3600 (seconds)")
    whole = round(seconds)
    # A duration is whole seconds, as format_duration writes it back: rounding a fraction would silently change
    # it (1.5 -> 2s) or make it zero (0.4s). The tolerance absorbs float arithmetic (1.1h is 3960.0000000000005).
    if abs(seconds - whole) > 1e-6:
        raise ValueError(f"{value!r} is not a whole number of seconds; write e.g. 2s, 90s or 1m30s")
    if whole == 0:
        raise ValueError(f"{value!r} is zero: it would be over before anything started; give a positive "
                         "duration such as 2h")
    return float(whole)


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"


def _normal_duration(value: Any) -> Any:
    return format_duration(parse_duration(value)) if value is not None else None


# Kept as text ("2h") so every reader sees what the user wrote, normalised; `*_s` properties give seconds.
Duration = Annotated[str, BeforeValidator(_normal_duration)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VmSpec(_Strict):
    name: str
    machine_type: str = "e2-standard-2"
    disk_gb: int = Field(default=20, ge=10, le=65536)
    image: str = "projects/debian-cloud/global/images/family/debian-12"


class DataSpec(_Strict):
    corpus: list[str] = Field(default_factory=list)  # paths, globs or gs:// urls
    vocab_size: int = Field(default=8000, ge=100)
    seq_len: int = Field(default=128, ge=8)
    lowercase: bool = True

    @field_validator("corpus", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class JobSpec(_Strict):
    template: str = "bert"  # a name under templates/, or a local directory
    preset: str | None = None  # e.g. "bert-tiny"
    config: dict[str, Any] = Field(default_factory=dict)  # overrides passed to the template
    data: DataSpec = Field(default_factory=DataSpec)
    args: list[str] = Field(default_factory=list)
    max_recoveries: int = Field(default=3, ge=0)
    env: dict[str, str] = Field(default_factory=dict)
    # auto: TensorFlow where Google ships it (v2-v5p) and the template offers it, else JAX (tpuctl.frameworks)
    framework: Literal["auto", "tensorflow", "jax"] = "auto"
    # data: every device holds all the weights; zero1: so do they, but the optimizer state is split over the
    # devices; fsdp: weights, gradients and optimizer state split over them (zero1 and fsdp JAX only: the
    # template's runtime.sharding); auto: the first of data, zero1, fsdp that fits the chip's HBM
    # (tpuctl.fitting, the template's step compiled or estimated)
    sharding: Literal[SHARDINGS] = "auto"
    # "FIRST-LAST" (e.g. "100-110"): a profiler trace of those steps on worker 0, into the run's TensorBoard
    # directory (the template's runtime.profile; it checks the range against its max_steps)
    profile: str | None = None

    @field_validator("profile", mode="before")
    @classmethod
    def _step_range(cls, v: Any) -> Any:
        if v is None:
            return v
        m = PROFILE_STEPS.fullmatch(str(v).strip())
        if not m:
            raise ValueError(f"{v!r} is not a range of steps; write FIRST-LAST, e.g. 100-110")
        first, last = int(m[1]), int(m[2])
        if not 1 <= first <= last:
            raise ValueError(f"{v!r} is not a range of steps: FIRST must be at least 1 and at most LAST; write "
                             f"e.g. {min(first, last) or 1}-{max(first, last)}")
        return f"{first}-{last}"

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = bad_env_names(env)
        if bad:
            raise ValueError(f"environment variable name(s) {bad!r} are not valid: {ENV_NAME_RULE}")
        return env


class SupervisorSpec(_Strict):
    # The service account a detached run's supervisor VM runs as; None: tpuctl-supervisor@PROJECT, which tpuctl
    # creates when missing (provision/supervisor_account.py).
    service_account: str | None = None


class RunSpec(_Strict):
    name: str | None = None
    project: str | None = None
    zones: tuple[str, ...] = ()  # failover order; `zone:` in YAML (a string, a list, or "a,b")
    accelerator: str | None = None
    runtime_version: str | None = None  # default: the catalog's per-generation choice
    provisioning: Literal["on-demand", "spot", "preemptible", "queued", "flex-start"] = "on-demand"
    valid_until: Duration | None = None  # queued and flex-start: give up waiting for capacity after this long
    max_run_duration: Duration | None = Field(default=None, validate_default=True)  # flex-start only (required there): Google deletes the TPU after it
    # Multislice: N slices of `accelerator` in one queued resource, JAX data parallel across them over DCN.
    slices: int = Field(default=1, ge=1)
    vms: list[VmSpec] = Field(default_factory=list)
    bucket: str = "auto"
    # Soft delete retention of a bucket tpuctl creates: 0s (off) or 7d to 90d, Google's allowed values. Google's
    # default is 7d, which bills every rotated checkpoint and a deleted bucket's bytes for 7 more days.
    bucket_soft_delete: str = "0s"
    service_account: str = "default"  # or an email
    network: str = "default"
    subnet: str | None = None
    tags: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    ttl: Duration = format_duration(DEFAULT_TTL_S)
    allow_cross_region: bool = False
    internal_ips: bool = False  # workers get no external address (org policy vmExternalIpAccess); reach them from the VPC
    job: JobSpec | None = None
    supervisor: SupervisorSpec = Field(default_factory=SupervisorSpec)  # of `run --detach`

    @model_validator(mode="before")
    @classmethod
    def _zone_alias(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "zone" in data:
            data = dict(data)
            zone = data.pop("zone")
            if "zones" in data:
                raise ValueError("give either zone or zones, not both")
            data["zones"] = zone
        if isinstance(data, Mapping) and isinstance(data.get("zones"), str):
            data = {**data, "zones": [z.strip() for z in data["zones"].split(",") if z.strip()]}
        return data

    @field_validator("zones")
    @classmethod
    def _distinct_zones(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v))

    @field_validator("bucket_soft_delete", mode="before")
    @classmethod
    def _soft_delete_retention(cls, v: Any) -> str:
        seconds = 0.0 if str(v).strip() in ("0", "0s", "0d", "off") else parse_duration(v)
        if seconds and not SOFT_DELETE_MIN_S <= seconds <= SOFT_DELETE_MAX_S:
            raise ValueError(f"{format_duration(seconds)} is not allowed: Google keeps soft-deleted objects for 0 "
                             "(off) or 7 to 90 days")
        return format_duration(seconds) if seconds else "0s"

    @field_validator("valid_until")
    @classmethod
    def _waiting_only(cls, v: str | None, info: ValidationInfo) -> str | None:
        provisioning = info.data.get("provisioning")
        if v is not None and provisioning not in ("queued", "flex-start"):
            raise ValueError("valid_until applies only to provisioning: queued or flex-start")
        if v is not None and provisioning == "flex-start" and parse_duration(v) > FLEX_START_MAX_WAIT_S:
            raise ValueError(f"valid_until {v} is longer than Google lets a flex-start request wait "
                             f"({format_duration(FLEX_START_MAX_WAIT_S)})")
        return v

    @field_validator("max_run_duration")
    @classmethod
    def _flex_start_only(cls, v: str | None, info: ValidationInfo) -> str | None:
        # A spec read for checks only (`tpuctl doctor`, see from_mapping's `partial`) needs no duration: no check
        # depends on it, and nothing is created from it.
        if v is None and info.data.get("provisioning") == "flex-start" and not (info.context or {}).get("partial"):
            raise ValueError("provisioning: flex-start needs max_run_duration (Google deletes the TPU when it ends)")
        if v is not None and info.data.get("provisioning") != "flex-start":
            raise ValueError("max_run_duration applies only to provisioning: flex-start")
        if v is not None:
            low, high = FLEX_START_MAX_RUN_S
            if not low <= parse_duration(v) <= high:
                raise ValueError(f"max_run_duration {v} is outside Google's limits for flex-start "
                                 f"({format_duration(low)} to {format_duration(high)})")
        return v

    @field_validator("vms")
    @classmethod
    def _distinct_vms(cls, v: list[VmSpec]) -> list[VmSpec]:
        names = [vm.name for vm in v]
        if len(names) != len(set(names)):
            raise ValueError("VM names must be distinct")
        return v

    @property
    def ttl_s(self) -> float:
        return parse_duration(self.ttl)

    @property
    def bucket_soft_delete_s(self) -> int:
        return 0 if self.bucket_soft_delete == "0s" else int(parse_duration(self.bucket_soft_delete))

    @property
    def valid_until_s(self) -> float | None:
        return None if self.valid_until is None else parse_duration(self.valid_until)

    @property
    def max_run_duration_s(self) -> float | None:
        return None if self.max_run_duration is None else parse_duration(self.max_run_duration)

    @property
    def spot(self) -> bool:
        return self.provisioning in ("spot", "preemptible")

    @property
    def queued(self) -> bool:
        return self.provisioning == "queued"


def with_framework(spec: RunSpec, framework: str | None) -> RunSpec:
    """`spec` with `job.framework` set (the `--framework` flag, which wins over the file); None keeps it."""
    if framework is None:
        return spec
    return spec.model_copy(update={"job": (spec.job or JobSpec()).model_copy(update={"framework": framework})})


def with_sharding(spec: RunSpec, sharding: str | None) -> RunSpec:
    """`spec` with `job.sharding` set (the `--sharding` flag, which wins over the file); None keeps it."""
    if sharding is None:
        return spec
    return spec.model_copy(update={"job": (spec.job or JobSpec()).model_copy(update={"sharding": sharding})})


def with_profile(spec: RunSpec, profile: str | None) -> RunSpec:
    """`spec` with `job.profile` set (the `--profile` flag, which wins over the file), validated; None keeps it."""
    if profile is None:
        return spec
    checked = from_mapping({"job": {"profile": profile}}).job.profile  # BadInput naming job.profile
    return spec.model_copy(update={"job": (spec.job or JobSpec()).model_copy(update={"profile": checked})})


def load(path: str | Path | None = None, *, overrides: Mapping[str, Any] | None = None,
         migrate: bool = False) -> RunSpec:
    """Read a spec file (optional) and apply `overrides` (already merged by precedence, see tpuctl.config)."""
    raw = dict(read_file(path)) if path is not None else {}
    raw.update(overrides or {})
    return from_mapping(raw, migrate=migrate)


def read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError as exc:
        raise BadInput(f"spec file {p} does not exist", field="spec", hint="give the path of a YAML run spec") from exc
    except yaml.YAMLError as exc:
        raise BadInput(f"{p} is not valid YAML: {exc}", field="spec") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BadInput(f"{p} must hold a mapping of spec fields, not {type(data).__name__}", field="spec")
    return data


def from_mapping(raw: Mapping[str, Any], *, migrate: bool = False, on_event: EventSink = ignore,
                 partial: bool = False) -> RunSpec:
    """Validate a mapping into a RunSpec; any problem is one BadInput naming the field.

    `partial`: the spec is only checked against a project, never created (`tpuctl doctor`), so a field that
    matters only at create (flex-start's max_run_duration) may be absent; every value given is still validated."""
    raw = migrate_legacy(raw, migrate=migrate, on_event=on_event)
    try:
        return RunSpec.model_validate(raw, context={"partial": partial})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "spec"
        if first["type"] == "extra_forbidden":
            known = ", ".join(sorted({*RunSpec.model_fields, "zone"} - {"zones"})) if len(first["loc"]) == 1 else ""
            raise BadInput(f"unknown field {loc!r}", field=loc,
                           hint=f"valid fields: {known}" if known else "remove it; see examples/bert-tiny.yaml") from exc
        msg = first["msg"].removeprefix("Value error, ")
        raise BadInput(msg, field=loc, hint=_HINTS.get(loc.split(".")[0], "see examples/bert-tiny.yaml")) from exc


_HINTS = {
    "provisioning": "one of: " + ", ".join(PROVISIONING),
    "ttl": "a duration such as 2h, 90m, 1d or 3600 (seconds)",
    "valid_until": "a duration such as 6h; only with provisioning: queued, or flex-start (at most 2h)",
    "max_run_duration": "a duration from 30s to 7d, e.g. 4h; only with provisioning: flex-start",
    "bucket_soft_delete": "0s (off, tpuctl's default) or 7d to 90d",
    "slices": "a whole number of slices, 1 (the default) or more for multislice",
}


def migrate_legacy(raw: Mapping[str, Any], *, migrate: bool, on_event: EventSink = ignore) -> dict[str, Any]:
    """Refuse (or, with `migrate`, translate) a legacy TPU Node request."""
    raw = dict(raw)
    legacy = [k for k in _LEGACY_KEYS if k in raw and not (k == "api_version" and str(raw[k]) == "v2")]
    runtime = raw.get("runtime_version")
    if isinstance(runtime, str) and _LEGACY_RUNTIME.fullmatch(runtime):
        legacy.append("runtime_version")
    if not legacy:
        raw.pop("api_version", None)
        return raw
    field = legacy[0]
    version = raw.get("tensorflow_version") or raw.get("tensorflowVersion") or (
        runtime if field == "runtime_version" else None)
    if not migrate:
        raise BadInput(
            f"this is a legacy TPU Node request ({field}={raw[field]!r}); Google retired TPU Nodes and the "
            f"v1 API on {TPU_NODE_RETIRED} and denies new ones", field=field,
            hint="add --migrate to create the equivalent TPU VM instead (runtime tpu-vm-tf-X.Y.Z, no driver VM)")
    for k in _LEGACY_KEYS:
        raw.pop(k, None)
    raw["runtime_version"] = None
    note = "legacy TPU Node request migrated to a TPU VM (no separate driver VM is needed)"
    if version and raw.get("accelerator"):
        chosen = nearest_tf_runtime(str(version), str(raw["accelerator"]))
        if chosen:
            raw["runtime_version"] = chosen
            note += f": TensorFlow {version} -> runtime {chosen}"
    on_event(Note(note))
    return raw


def nearest_tf_runtime(tf_version: str, accelerator: str) -> str | None:
    """The TPU VM TensorFlow runtime of the accelerator's generation closest to `tf_version` (e.g. 2.12)."""
    from tpuctl import catalog

    m = re.match(r"^(\d+)\.(\d+)", tf_version)
    try:
        t = catalog.load().accelerator(accelerator)
    except BadInput:
        return None  # plan() reports the unknown type with its nearest names
    fitting = [r for r in t.runtimes if r.startswith("tpu-vm-tf-") and ("-pod" in r) == t.multi_host]
    if not m or not fitting:
        return None
    want = int(m.group(1)) * 100 + int(m.group(2))

    def distance(r: str) -> tuple[int, str]:
        v = re.match(r"^tpu-vm-tf-(\d+)\.(\d+)", r)
        return abs(int(v.group(1)) * 100 + int(v.group(2)) - want), r

    return min(fitting, key=distance)
