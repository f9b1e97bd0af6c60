"""Errors and flags as a user meets them: every usage error is one `error: ...` line with the exit code the
README gives, conflicting flags are refused rather than silently resolved, a dry run refuses what `up`
refuses, commands on a run without a job say so, and a backgrounded tpuctl still stops on SIGINT.

Each test runs `tpuctl` against the session's local cloud (conftest `cloud`): in this process (conftest
`tpuctl_here`), or as a process where the process is what is tested (its entry point, its signals).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conftest import tpuctl, tpuctl_here

from tpuctl import api as tpuctl_api
from tpuctl import local as tpuctl_local
from tpuctl.errors import LocalCloudError, NotFound

from test_jobs_harness import STANDIN
from test_provision import everything

UP = ("up", "--accelerator", "v3-8", "--zone", "europe-west4-a", "--name", "r1")


def _one_error(p: subprocess.CompletedProcess, code: int, start: str) -> str:
    """The process exited `code` with one `error:` line starting with `start` (and at most a hint); returns it."""
    lines = [l for l in p.stderr.splitlines() if l.strip() and not l.startswith("no Google Cloud project")]
    errors = [l for l in lines if l.startswith("error:")]
    assert p.returncode == code, p.stderr
    assert len(errors) == 1 and errors[0].startswith(start), p.stderr
    assert all(l.startswith(("error:", "  hint:")) for l in lines), p.stderr
    assert "Traceback" not in p.stderr and "Usage:" not in p.stderr
    return errors[0]


# ---------------------------------------------------------------------------------- usage errors

def test_unknown_flags_and_commands_are_one_error_line_keeping_clicks_suggestion(tmp_path):
    env = {**os.environ, "TPUCTL_HOME": str(tmp_path), "NO_COLOR": "1"}
    line = _one_error(tpuctl(env, "up", "--spt"), 2, "error: ")
    assert "--spt" in line and "Did you mean" in line and "--spot" in line
    assert "Did you mean 'up'" in _one_error(tpuctl(env, "upp"), 2, "error: ")
    assert _one_error(tpuctl(env, "up", "--provisioning", "cheap"), 2, "error: provisioning: ")
    assert _one_error(tpuctl(env, "job", "cancel"), 2, "error: run: ")


def test_run_takes_spec_field_flags_over_the_environment_over_the_file(env, tmp_path):
    spec = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt2-tiny.yaml")  # v3-8 in europe-west4-a

    def planned(*args: str, **variables: str) -> dict:
        p = tpuctl_here({**env, **variables}, "run", spec, "--dry-run", "--json", *args, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return next(e for e in map(json.loads, p.stdout.splitlines()) if e["type"] == "run_planned")

    flagged = planned("--accelerator", "v6e-8", "--ttl", "3h", "--internal-ips")
    assert (flagged["accelerator"], flagged["zones"], flagged["framework"]) == ("v6e-8", ["europe-west4-a"], "jax")
    both = planned("--accelerator", "v6e-8", "--zone", "us-east5-b", "--provisioning", "on-demand",
                   TPUCTL_ACCELERATOR="v5litepod-8", TPUCTL_ZONE="us-east5-a")
    assert (both["accelerator"], both["zones"], both["provisioning"]) == ("v6e-8", ["us-east5-b"], "on-demand")
    assert planned(TPUCTL_ACCELERATOR="v5litepod-8", TPUCTL_ZONE="us-east5-a")["accelerator"] == "v5litepod-8"
    _one_error(tpuctl_here(env, "run", spec, "--dry-run", "--spot", "--provisioning", "on-demand"), 2,
               "error: provisioning: --spot and --provisioning on-demand")


def test_doctor_refuses_what_up_refuses_in_the_same_words(env):
    # Both plan the spec with the same code (provision.plan): a type, zone, runtime or provisioning up refuses.
    for args in (("--accelerator", "v9-8", "--zone", "europe-west4-a"),
                 ("--accelerator", "v3-8", "--zone", "europe-west4-z"),
                 ("--accelerator", "v6e-8", "--zone", "us-east5-b", "--provisioning", "flex-start",
                  "--max-run-duration", "4h")):
        up = _one_error(tpuctl_here(env, "up", *args, "--dry-run"), 2, "error: ")
        assert _one_error(tpuctl_here(env, "doctor", *args), 2, "error: ") == up
    _one_error(tpuctl_here(env, "doctor", "--zone", "europe-west4-z"), 2, "error: zone: no TPU type is offered in zone")
    # Flex-start is checked like any provisioning; the duration matters only to a create, so it may be left out.
    assert tpuctl_here(env, "doctor", "--provisioning", "flex-start").returncode == 0
    p = tpuctl_here(env, "doctor", "--provisioning", "flex-start", "--accelerator", "v6e-8", "--zone", "us-east5-a",
               "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["ok"], p.stdout + p.stderr


# ---------------------------------------------------------------------------------- durations

def test_ttl_takes_what_its_message_promises_from_flag_env_and_spec_and_refuses_zero(env, pc, tmp_path):
    p = tpuctl_here(env, *UP, "--ttl", "3600", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["plan"]["ttl"] == "1h"
    p = tpuctl_here({**env, "TPUCTL_TTL": "5400"}, *UP, "--dry-run", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["plan"]["ttl"] == "90m", p.stderr
    spec = tmp_path / "s.yaml"
    spec.write_text("ttl: 7200\n")
    p = tpuctl_here(env, *UP, str(spec), "--dry-run", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["plan"]["ttl"] == "2h", p.stderr
    line = _one_error(tpuctl_here(env, *UP, "--ttl", "0", "--dry-run"), 2, "error: ttl: ")
    assert "zero" in line and "not a duration" not in line
    # A fraction of a second is refused, not rounded (0.4s to a zero that crashed, 1.5 to 2s unsaid).
    for variables, flags in (({}, ("--ttl", "0.4s")), ({"TPUCTL_TTL": "1.5"}, ())):
        line = _one_error(tpuctl_here({**env, **variables}, *UP, *flags, "--dry-run"), 2, "error: ttl: ")
        assert "whole number of seconds" in line
    assert everything(pc) == []


# ---------------------------------------------------------------------------------- legacy specs

def test_run_has_the_migrate_flag_its_legacy_refusal_names(env, pc, tmp_path):
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text(f"name: old\naccelerator: v3-8\nzone: europe-west4-a\ntensorflow_version: 2.12.0\n"
                      f"job:\n  template: {STANDIN}\n")
    refused = tpuctl_here(env, "run", str(legacy), "--dry-run")
    assert "--migrate" in refused.stderr and refused.returncode == 2, refused.stderr
    migrated = tpuctl_here(env, "run", str(legacy), "--migrate", "--dry-run", "--json")
    assert migrated.returncode == 0, migrated.stderr
    assert "TensorFlow 2.12.0 -> runtime tpu-vm-tf-" in migrated.stderr
    assert everything(pc) == []


# ---------------------------------------------------------------------------------- conflicting flags

def test_conflicting_or_pointless_flags_are_errors(env, pc):
    _one_error(tpuctl_here(env, *UP, "--spot", "--provisioning", "on-demand", "--dry-run"), 2, "error: provisioning: ")
    _one_error(tpuctl_here({**env, "TPUCTL_SPOT": "1", "TPUCTL_PROVISIONING": "queued"}, *UP, "--dry-run"), 2,
               "error: provisioning: ")
    assert tpuctl_here(env, *UP, "--spot", "--provisioning", "spot", "--dry-run").returncode == 0
    _one_error(tpuctl_here(env, "gc", "--dry-run", "--budget-per", "owner"), 2, "error: budget-per: ")
    _one_error(tpuctl_here(env, "gc", "--dry-run", "--all-owners", "--owner", "bob"), 2, "error: owner: ")
    for budget in ("nan", "inf"):  # click's float takes both; nan never passes a comparison, so never triggered
        assert "positive finite" in _one_error(tpuctl_here(env, "gc", "--dry-run", "--budget", budget), 2,
                                               "error: budget: ")
    spec = str(Path(__file__).parents[1] / "examples" / "bert-tiny.yaml")
    line = _one_error(tpuctl_here(env, "run", spec, "--no-supervisor", "--dry-run", "--no-fit-check"), 2,
                      "error: no-supervisor: ")
    assert "--detach" in line
    assert everything(pc) == []


def test_no_capacity_hint_does_not_suggest_what_was_already_asked_for(env, pc, cloud):
    cloud.faults.add("capacity", service="tpu", zone="europe-west4-a")
    p = tpuctl_here(env, *UP, "--spot", "--yes")
    assert p.returncode == 3, p.stderr
    hint = next(l for l in p.stderr.splitlines() if l.startswith("  hint:"))
    assert "--spot" not in hint and "--zone" in hint and "queued" in hint
    assert everything(pc) == []


# ---------------------------------------------------------------------------------- dry run = up

def test_dry_run_refuses_a_bucket_in_another_region_as_up_does(env, pc):
    name = f"xr-{uuid.uuid4().hex[:12]}"
    pc.storage.create_bucket(pc.storage.bucket(name), location="us-central1")
    dry = _one_error(tpuctl_here(env, *UP, "--bucket", name, "--dry-run"), 2, "error: bucket: ")
    up = tpuctl_here(env, *UP, "--bucket", name, "--yes")
    assert up.returncode == 2, up.stderr
    real = next(l for l in up.stderr.splitlines() if l.startswith("error:"))
    # The real `up` (after its plan) adds what it rolled back (nothing); the refusal itself is the same.
    assert real.startswith(dry) and "us-central1" in dry, (dry, real)
    assert everything(pc) == [name]


# ---------------------------------------------------------------------------------- a run without a job

@pytest.fixture
def jobless(env, pc):
    """A ready v3-8 run (`r1`) on which nothing was launched."""
    p = tpuctl_here(env, *UP, "--yes")
    assert p.returncode == 0, p.stderr
    yield env
    tpuctl_here(env, "down", "r1", "--yes", "--delete-bucket")
    assert everything(pc) == []


def test_logs_and_job_cancel_on_a_run_without_a_job_say_so(jobless):
    assert "has no job" in _one_error(tpuctl_here(jobless, "logs", "r1"), 2, "error: run: ")
    assert "has no job" in _one_error(tpuctl_here(jobless, "job", "cancel", "r1"), 2, "error: run: ")
    assert "has no job" in _one_error(tpuctl_here(jobless, "job", "cancel", "r1", "--json"), 2, "error: run: ")


def test_ssh_reports_each_remote_exit_code_and_exits_1_not_the_remote_code(jobless):
    p = tpuctl_here(jobless, "ssh", "r1", "-w", "all", "--", "echo hi; exit 3")
    assert p.returncode == 1 and p.stdout.splitlines() == ["hi"], p.stderr
    assert p.stderr.splitlines()[-2:] == ["worker 0: exit 3",
                                          "error: the command failed on 1 of 1 worker(s): worker 0 exit 3"]
    ok = tpuctl_here(jobless, "ssh", "r1", "--", "true")
    assert ok.returncode == 0 and "worker 0: exit 0" in ok.stderr, ok.stderr


def test_logs_from_the_bucket_check_the_worker_as_ssh_does(env, pc):
    """Once the TPU is gone `logs` reads the bucket: a worker that is no number, or has no log there, was an
    empty output and exit 0."""
    from tpuctl.provision import labels

    bucket = pc.storage.bucket(f"gone-{uuid.uuid4().hex[:12]}")
    bucket.labels = labels.run_labels("gone", owner_name="ann", ttl_s=3600)
    pc.storage.create_bucket(bucket, location="europe-west4")
    for w in (0, 1):
        bucket.blob(f"runs/gone/logs/worker-{w}.log").upload_from_string(f"hello from {w}\n")
    p = tpuctl_here(env, "logs", "gone", "-w", "1")
    assert p.returncode == 0 and p.stdout == "[w1] hello from 1\n", p.stderr
    assert "has workers 0-1" in _one_error(tpuctl_here(env, "logs", "gone", "-w", "3"), 2, "error: worker: ")
    for worker in ("-1", "abc"):
        _one_error(tpuctl_here(env, "logs", "gone", "-w", worker), 2, "error: worker: ")


# ---------------------------------------------------------------------------------- down

def test_down_of_an_invalid_name_is_bad_input(env, pc):
    _one_error(tpuctl_here(env, "down", "No_Such", "--yes"), 2, "error: run: ")


def test_down_of_a_run_that_does_not_exist_exits_2_and_suggests_the_closest_run(jobless, monkeypatch):
    """A script tearing down the wrong name must learn it: exit 2 (a run that does not exist), not 0."""
    for extra in ((), ("--json",)):
        p = tpuctl_here(jobless, "down", "r2", "--yes", *extra)
        assert "tpuctl-run=r2" in _one_error(p, 2, "error: run: ") and "did you mean r1" in p.stderr, p.stderr
    for name in ("TPUCTL_API_ENDPOINT", "STORAGE_EMULATOR_HOST", "TPUCTL_HOME"):  # the same cloud, not a new one
        monkeypatch.setenv(name, jobless[name])
    with pytest.raises(NotFound) as e:  # the library as the CLI
        tpuctl_api.down("r2", project=jobless["TPUCTL_PROJECT"], cloud="local")
    assert e.value.field == "run" and "did you mean r1" in e.value.hint


# ---------------------------------------------------------------------------------- no credentials

# Every command that talks to a cloud, with what it needs to get that far.
CLOUD_COMMANDS = {
    "catalog refresh": (), "cost": (), "gc": ("--dry-run",), "status": (), "list": (), "down": ("r1", "--yes"),
    "up": ("--accelerator", "v3-8", "--zone", "europe-west4-a", "--dry-run"),
    "doctor": ("--accelerator", "v3-8", "--zone", "europe-west4-a"),
    "run": (str(Path(__file__).parents[1] / "examples" / "bert-tiny.yaml"), "--dry-run"),
    "ssh": ("r1",), "logs": ("r1",), "job status": ("r1",), "job cancel": ("r1",),
    "export": ("r1", "--format", "hf", "--out", "hf-out"), "board": ("r1",),
}


def _cloud_commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _cloud_commands(command, (*path, name))
        elif any(p.name == "cloud" for p in command.params):
            yield " ".join((*path, name))


@pytest.fixture
def no_credentials(tmp_path, monkeypatch, no_metadata_server):
    """A machine off Google Cloud with no key and no gcloud login, a project named, no local cloud in sight."""
    for name in list(os.environ):
        if name.startswith(("TPUCTL_", "GOOGLE_", "CLOUDSDK_", "GCE_")) or name == "STORAGE_EMULATOR_HOST":
            monkeypatch.delenv(name)
    for name, value in {**no_metadata_server, "HOME": str(tmp_path), "TPUCTL_HOME": str(tmp_path / "home"),
                        "TPUCTL_PROJECT": "my-proj", "NO_COLOR": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_no_command_prints_a_traceback_for_missing_credentials(no_credentials, cli_stderr, monkeypatch):
    """`--cloud gcp` (or a named project) without credentials was a 30-line DefaultCredentialsError: each
    command now says how to get them on one line, exit 2. In process (click's runner) to walk them all fast."""
    from tpuctl.cli import cli

    assert set(_cloud_commands(cli)) == set(CLOUD_COMMANDS), "a new command talks to a cloud: add it here"
    corpus = no_credentials / "corpus.txt"
    corpus.write_text("the quick brown fox\n" * 50)
    walks = [(*name.split(), *args, "--cloud", "gcp") for name, args in CLOUD_COMMANDS.items()]
    walks.append(("data", "prepare", str(corpus), "--out", "gs://my-bucket/p"))  # the project alone names Google
    for argv in walks:
        cli_stderr.seek(0)
        cli_stderr.truncate()
        result = CliRunner().invoke(cli, argv)
        lines = [l for l in cli_stderr.getvalue().splitlines() if l.strip()]
        assert (result.exit_code, type(result.exception)) == (2, SystemExit), (argv, result.exception, lines)
        assert lines[0].startswith("error: credentials: project my-proj") and lines[1].startswith("  hint: run "
                                                                                              "`gcloud auth"), argv
    key = no_credentials / "key.json"
    key.write_text("{}")  # found, but not a key google.auth can use
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    cli_stderr.seek(0)
    cli_stderr.truncate()
    result = CliRunner().invoke(cli, ["status", "--cloud", "gcp"])
    assert (result.exit_code, type(result.exception)) == (2, SystemExit), result.exception
    assert cli_stderr.getvalue().startswith("error: credentials: Application Default Credentials unusable")


def test_the_readme_cloud_run_gc_without_credentials_fails_instead_of_cleaning_the_emulator(no_credentials):
    """The README's Cloud Run job as first written (no --cloud), where the metadata server is missing: it
    scanned an empty embedded local cloud and exited 0."""
    p = tpuctl(dict(os.environ), "gc", "--yes", "--project", "P", "--all-owners", "--budget", "50", "--json")
    assert "gcloud auth application-default login" in _one_error(p, 2, "error: credentials: project P") + p.stderr
    assert p.stdout == "" and not (no_credentials / "home" / "localcloud").exists()


# ---------------------------------------------------------------------------------- anything unexpected

def test_an_unexpected_exception_is_one_error_line_exit_1_with_its_traceback_kept(tmp_path, monkeypatch):
    """Not a traceback on the terminal (the README's exit 1): one line naming the exception; the traceback is
    in TPUCTL_HOME's logs for the report, or nowhere when TPUCTL_HOME itself is what failed."""
    from tpuctl import catalog

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(catalog, "load", boom)
    env = {**os.environ, "TPUCTL_HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    p = tpuctl_here(env, "catalog", "show", "v3-8")
    _one_error(p, 1, "error: unexpected RuntimeError: boom")
    log = tmp_path / "home" / "logs" / "traceback.log"
    assert str(log) in p.stderr and "RuntimeError: boom" in log.read_text()
    (tmp_path / "file").write_text("")
    broken = {**env, "TPUCTL_HOME": str(tmp_path / "file" / "home")}
    _one_error(tpuctl(broken, "catalog", "show", "v3-8"), 1, "error: unexpected NotADirectoryError: ")


# ---------------------------------------------------------------------------------- the local cloud from Python

def test_local_start_never_passes_off_a_cloud_running_with_other_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path))
    first = tpuctl_local.start(speed=1000, worker_python="host", idle_stop="5m")
    try:
        assert tpuctl_local.start(worker_python="host") == first  # what was asked for is what runs
        for asked, running in (({"worker_python": "runtime"}, "worker_python='host'"), ({"speed": 20}, "speed=1000")):
            with pytest.raises(LocalCloudError) as e:
                tpuctl_local.start(**asked)
            assert running in e.value.message and "stop()" in e.value.hint
    finally:
        tpuctl_local.stop()


# ---------------------------------------------------------------------------------- data prepare

def test_data_prepare_checks_a_gs_destination_before_any_work(env, pc, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)))
    missing = f"no-such-{uuid.uuid4().hex[:12]}"
    p = tpuctl_here(env, "data", "prepare", str(corpus), "--out", f"gs://{missing}/p", "--vocab-size", "100")
    assert f"gs://{missing} does not exist" in _one_error(p, 2, "error: out: ")
    assert "encode" not in p.stderr, "nothing is prepared for a destination that cannot take it"


# ---------------------------------------------------------------------------------- SIGINT

def test_sigint_stops_a_tpuctl_started_with_sigint_ignored_and_it_cleans_up(env, pc, cloud):
    """What a script's `tpuctl up ... &` gets: the shell starts background jobs with SIGINT ignored."""
    cloud.faults.add("stuck", service="tpu", method="nodes.create")
    proc = subprocess.Popen([sys.executable, "-m", "tpuctl", *UP, "--yes"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while not any("/nodes/" in n for n in everything(pc)):
            assert time.monotonic() < deadline and proc.poll() is None, "up never requested the TPU"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGINT was ignored: tpuctl kept running")
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert "removed what this run created" in err
    cloud.faults.clear()
    assert everything(pc) == []
