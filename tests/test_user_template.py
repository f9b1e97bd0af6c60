"""A user's own template, a local directory written from templates/README.md alone, runs end to end on the
local cloud through `tpuctl run`; one that lacks a part is refused in one line before anything is created."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from test_run import _buckets, _here, _text, _tpuctl, _zero, project, tpc  # noqa: F401 (fixtures)

LINREG = Path(__file__).parent / "job_templates" / "linreg"


def _user_template(tmp_path: Path, **meta_changes) -> Path:
    """The linreg fixture copied beside the spec (which names it `./linreg`), its template.json changed."""
    root = tmp_path / "linreg"
    shutil.copytree(LINREG, root, ignore=shutil.ignore_patterns("__pycache__"))
    meta = json.loads((root / "template.json").read_text())
    for key, value in meta_changes.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    (root / "template.json").write_text(json.dumps(meta))
    return root


def _spec(tmp_path: Path, name: str, config: dict | None = None) -> Path:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "zone": "us-central1-a", "accelerator": "v3-8", "provisioning": "spot",
        "job": {"template": "./linreg", "config": config or {}}}))
    return spec


@pytest.mark.slow  # fast tier: a user template: the refusals below, test_templates_contract
@pytest.mark.tf
def test_a_user_template_trains_checkpoints_to_the_bucket_and_leaves_nothing_running(cloud, project, tpc, tmp_path):
    _user_template(tmp_path)
    spec = _spec(tmp_path, "user-tpl", {"trainer": {"max_steps": 30}})
    r = _tpuctl(cloud, tmp_path, project, "run", str(spec), "--yes", "--json", "--poll", "0.5", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    outcome = json.loads(r.stdout.splitlines()[-1])  # the summary, after the events
    assert outcome["state"] == "succeeded" and outcome["step"] == 30, outcome
    bucket = outcome["bucket"]
    # It trained: the preset ("small", the template's default) and the spec's override reached the program,
    # and the loss fell from the first step to the last.
    log = _text(tpc, bucket, "runs/user-tpl/logs/worker-0.log")
    assert "start step=0 max_steps=30 features=8" in log, log[-2000:]
    losses = [float(line.split("loss=")[1]) for line in log.splitlines() if line.startswith("step=")]
    assert len(losses) == 30 and losses[-1] < losses[0] / 10, losses
    # Its checkpoints and export are in the run's bucket, where tpuctl keeps every template's outputs.
    names = {b.name for b in tpc.storage.list_blobs(bucket, prefix="runs/user-tpl/model/")}
    assert {"runs/user-tpl/model/checkpoints/checkpoint", "runs/user-tpl/model/checkpoints/ckpt-30.npz",
            "runs/user-tpl/model/export/weights.json"} <= names, sorted(names)
    assert _text(tpc, bucket, "runs/user-tpl/model/checkpoints/checkpoint").strip() == "ckpt-30.npz"
    assert json.loads(_text(tpc, bucket, "runs/user-tpl/model/export/weights.json"))["error"] < 0.1
    assert _zero(cloud, project)


def test_a_user_template_missing_a_part_is_one_line_exit_2_creating_nothing(cloud, project, tmp_path):
    part = "outputs"  # each part in-process: test_templates_contract.py; here, the CLI's answer
    _user_template(tmp_path, **{part: None})
    r = _here(cloud, tmp_path, project, "run", str(_spec(tmp_path, "bad-tpl")), "--yes")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: job.template: template linreg ({tmp_path / 'linreg'}): template.json does "
                               f"not declare {part!r}"), r.stderr
    assert _buckets(cloud, project) == [] and _zero(cloud, project)


def test_a_user_template_whose_entry_module_is_missing_is_refused_naming_it(cloud, project, tmp_path):
    root = _user_template(tmp_path)
    (root / "train.py").rename(root / "trainer.py")
    r = _here(cloud, tmp_path, project, "run", str(_spec(tmp_path, "bad-entry")), "--yes")
    assert r.returncode == 2 and r.stderr.startswith("error: job.template: "), r.stderr
    assert "entry_module 'linreg.train'" in r.stderr.splitlines()[0] and "train.py" in r.stderr.splitlines()[0]
    assert _buckets(cloud, project) == [] and _zero(cloud, project)


def test_a_user_templates_config_check_runs_before_anything_is_created(cloud, project, tmp_path):
    _user_template(tmp_path)
    r = _here(cloud, tmp_path, project, "run", str(_spec(tmp_path, "bad-cfg", {"trainer": {"max_stepz": 3}})),
              "--yes")
    assert r.returncode == 2 and r.stderr.startswith("error: job.config.trainer.max_stepz: unknown field"), r.stderr
    assert _buckets(cloud, project) == [] and _zero(cloud, project)


def test_templates_lists_a_user_template_with_its_presets():
    from click.testing import CliRunner

    from tpuctl.cli import cli

    result = CliRunner().invoke(cli, ["templates", str(LINREG), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["preset"]: r for r in json.loads(result.output) if r["template"] == "linreg"}
    assert set(rows) == {"small", "wide"} and rows["small"]["default"] and rows["small"]["entry"] == "linreg.train"
