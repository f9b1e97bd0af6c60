"""The run's states and transitions (jobs/pipeline.py) and the goodput read from its timeline (jobs/timeline.py),
without a cloud: the whole-run check is test_run.py's preemption test."""

from __future__ import annotations

import pytest

from tpuctl import catalog, cost
from tpuctl.jobs.pipeline import NOTHING_UP, TRANSITIONS, Verdict
from tpuctl.jobs.pipeline import RunState as Step
from tpuctl.jobs.timeline import CLOSED, Mark, Timeline, account, gone_by, intervals
from tpuctl.ledger import Entry


def test_every_state_is_reachable_and_every_run_ends_torn_down_or_with_nothing_up():
    reachable, todo = {Step.VALIDATE, Step.ATTACH}, [Step.VALIDATE, Step.ATTACH]
    while todo:
        here = todo.pop()
        for (state, _), after in TRANSITIONS.items():
            if state is here and after not in reachable:
                reachable.add(after)
                todo.append(after)
    assert reachable == set(Step)
    exits = {state for state, _ in TRANSITIONS}
    assert exits == set(Step) - {Step.DONE, Step.FAILED}, "a state without a way on would hang the loop"
    # DONE is reached without tearing down only when nothing was created (dry run) or on purpose (detach).
    into_done = {(state, verdict) for (state, verdict), after in TRANSITIONS.items() if after is Step.DONE}
    assert into_done == {(Step.VALIDATE, Verdict.DRY_RUN), (Step.LAUNCH, Verdict.DETACHED),
                         (Step.COLLECT, Verdict.OK), (Step.TEARDOWN, Verdict.OK)}
    assert {after for (state, _), after in TRANSITIONS.items() if state is Step.TEARDOWN} == {
        Step.COLLECT, Step.DONE, Step.FAILED}
    assert NOTHING_UP == {Step.VALIDATE, Step.ATTACH}


def _preempted_run() -> Timeline:
    """Up 10 s, prep 5, launch 5, steps 1..12 from t=25 to 37 (checkpoints at 5 and 10), lost at 40, recovered
    (relaunched at 55, restored step 10, first step 11 at 60), steps to 30 at 79, job ends at 80, torn down at 90."""
    marks = [Mark(0, "up"), Mark(10, "prepare"), Mark(12, "ship"), Mark(15, "launch"), Mark(20, "workers_ready"),
             Mark(20, "watch"), Mark(25, "first_step", 1), Mark(29, "checkpoint", 5), Mark(34, "checkpoint", 10),
             Mark(37, "last_step", 12), Mark(40, "recover", detail="lost"), Mark(55, "workers_ready"),
             Mark(55, "watch", detail="ok"), Mark(58, "restored", 10), Mark(60, "first_step", 11),
             Mark(79, "last_step", 30), Mark(80, "teardown", detail="succeeded"), Mark(88, "collect"),
             Mark(90, "done")]
    return Timeline(marks)


def test_a_preempted_runs_time_splits_into_the_goodput_categories_and_adds_up():
    spans = intervals(_preempted_run().marks, now=1000)
    assert spans == [("provisioning", 0, 10), ("training_prep", 10, 12), ("training_prep", 12, 15),
                     ("program_startup", 15, 20), ("program_startup", 20, 25), ("productive", 25, 34),
                     ("wasted_progress", 34, 40), ("recovery", 40, 55), ("recovery", 55, 60), ("productive", 60, 79),
                     ("other", 79, 80), ("teardown", 80, 88), ("teardown", 88, 90)]
    # Two incarnations of a node: READY at 8 until lost at 38, READY again at 52 until deleted at 85 (on demand:
    # a spot node preempted in its first minute would cost nothing).
    nodes = [Entry(kind="tpu", name="n", project="p", location="europe-west4-a", run="r", owner="o", created=1,
                   deleted=45, accelerator="v3-32", billed_from=8, billed_until=38),
             Entry(kind="tpu", name="n", project="p", location="europe-west4-a", run="r", owner="o", created=46,
                   deleted=85, accelerator="v3-32", billed_from=52)]
    prices = catalog.load()
    acct = account(_preempted_run(), now=1000, entries=nodes, catalog=prices)
    assert acct.wall_s == 90 and sum(acct.seconds.values()) == 90 and acct.recoveries == 1 and acct.ended
    assert acct.goodput == pytest.approx(28 / 80)
    per_s = cost.hourly(nodes[0], prices) / 3600
    assert sum(acct.usd.values()) == pytest.approx(sum(cost.accrued(e, prices, now=1000) for e in nodes))
    assert acct.usd["provisioning"] == pytest.approx(2 * per_s) and acct.usd["teardown"] == pytest.approx(5 * per_s)
    assert acct.lost_to_preemption_usd == pytest.approx((38 - 34 + 60 - 52) * per_s)


def test_a_checkpoint_whose_line_died_with_the_node_is_placed_at_the_watchs_pace():
    marks = [m for m in _preempted_run().marks if not (m.what == "checkpoint" and m.step == 10)]
    spans = dict(((c, t0), t1) for c, t0, t1 in intervals(marks, now=1000))
    # Steps 1..12 took 25 s..37 s: step 10 was reached at 25 + 12 * 9/11.
    assert spans["productive", 25] == pytest.approx(25 + 12 * 9 / 11)


def test_steps_are_dated_by_the_workers_clock_not_by_when_their_lines_arrive():
    """Over SSH the first lines arrive in one burst once the connection is up (and a short watch's every line
    may): dated on arrival, the steps would take no time and the goodput would read 0."""
    import time

    from tpuctl import events
    from tpuctl.jobs.pipeline import Outcome, _Stream

    seen: list = []
    stream = _Stream(Outcome(run="r"), emit=seen.append)
    now = time.time()
    for step in range(1, 13):  # twelve steps, 0.1 s apart on the worker, read in one burst now
        stream(0, f"step={step} loss=1.0 examples_per_sec=100.0 time={now - 1.2 + step / 10:.3f}")
    stream(0, f"step=13 loss=1.0 time={now + 3600:.3f}")  # a clock an hour ahead is not believed past now
    ats = [e.at for e in seen if isinstance(e, events.Metrics)]
    assert ats[:12] == pytest.approx([now - 1.2 + step / 10 for step in range(1, 13)], abs=1e-3)
    assert now <= ats[12] <= time.time() and stream.last_step_at == ats[12]
    # The job trained its first step between its launch's workers_ready and the watch's mark: still the watch's.
    marks = [Mark(0, "launch"), Mark(5, "workers_ready"), Mark(5.005, "first_step", 1), Mark(5.01, "watch"),
             Mark(9, "last_step", 40), Mark(10, "teardown"), Mark(11, "done")]
    assert intervals(marks, now=100)[:3] == [("program_startup", 0, 5.01), ("productive", 5.01, 9), ("other", 9, 10)]


def test_a_resource_nobody_saw_deleted_went_when_its_runs_teardown_moved_on():
    """For the ledger's entries a scan closed (tpuctl.ledger `closed_by_scan`): the TPU once the teardown moved on
    to `collect`, the supervisor VM (deleted by itself after the end) at the end; nothing while the run goes on."""
    marks = _preempted_run().marks
    assert gone_by(marks, "tpu") == 88 and gone_by(marks, "queued-resource") == 88 and gone_by(marks, "vm") == 90
    assert gone_by(marks[:-1], "tpu") is None
    # A supervisor that found no TPU ends the run without a teardown; what was left went at its end.
    assert gone_by([Mark(0, "up"), Mark(10, "attach"), Mark(12, "failed")], "tpu") == 12


def _unwatched_run() -> list[Mark]:
    """`run --detach --no-supervisor`: up 10 s, prep 5, launch 5, then nobody watched; `gc` deleted its TPU from 100
    to 104 and ended it."""
    return [Mark(0, "up"), Mark(10, "prepare"), Mark(12, "ship"), Mark(15, "launch"), Mark(20, "workers_ready"),
            Mark(20, "detached", detail="detached"), Mark(100, "teardown", detail="gc: finished"),
            Mark(104, CLOSED, detail="gc: finished")]


def test_a_run_nobody_watched_ends_where_its_tpu_was_deleted_and_its_goodput_is_unknown():
    acct = account(Timeline(_unwatched_run()), now=10_000)
    assert acct.ended and acct.wall_s == 104 and account(Timeline(_unwatched_run()), now=20_000).wall_s == 104
    assert acct.seconds["other"] == 80 and acct.seconds["teardown"] == 4 and acct.seconds["productive"] == 0
    assert acct.goodput is None and acct.to_json()["goodput"] is None  # it trained unseen: not 0
    # Watched all along, a job that never reached a step has a goodput, and it is 0.
    watched = [Mark(0, "up"), Mark(10, "launch"), Mark(20, "workers_ready"), Mark(20, "watch"),
               Mark(50, "teardown", detail="failed"), Mark(55, "failed")]
    assert account(Timeline(watched), now=100).goodput == 0
