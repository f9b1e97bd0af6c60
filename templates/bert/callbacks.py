"""The training callback: progress lines, TensorBoard scalars and checkpoints (formats in train.py), and the
save on a preemption notice (templates/README.md, "Save on notice")."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import keras
import tensorflow as tf

from .checkpoints import host_array


class Monitor(keras.callbacks.Callback):
    """Progress lines, TensorBoard scalars and checkpoints, keyed by the step: `start` (the restored optimizer
    step) plus the steps of this fit. `self.model` is touched only when a line or a checkpoint is due: on JAX
    that access copies the whole training state back into the model's variables.

    `checkpoint(step) -> path` and `writer` are None on JAX processes other than 0: they train, process 0 writes.

    A save asked for by a notice (`notices()`: SIGUSR1, the agent's; SIGTERM, the guest's shutdown) happens at
    the first step boundary after it (one execution of `steps_per_execution` steps at worst); after SIGTERM's
    the process ends as SIGTERM would have ended it. With `processes` > 1 (JAX multi-host) the hosts agree on
    every boundary whether any of them was notified (one small all-gather per execution), so all save the same
    step: the idea of jax's `multihost_utils.reached_preemption_sync_point`, without its SIGTERM-only notifier.
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
                      f"learning_rate={lr:.6g} examples_per_sec={rate:.1f}")
            if self.writer is not None:
                with self.writer.as_default(step=step):
                    for name, value in self.last.items():
                        tf.summary.scalar(name, value)
                self.writer.flush()
            self.model.reset_metrics()  # the next line averages its own window, not the run so far
            self.window_step, self.window_time = step, now
        if step % self.checkpoint_every == 0:
            self.save(step)
        requested = self._noticed()
        if requested:
            if self.saved_step != step:
                self.save(step)
            if signal.SIGTERM in requested:
                self.emit(f"stopped step={step} reason=sigterm")
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # end as the shutdown's SIGTERM would have
                os.kill(os.getpid(), signal.SIGTERM)

    def _noticed(self) -> set[int]:
        """The notices taken since the last boundary; on several processes, those of any of them."""
        requested = self.notice.take()
        if self.processes < 2:
            return requested
        import numpy as np
        from jax.experimental import multihost_utils

        mine = np.array([signal.SIGUSR1 in requested, signal.SIGTERM in requested], np.int32)
        anyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2).max(axis=0)
        return {s for s, flag in zip((signal.SIGUSR1, signal.SIGTERM), anyone) if flag}

    def save(self, step: int) -> None:
        self.saved_step = step
        self.model  # noqa: B018 - the property syncs JAX's training state into the variables the checkpoint reads
        if self.checkpoint is not None:
            self.emit(f"checkpoint step={step} path={self.checkpoint(step)}")


class _Notice:
    """The save requests the process received (signal numbers), set by the handlers `notices()` installs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: set[int] = set()

    def note(self, signum, frame=None) -> None:
        with self._lock:
            self._pending.add(signum)

    def take(self) -> set[int]:
        with self._lock:
            pending, self._pending = self._pending, set()
        return pending


NOTICE = _Notice()
# The template contract's save request (templates/README.md, "Save on notice"): the agent's SIGUSR1 on the
# metadata server's preemption or maintenance notice; SIGTERM, the guest's shutdown (Spot: 30 s before power off).
NOTICE_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


@contextlib.contextmanager
def notices():
    """While training: a notice signal asks for a checkpoint at the next step boundary instead of ending the
    process at once. Outside the main thread (Python delivers signals only there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    NOTICE.take()  # a notice that came before this training belongs to no step of it
    previous = {sig: signal.signal(sig, NOTICE.note) for sig in NOTICE_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
