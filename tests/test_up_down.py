"""`tpuctl up/down/status/list` as a user runs them: a subprocess against the session's local cloud.

Ctrl-C is a real SIGINT sent to the process at each phase of `up`; afterwards the project must be empty.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import tpuctl, tpuctl_here

from test_provision import everything


UP = ("up", "--accelerator", "v3-8", "--zone", "europe-west4-a", "--name", "r1", "--ttl", "2h", "--yes")


def test_dry_run_prints_the_plan_and_creates_nothing(env, pc):
    p = tpuctl_here(env, *UP, "--spot", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)["plan"]
    assert plan["run"] == "r1" and plan["provisioning"] == "spot" and plan["price_per_hour"] > 0
    assert [s["key"] for s in plan["steps"]] == ["bucket", "bucket-iam", "tpu"]
    assert everything(pc) == []


@pytest.mark.parametrize("args,field", [(("--accelerator", "v3-9"), "accelerator"),
                                        (("--zone", "us-central2-b"), "zone"),
                                        (("--ttl", "forever"), "ttl")])
def test_bad_input_exits_2_naming_the_field_and_creates_nothing(env, pc, args, field):
    p = tpuctl_here(env, *UP, *args)
    assert p.returncode == 2 and p.stderr.startswith(f"error: {field}:"), p.stderr
    assert everything(pc) == []


def test_legacy_tpu_node_spec_is_refused_then_migrated(env, pc, tmp_path):
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("accelerator: v3-8\nzone: europe-west4-a\ntensorflow_version: 2.12.0\n")
    p = tpuctl_here(env, "up", str(legacy), "--dry-run")
    assert p.returncode == 2 and "2025-04-15" in p.stderr and "--migrate" in p.stderr
    p = tpuctl_here(env, "up", str(legacy), "--dry-run", "--migrate", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["plan"]["runtime_version"].startswith("tpu-vm-tf-")


@pytest.mark.slow  # fast tier: up and down as processes: test_capacity_everywhere_exits_3..., the Ctrl-C tests
def test_up_status_list_down(env, pc):
    p = tpuctl(env, *UP, "--spot")
    assert p.returncode == 0, p.stderr
    assert "run r1 is ready in europe-west4-a" in p.stderr
    s = tpuctl(env, "status", "r1", "--json")
    assert s.returncode == 0, s.stderr
    st = json.loads(s.stdout)
    assert st["state"] == "ready" and st["workers"] == 1 and st["zone"] == "europe-west4-a"
    assert st["price_per_hour"] > 0 and {r["kind"] for r in st["resources"]} >= {"tpu", "bucket", "bucket-iam"}
    runs = json.loads(tpuctl(env, "list", "--json").stdout)["runs"]
    assert [r["run"] for r in runs] == ["r1"]
    text = tpuctl_here(env, "list")
    assert "r1" in text.stdout and "europe-west4-a" in text.stdout

    again = tpuctl_here(env, *UP, "--spot", "--json")  # idempotent: adopts everything
    records = [json.loads(line) for line in again.stdout.splitlines()]  # the events, then the result
    assert again.returncode == 0 and records[-1]["type"] == "summary" and records[-1]["created"] == []
    assert not [r for r in records if r["type"] == "warning"]  # the same TTL: nothing to say
    shorter = tpuctl_here(env, *UP[:-3], "--ttl", "30m", "--yes", "--spot")  # adopting keeps the labels it finds
    assert shorter.returncode == 0 and re.search(r"run r1 keeps the expiry it was made with: gc deletes it in "
                                                 r"(2h|1h\d+m), not in 30m as", shorter.stderr), shorter.stderr
    assert {r["key"] for r in records if r["type"] == "resource" and r["state"] == "ready"} >= {
        "tpu/europe-west4-a/r1"}
    # ...but only what the plan asks for, and only its owner's: another type, on demand for spot, or the same
    # run name from another owner is refused before anything changes, not adopted (and billed) as it is.
    there = len(everything(pc))
    on_demand = tpuctl_here(env, *UP)
    assert on_demand.returncode == 2 and (
        "error: provisioning: TPU node r1 in europe-west4-a already exists as a v3-8 spot, not the v3-8 on demand "
        "asked for") in on_demand.stderr, on_demand.stderr
    other = tpuctl_here(env, *UP[:2], "v2-8", *UP[3:], "--spot")
    assert other.returncode == 2 and ("error: accelerator: TPU node r1 in europe-west4-a already exists as a v3-8 "
                                      "spot, not the v2-8 spot asked for") in other.stderr, other.stderr
    theirs = tpuctl_here({**env, "TPUCTL_OWNER": "carol"}, *UP, "--spot")
    assert theirs.returncode == 2 and "of owner " in theirs.stderr and "not carol" in theirs.stderr, theirs.stderr
    for args in (("--yes",), ("--dry-run", "--json")):  # nor does the other owner's down delete it, or plan to
        not_theirs = tpuctl_here({**env, "TPUCTL_OWNER": "carol"}, "down", "r1", *args)
        assert not_theirs.returncode == 2 and "error: run: run r1 belongs to owner " in not_theirs.stderr, (
            not_theirs.stderr)
        assert not_theirs.stdout == ""
    assert len(everything(pc)) == there

    dry = tpuctl_here(env, "down", "r1", "--dry-run", "--json")  # needs no --yes, deletes nothing
    assert dry.returncode == 0, dry.stderr
    summary = json.loads(dry.stdout)
    assert [r["kind"] for r in summary["would_delete"]] == ["tpu"] and len(summary["kept"]) == 2
    assert "would delete (dry run)" in tpuctl_here(env, "down", "r1", "--dry-run").stdout
    assert len(everything(pc)) == 2
    no = tpuctl_here(env, "down", "r1")  # no TTY and no --yes: refuses, deletes nothing
    assert no.returncode == 2 and len(everything(pc)) == 2
    assert no.stderr.splitlines()[0] == "error: --yes: no terminal to confirm on; pass --yes to delete run r1"
    d = tpuctl(env, "down", "r1", "--yes")
    assert d.returncode == 0 and "verified none remain" in d.stderr, d.stderr
    assert len(everything(pc)) == 1  # the bucket is kept
    kept = json.loads(tpuctl_here(env, "status", "r1", "--json").stdout)
    assert kept["state"] == "bucket kept" and kept["workers"] == 0
    assert 3600 < kept["expires"] - time.time() <= 7200  # the bucket's TTL (--ttl 2h)
    table = tpuctl_here(env, "status", "r1")
    assert "run r1 (bucket kept)" in table.stdout and "kept until" in table.stderr, table
    assert "bucket kept" in tpuctl_here(env, "list").stdout
    d = tpuctl_here(env, "down", "r1", "--yes", "--delete-bucket")
    assert d.returncode == 0 and "holds 0 objects" in d.stderr, d.stderr
    assert everything(pc) == []
    assert tpuctl_here(env, "status", "r1").returncode == 2
    d = tpuctl_here(env, "down", "r1", "--yes")  # idempotent: a run deleted before is done, not a mistake
    assert d.returncode == 0 and "run r1: already deleted" in d.stderr, d.stderr


def test_up_takes_the_spec_fields_a_user_expects_as_flags_and_variables(env, pc):
    """--network, --subnet and --bucket-soft-delete on `up` (doctor has the first two), and a flex-start run
    from environment variables alone (TPUCTL_MAX_RUN_DURATION)."""
    p = tpuctl_here(env, *UP, "--bucket-soft-delete", "7d", "--dry-run", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["plan"]["bucket_soft_delete"] == "7d", p.stderr
    p = tpuctl_here(env, *UP, "--network", "vpc-x", "--subnet", "sub-x")  # preflight reads the named network
    assert p.returncode == 2 and "vpc-x" in p.stderr and "No such option" not in p.stderr, p.stderr
    flex = {**env, "TPUCTL_ACCELERATOR": "v6e-8", "TPUCTL_ZONE": "us-east5-a", "TPUCTL_PROVISIONING": "flex-start",
            "TPUCTL_MAX_RUN_DURATION": "4h"}
    p = tpuctl_here(flex, "up", "--dry-run", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)["plan"]
    assert (plan["provisioning"], plan["max_run_duration"]) == ("flex-start", "4h")
    assert everything(pc) == []


def test_capacity_everywhere_exits_3_and_leaves_nothing(env, pc, cloud):
    cloud.faults.add("capacity", service="tpu", zone="us-central1-a")
    cloud.faults.add("capacity", service="tpu", zone="us-central1-b")
    p = tpuctl_here(env, "up", "--accelerator", "v3-8", "--zone", "us-central1-a,us-central1-b", "--name", "r2", "--yes")
    assert p.returncode == 3 and "no capacity" in p.stderr and "removed" in p.stderr, p.stderr
    assert everything(pc) == []


def _start_up(env, *extra):
    return subprocess.Popen([sys.executable, "-m", "tpuctl", *UP, *extra], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pred, timeout=60.0):  # a `tpuctl` process takes 15 s to start on 2 busy cores
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "phase never reached"
        time.sleep(0.05)


PHASES = {
    # phase: (faults that hold `up` there, what must exist before Ctrl-C)
    "bucket-created-tpu-requested": ([("stuck", "tpu", "nodes.create")], lambda names: any("/nodes/" in n for n in names)),
    "vm-creating": ([("stuck", "compute", "instances.insert")], lambda names: "r1-d" in names),
    "tpu-ready-vm-creating": ([("stuck", "compute", "instances.insert")],
                              lambda names: "r1-d" in names and any("/nodes/" in n for n in names)),
}


# The fast tier keeps the first phase; the later two (a VM being created) run in the whole suite.
@pytest.mark.parametrize("phase", [p if p == "bucket-created-tpu-requested" else pytest.param(p, marks=pytest.mark.slow)
                                   for p in sorted(PHASES)])
def test_ctrl_c_at_each_phase_leaves_zero_resources(env, pc, cloud, tmp_path, phase):
    faults, reached = PHASES[phase]
    for kind, service, method in faults:
        cloud.faults.add(kind, service=service, method=method)
    spec = tmp_path / "s.yaml"
    spec.write_text("vms:\n  - name: d\n")
    proc = _start_up(env, str(spec))
    try:
        _wait_for(lambda: reached(everything(pc)))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "removed what this run created" in err
    cloud.faults.clear()
    assert everything(pc) == []


def test_second_ctrl_c_prints_the_down_command(env, pc, cloud):
    cloud.faults.add("stuck", service="tpu", method="nodes.create")
    cloud.faults.add("unavailable", service="tpu", method="nodes.delete")  # the cleanup keeps retrying
    proc = _start_up(env)
    try:
        _wait_for(lambda: any("/nodes/" in n for n in everything(pc)))
        proc.send_signal(signal.SIGINT)
        _wait_for(lambda: any(f["kind"] == "unavailable" and f.get("hits") for f in cloud.faults.list()))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "tpuctl down r1" in err, err
    cloud.faults.clear()
    d = tpuctl_here(env, "down", "r1", "--yes", "--delete-bucket")
    assert d.returncode == 0, d.stderr
    assert everything(pc) == []


def _on_a_terminal(env, *args, answer: str, timeout: float = 60.0) -> tuple[int, str]:
    """Run tpuctl with a pseudo-terminal as stdin/stdout/stderr; answer its [y/N] question. Returns the exit
    code and everything it wrote."""
    import pty
    import select

    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tpuctl", *args], env=env, stdin=secondary, stdout=secondary,
                            stderr=secondary, close_fds=True)
    os.close(secondary)
    seen, answered = b"", False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([primary], [], [], 0.5)[0]:
                continue
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if not answered and b"[y/N]" in seen:
                os.write(primary, answer.encode() + b"\n")
                answered = True
        return proc.wait(timeout=30), seen.decode(errors="replace")
    finally:
        proc.kill()
        os.close(primary)


def test_a_terminal_is_asked_whatever_no_color_says(env, pc, tmp_path):
    """Colour and consent are unrelated: NO_COLOR=1 (set in env) on a terminal still asks before up and run
    create billed resources; a 'no' creates nothing."""
    from test_jobs_harness import STANDIN

    code, text = _on_a_terminal(env, *[a for a in UP if a != "--yes"], answer="n")
    assert "create run r1 at about" in text and "[y/N]" in text, text
    assert code == 2 and "error: --yes: not confirmed; nothing was created" in text, text
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: asked\nzone: europe-west4-a\naccelerator: v3-8\njob:\n  template: {STANDIN}\n")
    code, text = _on_a_terminal(env, "run", str(spec), answer="no")
    assert "for run asked at" in text and "[y/N]" in text, text
    assert code == 2 and "not confirmed" in text, text
    assert everything(pc) == []


def test_without_a_terminal_or_yes_every_creating_or_deleting_command_refuses(env, pc, tmp_path):
    from test_jobs_harness import STANDIN

    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: script\nzone: europe-west4-a\naccelerator: v3-8\njob:\n  template: {STANDIN}\n")
    for args, to in [([a for a in UP if a != "--yes"], "create run r1"),
                     (["run", str(spec)], "create the run's resources"),
                     (["down", "r1"], "delete run r1"),
                     (["gc", "--all-owners"], "let gc delete")]:
        p = tpuctl_here(env, *args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.splitlines()[0] == f"error: --yes: no terminal to confirm on; pass --yes to {to}", p.stderr
    assert everything(pc) == []
    assert tpuctl_here(env, "run", str(spec), "--dry-run").returncode == 0  # a dry run needs no --yes


def test_ctrl_c_once_the_run_is_ready_keeps_it_and_says_so(env, pc, monkeypatch):
    """A Ctrl-C that lands after every resource is READY (while `up` records and prints) rolls nothing back:
    exit 130 must then say the run is kept, never the bare "interrupted" that promises a rollback."""
    from click.testing import CliRunner

    from tpuctl import console, ledger
    from tpuctl.cli import cli

    for key in [k for k in os.environ if k.startswith("TPUCTL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def ctrl_c(resources, **_):
        raise KeyboardInterrupt

    said: list[str] = []
    monkeypatch.setattr(ledger, "remember", ctrl_c)
    monkeypatch.setattr(console, "error", lambda exc: said.append(f"{exc} | {exc.hint}"))
    r = CliRunner().invoke(cli, list(UP))
    assert r.exit_code == 130, (r.output, said)
    assert said and "interrupted after run r1 was ready: its resources are kept" in said[0], said
    assert "tpuctl down r1" in said[0]
    assert len(everything(pc)) == 2  # TPU and bucket, READY
    d = tpuctl(env, "down", "r1", "--yes", "--delete-bucket")
    assert d.returncode == 0 and everything(pc) == [], d.stderr


def test_down_ends_the_timeline_of_a_run_nobody_watched_and_a_write_it_cannot_make_is_a_warning(env, pc, monkeypatch):
    """`run --detach --no-supervisor` left the run unwatched: the `down` that deletes its TPU ends its timeline (a
    second `down`, deleting nothing, adds nothing). Best effort: a timeline it cannot write fails no `down`."""
    from test_gc import make_tpu, run_labels, save_timeline, write_status

    from tpuctl.errors import CloudError
    from tpuctl.jobs import timeline
    from tpuctl.provision import labels

    env = {**env, "TPUCTL_OWNER": "ann"}  # test_gc's runs' owner
    t = time.time()
    unwatched = [timeline.Mark(t - 30, "up"), timeline.Mark(t - 20, "launch"), timeline.Mark(t - 18, "detached")]
    for run in ("unseen", "unwritable"):
        make_tpu(pc, run, run_labels(run))
        write_status(pc, run, "running", t)
        save_timeline(pc, run, unwatched)
    before = time.time()
    p = tpuctl_here(env, "down", "unseen", "--yes")
    assert p.returncode == 0, p.stderr
    record = timeline.load(pc, labels.auto_bucket(pc.project, "unseen"), "unseen")
    assert record.marks[:3] == unwatched
    assert [(m.what, m.detail) for m in record.marks[3:]] == [("teardown", "down"), ("closed", "down")]
    assert before <= record.marks[3].at < record.marks[4].at <= time.time()
    assert tpuctl_here(env, "down", "unseen", "--yes").returncode == 0
    assert len(timeline.load(pc, labels.auto_bucket(pc.project, "unseen"), "unseen").marks) == 5

    def refused(*args, **kwargs):
        raise CloudError("403 the bucket refuses writes")

    monkeypatch.setattr("tpuctl.jobs.cluster.write_json", refused)
    p = tpuctl_here(env, "down", "unwritable", "--yes")
    assert p.returncode == 0, p.stderr
    bucket = labels.auto_bucket(pc.project, "unwritable")
    assert f"could not write gs://{bucket}/runs/unwritable/timeline.json" in p.stderr, p.stderr
    assert [n for n in everything(pc) if "/nodes/" in n] == []
