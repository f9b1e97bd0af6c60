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
                 "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def test_schedule_prints_cron_and_systemd_with_the_policy_flags(home):
    result = CliRunner().invoke(cli, ["gc", "--schedule", "--every", "15m", "--budget", "20", "--all-owners",
                                      "--project", "my-proj", "--idle", "45m"])
    assert result.exit_code == 0, result.output
    cron = next(line for line in result.stdout.splitlines() if line.endswith(gc.CRON_MARK))
    assert cron.startswith("*/15 * * * * TPUCTL_HOME=")
    for part in ("gc --yes --idle 45m", "--all-owners", "--budget 20.0", "--project my-proj", ">> ", "gc.log 2>&1"):
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
