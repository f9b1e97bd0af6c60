"""`tpuctl doctor`: is the project ready for a run? The same checks `up` and `run` make before creating anything.

One line per check on stdout (`ok`, `problem` or `unknown`: could not be read; what was found, and the fix),
or `--json`; exit 3 when TPU quota is the only problem, 2 when any other check found one, else 0.
"""

from __future__ import annotations

import click

from tpuctl import catalog, config, console
from tpuctl.cli.spec_flags import SpecFlags, spec_options

SECTION = "Provision and inspect"


@click.command("doctor")
@click.argument("spec_file", required=False, type=click.Path(dir_okay=False))
@click.option("--cloud", type=click.Choice(config.TARGETS), help="force the target (default: auto)")
@click.option("--project", help="Google Cloud project [env TPUCTL_PROJECT]")
@spec_options
@click.option("--json", "as_json", is_flag=True, help="print the checks as JSON")
@click.pass_context
def doctor(ctx, spec_file, cloud, project, spec_flags: SpecFlags, as_json) -> None:
    """Check the project before a run: APIs, network, service account, permissions, external IPs, OS Login,
    TPU quota, the supervisor's service account (`run --detach`)."""
    from tpuctl import provision as prov
    from tpuctl.cli.provision import resolve
    from tpuctl.provision import preflight

    # Read and validated as `up` reads it; only a flex-start duration may be left out (no check needs it).
    spec, settings = resolve(spec_file, spec_flags, cloud=cloud, migrate=False, partial=True, project=project)
    if spec.accelerator:  # planned as `up` plans it: the same refusals of a type, zone, runtime or provisioning
        target = preflight.Target.of_plan(prov.plan(spec, project=settings.project))
    else:
        cat = catalog.load()
        for zone in spec.zones:  # no type to check the zone against: it must offer some TPU
            cat.check_zone(zone)
        target = preflight.Target.of_spec(spec, cat)
    clients = prov.connect(config.ensure_endpoint(settings, on_event=console.report))
    from tpuctl.provision import supervisor_account

    # The identity a detached run's supervisor runs as (`run --detach` creates it, when the caller may).
    checks = [*preflight.checks(clients, target),
              supervisor_account.preflight_check(clients, spec.supervisor.service_account)]
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
