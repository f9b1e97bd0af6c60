"""`tpuctl doctor`: is the project ready for a run? The same checks `up` and `run` make before creating anything.

One line per check on stdout (`ok`, `problem` or `unknown`: could not be read; what was found, and the fix),
or `--json`; exit 2 when any check found a problem, else 0.
"""

from __future__ import annotations

import click

from tpuctl import config, console
from tpuctl.catalog import region_of

SECTION = "Provision and inspect"


@click.command("doctor")
@click.argument("spec_file", required=False, type=click.Path(dir_okay=False))
@click.option("--cloud", type=click.Choice(config.TARGETS), help="force the target (default: auto)")
@click.option("--project", help="Google Cloud project [env TPUCTL_PROJECT]")
@click.option("--zone", help="zone (its region's subnetwork is checked) [env TPUCTL_ZONE]")
@click.option("--network", help="VPC network the TPU joins (default: default)")
@click.option("--subnet", help="subnetwork in the zone's region")
@click.option("--service-account", help="email the TPU VM runs as (default: the project's compute SA)")
@click.option("--provisioning", type=click.Choice(("on-demand", "spot", "preemptible", "queued")),
              help="queued also checks the queued-resource permissions")
@click.option("--internal-ips", is_flag=True, default=None, help="the workers will have no external IPs")
@click.option("--json", "as_json", is_flag=True, help="print the checks as JSON")
@click.pass_context
def doctor(ctx, spec_file, cloud, project, zone, network, subnet, service_account, provisioning, internal_ips,
           as_json) -> None:
    """Check the project before a run: APIs, network, service account, permissions, external IPs, OS Login."""
    from tpuctl import provision as prov
    from tpuctl.cli.provision import resolve
    from tpuctl.provision import preflight
    from tpuctl.provision.preflight import PreflightFailed

    flags = {"project": project, "zone": zone, "network": network, "subnet": subnet,
             "service_account": service_account, "provisioning": provisioning, "internal_ips": internal_ips}
    spec, settings = resolve(spec_file, flags, cloud=cloud, migrate=False)
    target = preflight.Target(region=region_of(spec.zones[0]) if spec.zones else None, network=spec.network,
                              subnet=spec.subnet, service_account=spec.service_account,
                              queued=spec.provisioning == "queued", vms=bool(spec.vms), internal_ips=spec.internal_ips)
    clients = prov.connect(config.ensure_endpoint(settings, on_event=console.report))
    checks = preflight.checks(clients, target)
    ok = all(c.ok for c in checks)
    if as_json:
        console.emit_json({"project": settings.project, "target": settings.target, "ok": ok,
                           "checks": [c.to_json() for c in checks]})
    else:
        for c in checks:
            click.echo(f"{c.status:<8} {c.name}: {c.detail}" + (f" -> fix: {c.fix}" if c.status != "ok" and c.fix else ""))
    if not ok:
        ctx.exit(PreflightFailed.exit_code)


commands = [doctor]
for _c in commands:
    _c.section = SECTION
