"""`run`: the process supervisor. Stages the job's data, runs the program, heartbeats its state into the bucket,
forwards a cancel's SIGTERM and records the exit status."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import notice
from .install import tensorflow_version
from .storage import open_storage

STEP = re.compile(rb"\bstep=(\d+)")
CANCEL_MARKER = "cancelled"  # written by a cancel (jobs/remote.py, the bootstrap's relaunch) before its SIGTERM


class Agent:
    def __init__(self, bundle: Path, worker: int):
        self.bundle = bundle.resolve()
        self.home = self.bundle.parent
        self.child: subprocess.Popen | None = None
        self.terminated = False
        # First, before the storage client's slow import: the bootstrap starts the agent with SIGTERM ignored
        # and a cancel leaves CANCEL_MARKER before it signals, so a cancel at any moment of the start is seen
        # here (the marker) or by the handler, never lost to SIGTERM's default action.
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if (self.home / CANCEL_MARKER).exists():
            self.terminated = True
        self.job = json.loads((self.bundle / "job.json").read_text())
        self.worker = worker
        self.num_workers = int(self.job.get("num_workers") or 1)
        self.store = open_storage(self.job, worker, self.home)
        self.step: int | None = None
        self.state = "running"
        self.exit_code: int | None = None
        self.ended: float | None = None
        self.log_path = self.home / "job.log"
        self._log_size = -1
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.save_request = self.home / notice.SAVE_REQUEST

    def say(self, message: str) -> None:
        """The agent's own notes go into the job's log, where `tpuctl logs` and the bucket copy show them."""
        with open(self.log_path, "ab") as log:  # O_APPEND: whole lines, interleaved safely
            log.write(f"tpuctl agent: {message}\n".encode())

    # --- status
    def _worker_doc(self) -> dict:
        return {"worker": self.worker, "state": self.state, "step": self.step, "heartbeat": int(time.time()),
                "exit_code": self.exit_code, "ended": self.ended}

    def publish(self, final: bool = False) -> None:
        with self._lock:
            if self.worker == 0:
                self.store.sync()
            size = self.log_path.stat().st_size if self.log_path.exists() else -1
            if size != self._log_size or final:
                self.store.put_file(f"logs/worker-{self.worker}.log", self.log_path)
                self._log_size = size
            self.store.put_json(f"workers/worker-{self.worker}.json", self._worker_doc())
            if self.worker == 0 or final:
                self.store.merge_status(self._aggregate())

    def _aggregate(self) -> dict:
        docs = {self.worker: self._worker_doc()}
        for i in range(self.num_workers):
            if i != self.worker:
                doc = self.store.get_json(f"workers/worker-{i}.json")
                if doc:
                    docs[i] = doc
        states = [d.get("state") for d in docs.values()]
        failed = [d for d in docs.values() if d.get("state") == "failed"]
        if failed:
            # The first worker to fail is the cause; the others were usually stopped because of it.
            first = min(failed, key=lambda d: d.get("ended") or float("inf"))
            state, code = "failed", first.get("exit_code")
        elif len(docs) == self.num_workers and all(s == "succeeded" for s in states):
            state, code = "succeeded", 0
        else:
            state, code = "running", None
        steps = [d.get("step") for d in docs.values() if d.get("step") is not None]
        return {"state": state, "heartbeat": int(time.time()), "step": max(steps) if steps else None,
                "exit_code": code, "workers": self.num_workers}

    def _heartbeat_loop(self) -> None:
        interval = float(self.job.get("heartbeat_s") or 10)
        while not self._stop.wait(interval):
            try:
                self.publish()
            except Exception as exc:  # a flaky bucket must not kill training; the next beat retries
                self.say(f"sync failed: {type(exc).__name__}: {exc}")

    # --- notices
    def on_notice(self, what: str) -> None:
        self.say(f"notice: {what}: asking the program to checkpoint at its next step")
        notice.request_save(self.save_request, what)

    # --- process
    def _on_term(self, signum, frame) -> None:
        self.terminated = True
        if self.child and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        # The log exists from the first moment, so `tpuctl logs -f` follows staging (which can take long)
        # instead of giving up waiting for the file.
        self.log_path.touch()
        from importlib import metadata

        try:
            keras = metadata.version("keras")
        except metadata.PackageNotFoundError:
            keras = None
        # Into agent.log (the job's log starts with the program's own output): what the job runs with.
        print(f"tpuctl agent: python={sys.version.split()[0]} tensorflow={tensorflow_version()} keras={keras}",
              flush=True)
        if not self.terminated:
            self.store.stage(self.say)
        work = self.home / "config.json"
        config = json.loads(json.dumps(self.job.get("config") or {}))  # a copy: the storage may rewrite paths
        work.write_text(json.dumps(self.store.program_config(config), indent=1))
        argv = [sys.executable, "-u", "-m", self.job["module"], "--config", str(work), *self.job.get("args", [])]
        env = {**os.environ, **{str(k): str(v) for k, v in (self.job.get("env") or {}).items()},
               "PYTHONPATH": os.pathsep.join(p for p in (str(self.bundle), os.environ.get("PYTHONPATH")) if p),
               "TPUCTL_RUN": self.job["run"], "TPUCTL_WORKER": str(self.worker),
               notice.SAVE_REQUEST_VAR: str(self.save_request)}
        self.save_request.unlink(missing_ok=True)  # a request of a previous boot's notice was for its program
        self.publish()
        beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        beat.start()
        notice.start_watching(self._stop, self.on_notice)
        if self.terminated:
            self.say("cancelled before the program started")
            code = -signal.SIGTERM
        else:
            code = self._supervise(argv, env)
        if self.terminated and not (self.home / CANCEL_MARKER).exists():
            return self._guest_stopped(beat)
        self.ended = time.time()
        self.exit_code = 128 - code if code < 0 else code
        self.state = "succeeded" if self.exit_code == 0 else "failed"
        self._stop.set()
        beat.join(timeout=30)
        for attempt in range(5):
            try:
                self.publish(final=True)
                break
            except Exception as exc:
                self.say(f"final sync failed: {type(exc).__name__}: {exc}")
                time.sleep(1 + attempt)
        tmp = self.home / "exit_code.tmp"
        tmp.write_text(f"{self.exit_code}\n")
        tmp.replace(self.home / "exit_code")
        if self.worker == 0 and self.num_workers > 1:
            self._settle_status()
        return self.exit_code

    def _guest_stopped(self, beat: threading.Thread) -> int:
        """A SIGTERM that no cancel asked for is the guest's shutdown (maintenance, preemption, a stop: Google
        stops the OS, which signals every process). The job did not end, so no exit code is recorded: the worker
        reads `lost`, which tpuctl recovers from, where an exit code would have read as the job failing."""
        self.say("SIGTERM without a cancel: the machine is shutting down; the job did not end here")
        self._stop.set()
        beat.join(timeout=30)
        try:
            self.publish(final=True)  # the log, with the checkpoint the notice saved; the state stays running
        except Exception as exc:  # noqa: BLE001 - the machine is going down; the next launch publishes again
            self.say(f"final sync failed: {type(exc).__name__}: {exc}")
        return 128 + signal.SIGTERM

    def _supervise(self, argv: list[str], env: dict[str, str]) -> int:
        """Runs the program, copying its output into the job log; returns its wait status."""
        with open(self.log_path, "ab", buffering=0) as log:
            self.child = subprocess.Popen(argv, cwd=self.bundle, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            if self.terminated:  # the SIGTERM came between the check in run() and the child's existence
                self.child.send_signal(signal.SIGTERM)
            assert self.child.stdout is not None
            for line in iter(self.child.stdout.readline, b""):
                log.write(self.store.log_line(line))
                m = STEP.search(line)
                if m:
                    self.step = int(m.group(1))
            return self.child.wait()

    def _settle_status(self) -> None:
        """Workers finishing together can each aggregate before seeing the others' final state; worker 0
        waits (bounded) until every worker reported, so a detached run's status.json ends final for gc.
        An attached `tpuctl run` does not wait for this: it reads the exit_code files and writes its own."""
        end = time.monotonic() + max(60.0, 10 * float(self.job.get("heartbeat_s") or 10))
        while time.monotonic() < end:
            try:
                doc = self._aggregate()
                if doc["state"] != "running":
                    self.store.merge_status(doc)
                    return
            except Exception as exc:  # noqa: BLE001 - retried until the deadline
                self.say(f"status aggregation failed: {type(exc).__name__}: {exc}")
            time.sleep(1.0)

