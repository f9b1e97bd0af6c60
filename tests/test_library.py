"""tpuctl as a library: the layers report typed events and never print or ask; `tpuctl.run` from Python on the
local cloud; the CLI renders the same events (NDJSON with --json, plain lines without a terminal)."""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from test_run import REPO, _buckets, _env, _spec, _spec_file, _zero, project  # noqa: F401 - `project` is a fixture
import tpuctl
from tpuctl import events as ev
from tpuctl.errors import BadInput, Interrupted

# The library: everything but the CLI and the one module that renders for it.
LIBRARY = ("provision", "jobs", "templates", "tpuctl")
RENDERING = {"tpuctl/console.py", "tpuctl/__main__.py"}
FORBIDDEN = ("rich", "click", "tpuctl.console")


def _library_files() -> list[Path]:
    return [p for top in LIBRARY for p in sorted((REPO / top).rglob("*.py"))
            if not p.relative_to(REPO).as_posix().startswith("tpuctl/cli/")
            and p.relative_to(REPO).as_posix() not in RENDERING]


def _imports(path: Path) -> list[str]:
    """Every module a file imports, absolute (`from . import console` in tpuctl/x.py is tpuctl.console)."""
    parent = path.relative_to(REPO).parent.parts  # provision/, jobs/, templates/ are installed under tpuctl.
    package = ["tpuctl", *parent[1:]] if parent[0] == "tpuctl" else ["tpuctl", *parent]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
    return names


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_no_library_module_imports_the_console_rich_or_click():
    files = _library_files()
    assert len(files) > 40 and REPO / "jobs" / "pipeline.py" in files
    found = {f"{p.relative_to(REPO)}: {n}" for p in files for n in _imports(p) if _forbidden(n)}
    assert not found, found


def test_importing_the_library_loads_no_terminal_library():
    code = ("import sys, tpuctl, tpuctl.api, tpuctl.local, tpuctl.jobs.pipeline, tpuctl.provision, "
            "tpuctl.provision.gc, tpuctl.templates.contract; tpuctl.run; "
            f"print([m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in {FORBIDDEN!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_event_round_trips_through_its_json_line():
    samples = [ev.RunPlanned("r", "v3-8", ("us-central1-a",), "b", 8.0, provisioning="spot"),
               ev.ResourceChanged("tpu/z/r", "creating"), ev.PhaseStarted("up"), ev.PhaseEnded("up", 1.5),
               ev.WorkerLog(1, "hello"), ev.Metrics(0, 3, loss=1.5, examples_per_s=9.0, max_steps=10),
               ev.RecoveryStarted(1, 3, "node lost"), ev.RecoveryEnded(1, True), ev.CostAccrued(0.1, 8.0),
               ev.Warn("w"), ev.Note("n")]
    assert {type(e) for e in samples} == set(ev.TYPES.values())
    for e in samples:
        wire = json.loads(json.dumps(e.to_json()))
        assert wire["v"] == ev.SCHEMA_VERSION and wire["type"] == e.type
        assert ev.from_json({**wire, "added_in_a_later_version": 1}) == e


def test_provisions_progress_becomes_one_event_a_change():
    seen: list[ev.Event] = []
    progress = ev.resource_progress(seen.append)
    for key, state, detail in [("tpu/z/r", "creating", "requested"), ("tpu/z/r", "creating", "requested"),
                               ("bucket/r/b", "creating", ""), ("tpu/z/r", "creating", "requested"),
                               ("tpu/z/r", "creating", "1/4 hosts"), ("tpu/z/r", "ready", ""), ("tpu/z/r", "ready", "")]:
        progress(key, state, detail)  # provision's waits report at every poll
    assert [(e.key, e.state, e.detail) for e in seen] == [
        ("tpu/z/r", "creating", "requested"), ("bucket/r/b", "creating", ""), ("tpu/z/r", "creating", "1/4 hosts"),
        ("tpu/z/r", "ready", "")]


def test_plain_board_prints_one_line_per_change_of_state(monkeypatch):
    from tpuctl import console

    text = io.StringIO()
    monkeypatch.setattr(console, "err", console._console(text))
    with console.Board("t") as board:
        for state, detail in (("creating", "requested"), ("creating", ""), ("creating", "2/4 hosts"), ("ready", ""),
                              ("ready", "")):
            board(ev.ResourceChanged("tpu/z/r", state, detail))
        board(ev.Metrics(0, 1, loss=2.0))  # on the live board only; its log line says it in plain text
    assert [line.split(" [")[0] for line in text.getvalue().splitlines()] == [
        "tpu/z/r: creating (requested)", "tpu/z/r: ready"]


@pytest.fixture
def api_env(cloud, project, monkeypatch) -> str:
    """`tpuctl.run` resolves its target as the CLI does: the environment names the session's local cloud."""
    monkeypatch.setenv("TPUCTL_API_ENDPOINT", cloud.endpoint)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", cloud.storage_host)
    monkeypatch.setenv("TPUCTL_PROJECT", project)
    return project


def test_run_from_python_reports_typed_events_in_order(cloud, api_env):
    seen: list[ev.Event] = []
    outcome = tpuctl.run(_spec("lib-run"), on_event=seen.append, poll_s=0.5)
    assert outcome.state == "succeeded" and outcome.step == 15 and _zero(cloud, api_env)

    assert isinstance(seen[0], ev.RunPlanned) and seen[0].run == "lib-run"
    phases = [(e.type, e.name) for e in seen if isinstance(e, (ev.PhaseStarted, ev.PhaseEnded))]
    order = ["up", "upload", "launch", "train", "tear down", "collect"]
    assert phases == [(t, name) for name in order for t in ("phase_started", "phase_ended")]
    assert all(e.ok for e in seen if isinstance(e, ev.PhaseEnded))

    def index(pred) -> int:
        return next(i for i, e in enumerate(seen) if pred(e))

    started = {name: index(lambda e, n=name: isinstance(e, ev.PhaseStarted) and e.name == n) for name in order}
    tpu = [e for e in seen if isinstance(e, ev.ResourceChanged) and e.key.startswith("tpu/")]
    assert tpu[0].state == "creating" and tpu[-1].state == "deleted"
    assert index(lambda e: isinstance(e, ev.ResourceChanged) and e.state == "ready" and e.key.startswith("tpu/")) \
        < started["launch"] < index(lambda e: isinstance(e, ev.Metrics)) < started["tear down"]

    steps = [e.step for e in seen if isinstance(e, ev.Metrics) and e.worker == 0]
    assert steps == list(range(1, 16)) and {e.worker for e in seen if isinstance(e, ev.Metrics)} == {0, 1, 2, 3}
    assert not [e for e in seen if isinstance(e, ev.WorkerLog) and e.worker and e.line.startswith("step=")]
    final = [e for e in seen if isinstance(e, ev.CostAccrued)][-1]
    assert final.final and final.usd == outcome.cost_usd


def test_a_run_its_caller_does_not_confirm_creates_nothing(cloud, api_env):
    plans = []
    with pytest.raises(BadInput, match="not confirmed"):
        tpuctl.run(_spec("lib-no"), confirm=lambda plan: plans.append(plan) or False)
    assert [p.run for p in plans] == ["lib-no"]
    assert _zero(cloud, api_env) and _buckets(cloud, api_env) == []


def test_up_status_gc_down_from_python(cloud, api_env):
    seen: list[ev.Event] = []
    run = tpuctl.up({"name": "lib-up", "zone": "us-central1-a", "accelerator": "v3-8"}, on_event=seen.append)
    assert run.project == api_env and run.target == "local" and len(run.workers) == 1
    assert {e.key for e in seen if isinstance(e, ev.ResourceChanged) and e.state == "ready"} >= {
        "tpu/us-central1-a/lib-up", f"bucket/us-central1/{run.bucket}"}
    assert [s.state_text for s in tpuctl.status(run)] == ["ready"]

    # Over a (tiny) budget, the run is what gc would delete; a dry run deletes nothing.
    result = tpuctl.gc(dry_run=True, budget_usd=1e-9)
    assert {(o.action.run, o.action.verdict, o.record()["status"]) for o in result.outcomes
            if o.action.resource.kind.value == "tpu"} == {("lib-up", "delete", "would-delete")}
    assert not _zero(cloud, api_env)

    gone = tpuctl.down(run, delete_bucket=True)
    assert {r.name for r in gone.deleted} >= {"lib-up", run.bucket} and not gone.kept
    assert _zero(cloud, api_env) and _buckets(cloud, api_env) == []


def test_cancelling_a_python_run_mid_training_tears_it_down(cloud, api_env):
    cancel = threading.Event()
    seen: list[ev.Event] = []

    def on_event(e: ev.Event) -> None:
        seen.append(e)
        if isinstance(e, ev.Metrics) and e.step >= 3:
            cancel.set()

    spec = _spec("lib-cancel", accelerator="v3-8", trainer={"max_steps": 2000, "step_seconds": 0.05})
    with pytest.raises(Interrupted) as info:
        tpuctl.run(spec, on_event=on_event, cancel=cancel, poll_s=0.3)
    assert info.value.outcome.state == "interrupted"
    assert _zero(cloud, api_env), "nothing left running"
    names = [e.name for e in seen if isinstance(e, ev.PhaseStarted)]
    assert names[-1] == "tear down" and "collect" not in names
    assert max(e.step for e in seen if isinstance(e, ev.Metrics)) < 2000


def test_a_failing_callback_stops_the_run_and_it_still_tears_down(cloud, api_env):
    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.Metrics) and e.step >= 3:
            raise ZeroDivisionError("the notebook's bug")

    spec = _spec("lib-badcb", accelerator="v3-8", trainer={"max_steps": 2000, "step_seconds": 0.05})
    with pytest.raises(tpuctl.errors.TpuctlError, match="on_event callback failed.*the notebook's bug") as info:
        tpuctl.run(spec, on_event=on_event, poll_s=0.3)
    assert info.value.outcome.state == "failed" and (info.value.outcome.step or 0) < 2000
    assert _zero(cloud, api_env)


def test_an_unexpected_exception_mid_run_tears_down_and_is_reported_as_one_of_ours(cloud, api_env, monkeypatch):
    # A bug (or an answer tpuctl does not understand) after `up`: the run still tears down, and the caller gets
    # the TpuctlError hierarchy's one line and exit code 1, not a bare KeyError.
    from tpuctl.jobs.pipeline import Pipeline

    def ship(self, data_url):
        raise KeyError("bundle")

    monkeypatch.setattr(Pipeline, "ship", ship)
    with pytest.raises(tpuctl.errors.TpuctlError, match=r"^unexpected KeyError: 'bundle' \(in ship, ") as info:
        tpuctl.run(_spec("lib-keyerr", accelerator="v3-8"), poll_s=0.3)
    assert info.value.exit_code == 1 and info.value.outcome.state == "failed"
    assert _zero(cloud, api_env)


@pytest.mark.slow  # fast tier: the events: test_run_from_python_reports_typed_events_in_order
def test_cli_run_json_is_one_event_per_line_and_plain_progress_never_repeats_a_state(cloud, project, tmp_path):
    spec = _spec_file(tmp_path, _spec("ndjson-run", accelerator="v3-8"))
    r = subprocess.run([sys.executable, "-m", "tpuctl", "run", str(spec), "--yes", "--json", "--poll", "0.5"],
                       env=_env(cloud, tmp_path, project), cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    summary = records.pop()
    assert summary["type"] == ev.SUMMARY_TYPE and summary["state"] == "succeeded" and summary["step"] == 15
    events = [ev.from_json(d) for d in records]
    assert {"run_planned", "resource", "phase_started", "metrics", "log", "cost"} <= {e.type for e in events}
    assert _zero(cloud, project)
    last: dict[str, tuple[str, str]] = {}  # a resource event says it changed: none repeats its last one
    for e in events:
        if isinstance(e, ev.ResourceChanged):
            assert last.get(e.key) != (e.state, e.detail), e
            last[e.key] = (e.state, e.detail)

    # Without a terminal: one line per state a resource reaches, none saying only that time passed.
    states = re.findall(r"^(\S+/\S+): (\w+)", r.stderr, flags=re.M)
    assert states and len(states) == len(set(states)), r.stderr
    assert ("==> train" in r.stderr) and "[w0] step=15 " in r.stderr


@pytest.mark.slow  # fast tier: a terminal's question: test_up_down's test_a_terminal_is_asked_whatever_no_color_says
def test_on_a_terminal_run_asks_then_shows_a_live_board(cloud, project, tmp_path):
    from test_up_down import _on_a_terminal

    spec = _spec_file(tmp_path, _spec("board-run", accelerator="v3-8"))
    env = {k: v for k, v in _env(cloud, tmp_path, project).items() if k != "NO_COLOR"}
    code, text = _on_a_terminal({**env, "TERM": "xterm-256color", "COLUMNS": "160"}, "run", str(spec),
                                "--poll", "0.5", answer="y", timeout=240)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert code == 0, plain[-3000:]
    assert "for run board-run at" in plain and "[y/N]" in plain  # the question, with the live view paused
    assert "worker 0" in plain and "step 15" in plain and "examples/s" in plain, plain[-3000:]
    assert "phase train" in plain and "cost " in plain and "ETA" in plain
    assert "run board-run: succeeded" in plain and _zero(cloud, project)
