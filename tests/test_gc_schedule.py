"""`tpuctl gc --schedule/--install`: the crontab line and systemd units a user (or cron) runs gc with."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from tpuctl.cli import cli
from tpuctl.provision import gc


@pytest.fixture
def home(tmp_path, monkeypatch):
    # The schedule pins the caller's cloud environment; the session's local cloud (STORAGE_EMULATOR_HOST, set by
    # whichever test started it first) must not leak into lines these tests compare.
    for name in ("TPUCTL_OWNER", "TPUCTL_PROJECT", "TPUCTL_CLOUD", "TPUCTL_API_ENDPOINT", "STORAGE_EMULATOR_HOST",
                 "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GCE_METADATA_IP", "GCE_METADATA_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud configuration names a project
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def test_schedule_prints_cron_and_systemd_with_the_policy_flags(home, metadata_server, monkeypatch):
    for name, value in metadata_server.items():  # on a Google VM: credentials from its metadata server
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["gc", "--schedule", "--every", "15m", "--budget", "20", "--all-owners",
                                      "--project", "my-proj", "--idle", "45m"])
    assert result.exit_code == 0, result.output
    cron = next(line for line in result.stdout.splitlines() if line.endswith(gc.CRON_MARK))
    assert cron.startswith(f"*/15 * * * * GCE_METADATA_HOST={metadata_server['GCE_METADATA_HOST']} ")
    for part in ("gc --yes --idle 45m", "--all-owners", "--budget 20.0", "--project my-proj", "--cloud gcp", ">> ",
                 "gc.log 2>&1", "TPUCTL_HOME="):
        assert part in cron
    assert "--schedule" not in cron and "--dry-run" not in cron
    assert "ExecStart=" in result.stdout and " gc --yes " in result.stdout.split("ExecStart=")[1].splitlines()[0]
    assert "[Service]\nType=oneshot\n" in result.stdout and "OnCalendar=*:0/15\n" in result.stdout
    assert "WantedBy=timers.target" in result.stdout


@pytest.mark.parametrize("every,cron,calendar", [("1m", "*/1 * * * *", "*:0/1"), ("2h", "0 */2 * * *", "0/2:00"),
                                                 ("24h", "0 0 * * *", "daily")])
def test_intervals(every, cron, calendar, home):
    from tpuctl.cost import parse_duration

    s = gc.schedule(["tpuctl", "gc"], every_s=parse_duration(every), log=home / "gc.log", env={})
    assert s.crontab_line.startswith(cron + " tpuctl gc >> ")
    assert f"OnCalendar={calendar}\n" in s.timer_unit


@pytest.mark.parametrize("every", ["30s", "90m", "25h"])
def test_unschedulable_intervals_are_bad_input(every, home):
    result = CliRunner().invoke(cli, ["gc", "--schedule", "--every", every])
    assert result.exit_code == 2


def test_merge_crontab_replaces_only_our_line():
    existing = "MAILTO=me\n0 1 * * * backup # nightly\n*/5 * * * * old gc # tpuctl-gc\n"
    merged = gc.merge_crontab(existing, "*/10 * * * * new gc # tpuctl-gc")
    assert merged == "MAILTO=me\n0 1 * * * backup # nightly\n*/10 * * * * new gc # tpuctl-gc\n"
    assert gc.merge_crontab(merged, "*/10 * * * * new gc # tpuctl-gc") == merged


def fake_crontab(home, monkeypatch, listing: str) -> Path:
    """A stand-in `crontab` keeping its table in a file, so the user's real crontab is never touched.
    `listing` is the shell code that answers `crontab -l`."""
    table = home / "crontab.txt"
    fake = home / "bin" / "crontab"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-l" ]; then {listing}; else cat > {table}; fi\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return table


def test_install_writes_units_and_merges_the_crontab_idempotently(home, monkeypatch):
    table = fake_crontab(home, monkeypatch, f"cat {home / 'crontab.txt'}")
    table.write_text("0 1 * * * backup\n")
    for _ in range(2):
        result = CliRunner().invoke(cli, ["gc", "--install", "--every", "10m"])
        assert result.exit_code == 0, result.output
    lines = table.read_text().splitlines()
    assert lines[0] == "0 1 * * * backup" and len(lines) == 2 and lines[1].endswith(gc.CRON_MARK)
    units = home / "config" / "systemd" / "user"
    assert "ExecStart=" in (units / "tpuctl-gc.service").read_text()
    assert "OnCalendar=*:0/10" in (units / "tpuctl-gc.timer").read_text()


def test_install_starts_a_first_crontab(home, monkeypatch):
    table = fake_crontab(home, monkeypatch, "echo 'no crontab for ann' >&2; exit 1")
    assert CliRunner().invoke(cli, ["gc", "--install"]).exit_code == 0
    assert table.read_text().splitlines()[-1].endswith(gc.CRON_MARK)


def test_install_never_replaces_a_crontab_it_could_not_read(home, monkeypatch):
    table = fake_crontab(home, monkeypatch, "echo 'crontab: permission denied' >&2; exit 1")
    result = CliRunner().invoke(cli, ["gc", "--install"])
    assert result.exit_code == 1
    assert not table.exists()


def test_the_scheduled_gc_carries_every_flag_given_and_pins_the_cloud(home, monkeypatch):
    """A --dry-run schedule stays a dry run (it was a live, deleting gc), --timeout and --lock-wait hold, and
    the resolved cloud is pinned so cron never falls back to another target."""
    table = fake_crontab(home, monkeypatch, "echo 'no crontab for ann' >&2; exit 1")
    result = CliRunner().invoke(cli, ["gc", "--install", "--dry-run", "--timeout", "5m", "--lock-wait", "30",
                                      "--budget", "9", "--budget-per", "owner", "--json"])
    assert result.exit_code == 0, result.output
    cron = table.read_text().splitlines()[-1]
    command = cron.split(" gc ", 1)[1].split(" >> ")[0]
    assert command == "--dry-run --budget 9.0 --budget-per owner --lock-wait 30.0 --timeout 5m --json --cloud local"
    service = (home / "config" / "systemd" / "user" / "tpuctl-gc.service").read_text()
    assert service.split("ExecStart=")[1].splitlines()[0].endswith(" gc " + command)


def test_scheduling_google_cloud_without_credentials_is_refused(home, no_metadata_server, monkeypatch, cli_stderr):
    for name, value in no_metadata_server.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["gc", "--schedule", "--project", "my-proj"])
    assert result.exit_code == 2 and "error: credentials: project my-proj" in cli_stderr.getvalue()
    assert gc.CRON_MARK not in result.stdout


@pytest.mark.parametrize("args,field", [(["--every", "5m"], "every"), (["--schedule", "--idle", "0"], "idle")])
def test_a_flag_that_does_nothing_alone_or_a_zero_idle_is_an_error(args, field, home, cli_stderr):
    """--every without a schedule was silently ignored; --idle 0 meant "off" though 0 is refused everywhere."""
    result = CliRunner().invoke(cli, ["gc", *args])
    assert result.exit_code == 2 and f"error: {field}: " in cli_stderr.getvalue()
    assert gc.CRON_MARK not in result.stdout
