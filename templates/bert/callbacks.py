"""The training callback: progress lines, TensorBoard scalars and checkpoints (formats in train.py)."""

from __future__ import annotations

import time

import keras
import tensorflow as tf


class Monitor(keras.callbacks.Callback):
    """Progress lines, TensorBoard scalars and checkpoints, keyed by the optimizer's step counter."""

    def __init__(self, manager, schedule, global_batch, log_every, checkpoint_every, writer, emit, start, *,
                 accuracy: str = "mlm_accuracy"):
        super().__init__()
        self.accuracy = accuracy  # the compiled accuracy metric's name, as it appears in the progress line
        self.manager, self.schedule, self.global_batch = manager, schedule, global_batch
        self.log_every, self.checkpoint_every, self.writer, self.emit = log_every, checkpoint_every, writer, emit
        self.window_step, self.window_time = start, time.monotonic()
        self.last: dict = {}
        self.saved_step = -1

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step - self.window_step >= self.log_every:
            now = time.monotonic()
            rate = self.global_batch * (step - self.window_step) / max(now - self.window_time, 1e-9)
            lr = float(self.schedule(step))
            self.last = {"loss": float(logs["loss"]), self.accuracy: float(logs[self.accuracy]),
                         "learning_rate": lr, "examples_per_sec": rate}
            self.emit(f"step={step} loss={self.last['loss']:.4f} {self.accuracy}={self.last[self.accuracy]:.4f} "
                      f"learning_rate={lr:.6g} examples_per_sec={rate:.1f}")
            with self.writer.as_default(step=step):
                for name, value in self.last.items():
                    tf.summary.scalar(name, value)
            self.writer.flush()
            self.model.reset_metrics()  # the next line averages its own window, not the run so far
            self.window_step, self.window_time = step, now
        if step % self.checkpoint_every == 0:
            self.save(step)

    def save(self, step: int) -> None:
        path = self.manager.save(checkpoint_number=step)
        self.saved_step = step
        self.emit(f"checkpoint step={step} path={path}")
