"""The `tpuctl` command itself: version, help grouped by purpose, `--json` where it lists, and a light start."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from tpuctl import __version__
from tpuctl.cli import SECTIONS, cli


def _all_commands(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    out = {}
    for name, cmd in group.commands.items():
        out[f"{prefix}{name}"] = cmd
        if isinstance(cmd, click.Group):
            out.update(_all_commands(cmd, f"{prefix}{name} "))
    return out


def test_version():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"tpuctl, version {__version__}"


def test_help_groups_every_command_by_purpose_in_order():
    result = CliRunner().invoke(cli, ["--help"], terminal_width=120)
    assert result.exit_code == 0
    positions = [result.output.index(f"{s}:") for s in SECTIONS]
    assert positions == sorted(positions)
    assert "Other:" not in result.output, "every command declares its section"
    for name in cli.commands:
        assert f"\n  {name} " in result.output


@pytest.mark.parametrize("path", sorted(_all_commands(cli)))
def test_every_command_has_help(path):
    result = CliRunner().invoke(cli, [*path.split(), "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output


# Commands that print data rather than act: each must offer machine-readable output.
LISTINGS = ["status", "list", "cost", "catalog list", "catalog show", "catalog refresh", "job status",
            "local status", "up", "down", "gc"]


@pytest.mark.parametrize("path", LISTINGS)
def test_listing_and_status_commands_offer_json(path):
    cmd = _all_commands(cli)[path]
    assert any("--json" in p.opts for p in cmd.params), f"tpuctl {path} has no --json"


def test_starting_the_cli_does_not_load_the_google_client_libraries():
    """They take seconds to import; `--help`, `local` and `data` must not pay for them."""
    code = ("import sys, tpuctl.cli; "
            "print(sorted({m.split('.')[2] for m in sys.modules if m.startswith('google.cloud.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_up_run_and_doctor_take_every_spec_field_flag():
    """The README: every common spec field is also a flag. One list (tpuctl.cli.spec_flags) serves each command
    that reads a spec, so `tpuctl run SPEC --accelerator v6e-8` is not refused as "No such option"."""
    from tpuctl.cli.spec_flags import FLAG_FIELDS

    wanted = {"--" + f.replace("_", "-") for f in FLAG_FIELDS}
    assert {"--accelerator", "--zone", "--spot", "--runtime-version", "--provisioning", "--max-run-duration", "--ttl",
            "--bucket", "--bucket-soft-delete", "--network", "--subnet", "--internal-ips", "--service-account",
            "--framework"} <= wanted
    for path in ("up", "run", "doctor"):
        given = {o for p in _all_commands(cli)[path].params for o in p.opts}
        assert wanted <= given, f"tpuctl {path} lacks {sorted(wanted - given)}"

