"""The training callback: progress lines, TensorBoard scalars and checkpoints (formats in train.py), and the
save on a preemption notice (templates/README.md, "Save on notice")."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time

import keras
import tensorflow as tf

from .checkpoints import host_array


class Monitor(keras.callbacks.Callback):
    """Progress lines, TensorBoard scalars and checkpoints, keyed by the step: `start` (the restored optimizer
    step) plus the steps of this fit. `self.model` is touched only when a line or a checkpoint is due: on JAX
    that access copies the whole training state back into the model's variables.

    `writer` is None on JAX processes other than 0: they train, process 0 writes. `checkpoint(step) -> path` is
    called on every process (gathering weights split over processes is a collective); it returns None, and no line
    is printed, where it wrote nothing.

    A save asked for by a notice (the contract's, templates/README.md "Save on notice": the file that
    `TPUCTL_SAVE_REQUEST` names appears, the agent's answer to the metadata server's notice; or SIGTERM, the
    guest's shutdown, while `notices()` is in force) happens at the first step boundary after it (one execution
    of `steps_per_execution` steps at worst); after SIGTERM's the process ends as SIGTERM would have ended it.
    With `processes` > 1 (JAX multi-host) the hosts agree at every boundary whether any of them was notified
    (one small all-gather per execution), so all save the same step: the idea of jax's
    `multihost_utils.reached_preemption_sync_point`, without its SIGTERM-only notifier.
    """

    def __init__(self, checkpoint, schedule, global_batch, log_every, checkpoint_every, writer, emit, start, *,
                 accuracy: str = "mlm_accuracy", processes: int = 1):
        super().__init__()
        self.processes = processes
        self.notice = NOTICE
        self.accuracy = accuracy  # the compiled accuracy metric's name, as it appears in the progress line
        self.checkpoint, self.schedule, self.global_batch = checkpoint, schedule, global_batch
        self.log_every, self.checkpoint_every, self.writer, self.emit = log_every, checkpoint_every, writer, emit
        self.start = start
        self.window_step, self.window_time = start, time.monotonic()
        self.last: dict = {}
        self.saved_step = -1

    def on_train_batch_end(self, batch, logs=None):
        step = self.start + batch + 1  # Keras passes the last step of the execution
        if step - self.window_step >= self.log_every:
            now = time.monotonic()
            rate = self.global_batch * (step - self.window_step) / max(now - self.window_time, 1e-9)
            lr = float(self.schedule(step))
            self.last = {"loss": float(host_array(logs["loss"])),
                         self.accuracy: float(host_array(logs[self.accuracy])),
                         "learning_rate": lr, "examples_per_sec": rate}
            self.emit(f"step={step} loss={self.last['loss']:.4f} {self.accuracy}={self.last[self.accuracy]:.4f} "
                      f"learning_rate={lr:.6g} examples_per_sec={rate:.1f} time={time.time():.3f}")
            if self.writer is not None:
                with self.writer.as_default(step=step):
                    for name, value in self.last.items():
                        tf.summary.scalar(name, value)
                self.writer.flush()
            self.model.reset_metrics()  # the next line averages its own window, not the run so far
            self.window_step, self.window_time = step, now
        if step % self.checkpoint_every == 0:
            self.save(step)
        requested, stop = self._noticed()
        if requested or stop:
            if self.saved_step != step:
                self.save(step)
            if stop:
                self.emit(f"stopped step={step} reason=sigterm")
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # end as the shutdown's SIGTERM would have
                os.kill(os.getpid(), signal.SIGTERM)

    def _noticed(self) -> tuple[bool, bool]:
        """(a save was requested, SIGTERM came) since the last boundary; on several processes, by any of them."""
        request = os.environ.get(SAVE_REQUEST_VAR)
        requested = False
        if request and os.path.exists(request):
            with contextlib.suppress(FileNotFoundError):
                os.remove(request)  # taken: the next request is a new file
            requested = True
        stop = self.notice.take()
        if self.processes < 2:
            return requested, stop
        import numpy as np
        from jax.experimental import multihost_utils

        anyone = np.asarray(multihost_utils.process_allgather(np.array([requested, stop], np.int32)))
        requested, stop = (bool(flag) for flag in anyone.reshape(-1, 2).max(axis=0))
        return requested, stop

    def save(self, step: int) -> None:
        self.saved_step = step
        self.model  # noqa: B018 - the property syncs JAX's training state into the variables the checkpoint reads
        path = self.checkpoint(step) if self.checkpoint is not None else None
        if path is not None:
            self.emit(f"checkpoint step={step} path={path}")


# The template contract's save request (templates/README.md, "Save on notice"): the path of a file whose
# appearance asks for a checkpoint at the next step boundary (the agent writes it on the metadata server's
# preemption or maintenance notice); the guest's shutdown SIGTERM asks for one too, then the end.
SAVE_REQUEST_VAR = "TPUCTL_SAVE_REQUEST"


class _Shutdown:
    """Whether SIGTERM came while `notices()` was in force: its handler notes it, the boundary takes it."""

    def __init__(self):
        self._event = threading.Event()

    def note(self, signum=None, frame=None) -> None:
        self._event.set()

    def take(self) -> bool:
        came = self._event.is_set()
        self._event.clear()
        return came


NOTICE = _Shutdown()


@contextlib.contextmanager
def notices():
    """While training: SIGTERM asks for a checkpoint at the next step boundary, then the end, instead of ending
    the process at once. Outside the main thread (Python delivers signals only there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    NOTICE.take()  # a SIGTERM noted before this training belongs to no step of it
    previous = signal.signal(signal.SIGTERM, NOTICE.note)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Profile(keras.callbacks.Callback):
    """A profiler trace of training steps `first`..`last` (the progress lines' numbering) into `logdir` (the
    TensorBoard directory), as `plugins/profile/RUN_TIMESTAMP/HOST.xplane.pb`: where TensorBoard's profile plugin
    (XProf) finds it. JAX's profiler (`jax.profiler.start_trace`) on the JAX backend, TensorFlow's
    (`tf.profiler.experimental.start`) on TensorFlow: each records its own runtime's device activity.

    Keras reports steps once per execution of `steps_per_execution` steps, so the trace spans whole executions,
    from the one holding `first` to the one holding `last`; a resumed run traces what is left of the window.
    The profiler writes to a local directory first (JAX's writer does not reach gs://), then the files are copied
    under `logdir` with tf.io.gfile, which reaches gs:// and local paths alike."""

    def __init__(self, steps: tuple[int, int], logdir: str, start: int, steps_per_execution: int, emit):
        super().__init__()
        self.first, self.last = steps
        self.logdir, self.start, self.steps_per_execution, self.emit = logdir, start, steps_per_execution, emit
        self.local: str | None = None  # the profiler's directory while tracing
        self.traced = (0, 0)  # the first and the last step traced so far
        self.done = False
        self.jax = keras.backend.backend() == "jax"

    def on_train_batch_begin(self, batch, logs=None):
        step = self.start + batch + 1  # the first step of this execution
        if self.local is None and not self.done and step <= self.last \
                and step + self.steps_per_execution - 1 >= self.first:
            self.local = tempfile.mkdtemp(prefix="tpuctl-profile-")
            if self.jax:
                import jax

                jax.profiler.start_trace(self.local)
            else:
                tf.profiler.experimental.start(self.local)
            self.traced = (step, step)

    def on_train_batch_end(self, batch, logs=None):
        step = self.start + batch + 1  # the last step of this execution
        if self.local is not None:
            self.traced = (self.traced[0], step)
            if step >= self.last:
                self.finish(logs)

    def on_train_end(self, logs=None):
        if self.local is not None:  # stopped before `last` (a notice): what was traced is still worth keeping
            self.finish(logs)

    def finish(self, logs) -> None:
        """Stop the profiler once the traced steps really ran (JAX dispatches asynchronously), publish the trace."""
        if self.jax:
            import jax

            jax.block_until_ready(logs)
            jax.profiler.stop_trace()
        else:
            tf.profiler.experimental.stop()
        local, self.local, self.done = self.local, None, True
        copied = []
        for root, _, files in os.walk(local):
            rel = os.path.relpath(root, local).replace(os.sep, "/")
            target = self.logdir.rstrip("/") + ("" if rel == "." else "/" + rel)
            for name in files:
                tf.io.gfile.makedirs(target)
                tf.io.gfile.copy(os.path.join(root, name), f"{target}/{name}", overwrite=True)
                copied.append(target)
        shutil.rmtree(local, ignore_errors=True)
        where = min(copied, key=len) if copied else self.logdir
        self.emit(f"profile steps={self.traced[0]}-{self.traced[1]} path={where}")
