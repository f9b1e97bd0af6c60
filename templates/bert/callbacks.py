"""The training callback: progress lines, TensorBoard scalars and checkpoints (formats in train.py)."""

from __future__ import annotations

import time

import keras
import tensorflow as tf

from .checkpoints import host_array


class Monitor(keras.callbacks.Callback):
    """Progress lines, TensorBoard scalars and checkpoints, keyed by the step: `start` (the restored optimizer
    step) plus the steps of this fit. `self.model` is touched only when a line or a checkpoint is due: on JAX
    that access copies the whole training state back into the model's variables.

    `checkpoint(step) -> path` and `writer` are None on JAX processes other than 0: they train, process 0 writes.
    """

    def __init__(self, checkpoint, schedule, global_batch, log_every, checkpoint_every, writer, emit, start, *,
                 accuracy: str = "mlm_accuracy"):
        super().__init__()
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

    def save(self, step: int) -> None:
        self.saved_step = step
        self.model  # noqa: B018 - the property syncs JAX's training state into the variables the checkpoint reads
        if self.checkpoint is not None:
            self.emit(f"checkpoint step={step} path={self.checkpoint(step)}")
