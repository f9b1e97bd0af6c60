"""`tpuctl doctor`: is the project ready for a run? The same checks `up` and `run` make before creating anything.

One line per check on stdout (`ok`, `problem` or `unknown`: could not be read; what was found, and the fix),
or `--json`; exit 3 when TPU quota is the only problem, 2 when any other check found one, else 0.
"""

from __future__ import annotations

import click

from tpuctl import catalog, config, console

SECTION = "Provision and inspect"


@click.command("doctor")
@click.argument("spec_file", required=False, type=click.Path(dir_okay=False))
@click.option("--cloud", type=click.Choice(config.TARGETS), help="force the target (default: auto)")
@click.option("--project", help="Google Cloud project [env TPUCTL_PROJECT]")
@click.option("--zone", help="zone, or a failover list (the subnetwork of each region is checked) [env TPUCTL_ZONE]")
@click.option("--accelerator", help="TPU type: its quota in each zone is checked (TPU7x: Compute Engine's quota "
              "and permissions)")
@click.option("--network", help="VPC network the TPU joins (default: default)")
@click.option("--subnet", help="subnetwork in the zone's region")
@click.option("--service-account", help="email the TPU VM runs as (default: the project's compute SA)")
@click.option("--provisioning", type=click.Choice(("on-demand", "spot", "preemptible", "queued")),
              help="queued also checks the queued-resource permissions")
@click.option("--internal-ips", is_flag=True, default=None, help="the workers will have no external IPs")
@click.option("--json", "as_json", is_flag=True, help="print the checks as JSON")
@click.pass_context
def doctor(ctx, spec_file, cloud, project, zone, accelerator, network, subnet, service_account, provisioning,
           internal_ips, as_json) -> None:
    """Check the project before a run: APIs, network, service account, permissions, external IPs, OS Login,
    TPU quota."""
    from tpuctl import provision as prov
    from tpuctl.cli.provision import resolve
    from tpuctl.provision import preflight

    flags = {"project": project, "zone": zone, "accelerator": accelerator, "network": network, "subnet": subnet,
             "service_account": service_account, "provisioning": provisioning, "internal_ips": internal_ips}
    spec, settings = resolve(spec_file, flags, cloud=cloud, migrate=False)
    target = preflight.Target.of_spec(spec, catalog.load())
    clients = prov.connect(config.ensure_endpoint(settings, on_event=console.report))
    checks = preflight.checks(clients, target)
    ok = all(c.ok for c in checks)
    if as_json:
        console.emit_json({"project": settings.project, "target": settings.target, "ok": ok,
                           "checks": [c.to_json() for c in checks]})
    else:
        for c in checks:
            click.echo(f"{c.status:<8} {c.name}: {c.detail}" + (f" -> fix: {c.fix}" if c.status != "ok" and c.fix else ""))
    failure = preflight.failure(settings.project, checks)
    if failure is not None:
        ctx.exit(failure.exit_code)


commands = [doctor]
for _c in commands:
    _c.section = SECTION
