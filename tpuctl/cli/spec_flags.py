"""The spec fields that are also flags, defined once for every command that plans a run (`up`, `run`, `doctor`,
and any command that reads a spec the same way: decorate it with `@spec_options`).

The decorator adds the options and hands the command one `spec_flags: SpecFlags` argument instead of a
parameter per flag, so a new spec-field flag appears on every such command at once. `resolve` (tpuctl.cli.provision)
layers it as flags > TPUCTL_* environment > spec file > user config > gcloud config > defaults.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from tpuctl import frameworks
from tpuctl import spec as spec_mod
from tpuctl.errors import BadInput

# (parameter, click option). The parameter is the spec field's name (`framework` is `job.framework`, `spot` is
# `provisioning: spot`); flags default to None so that an absent flag never hides the env or the file.
_OPTIONS: tuple[tuple[str, Callable], ...] = (
    ("zone", click.option("--zone", help="zone, or comma-separated zones in failover order [env TPUCTL_ZONE]")),
    ("accelerator", click.option("--accelerator", help="TPU type, e.g. v3-8, v4-32, v5litepod-16, v6e-8, tpu7x-8")),
    ("runtime_version", click.option("--runtime-version",
                                     help="TPU VM image (default: the catalog's choice for the type and framework)")),
    ("framework", click.option("--framework", type=click.Choice(frameworks.FRAMEWORKS),
                               help="job.framework: picks the runtime (auto: TensorFlow on v2-v5p, JAX elsewhere)")),
    ("sharding", click.option("--sharding", type=click.Choice(spec_mod.SHARDINGS),
                              help="job.sharding: data replicates the training state, zero1 splits the optimizer "
                                   "state over the devices, fsdp the weights too (both JAX); auto picks the first "
                                   "that fits the chip")),
    ("spot", click.option("--spot", is_flag=True, default=None, help="spot capacity (cheaper, can be preempted)")),
    ("provisioning", click.option("--provisioning", type=click.Choice(spec_mod.PROVISIONING),
                                  help="capacity model (--spot is spot; flex-start needs --max-run-duration)")),
    ("max_run_duration", click.option("--max-run-duration",
                                      help="flex-start: Google deletes the TPU after this long, e.g. 4h (30s to 7d)")),
    ("slices", click.option("--slices", type=int, help="multislice: N slices of the type in one queued resource")),
    ("bucket", click.option("--bucket", help="bucket name, or auto")),
    ("bucket_soft_delete", click.option("--bucket-soft-delete",
                                        help="soft delete retention of the bucket: 0s (off, default) or 7d to 90d")),
    ("service_account", click.option("--service-account",
                                     help="email the TPU VM runs as (default: the project's compute SA)")),
    ("network", click.option("--network", help="VPC network the TPU joins (default: default)")),
    ("subnet", click.option("--subnet", help="subnetwork in the zone's region (default: the network's)")),
    ("ttl", click.option("--ttl", help="delete by this age, e.g. 2h (tpuctl gc enforces it)")),
    ("allow_cross_region", click.option("--allow-cross-region", is_flag=True, default=None,
                                        help="accept a bucket outside the TPU's region")),
    ("internal_ips", click.option("--internal-ips", is_flag=True, default=None,
                                  help="no external IPs on the workers (org policy); run tpuctl from inside the VPC")),
)
FLAG_FIELDS = tuple(name for name, _ in _OPTIONS)


@dataclass(frozen=True)
class SpecFlags:
    """The spec-field flags a user gave: `fields` (top-level spec fields, for config.layered) and `framework`
    (job.framework, which wins over the spec's once it is read: spec.with_framework)."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    framework: str | None = None
    sharding: str | None = None  # job.sharding, as framework

    @property
    def given(self) -> tuple[str, ...]:
        """The flags given, as the user wrote them (for a command that refuses them, e.g. `run --attach`)."""
        names = [*self.fields, *(("framework",) if self.framework else ()), *(("sharding",) if self.sharding else ())]
        return tuple("--" + n.replace("_", "-") for n in names)


def collect(values: Mapping[str, Any]) -> SpecFlags:
    """SpecFlags from the options' values (None: not given). `--spot` is `provisioning: spot`."""
    spot, provisioning = values.get("spot"), values.get("provisioning")
    if spot and provisioning not in (None, "spot"):
        raise BadInput(f"--spot and --provisioning {provisioning} ask for different capacity", field="provisioning",
                       hint="give one of them: --spot is --provisioning spot")
    fields = {k: v for k, v in values.items() if v is not None and k not in ("spot", "framework", "sharding")}
    if spot:
        fields["provisioning"] = "spot"
    return SpecFlags(fields=fields, framework=values.get("framework"), sharding=values.get("sharding"))


def spec_options(f: Callable) -> Callable:
    """Add every spec-field flag to a click command; the command receives them as `spec_flags: SpecFlags`."""

    @functools.wraps(f)
    def command(*args, **kwargs):
        kwargs["spec_flags"] = collect({name: kwargs.pop(name) for name in FLAG_FIELDS})
        return f(*args, **kwargs)

    for _, option in reversed(_OPTIONS):
        command = option(command)
    return command
