"""A training program that logs TensorBoard scalars as the BERT template does (loss, mlm_accuracy,
learning_rate, examples_per_sec every `trainer.log_every` steps into `model_dir/tensorboard`), written with the
tensorboard package's own event writer so the job starts in a second instead of importing TensorFlow.
Same command line as the BERT template: `python -m scalars.train --config CONFIG.json`.
"""

import argparse
import json
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    known, _ = parser.parse_known_args()
    config = json.loads(Path(known.config).read_text())
    trainer = config.get("trainer", {})
    writer = EventFileWriter(str(Path(config["runtime"]["model_dir"]) / "tensorboard"))
    max_steps, every = int(trainer.get("max_steps", 20)), int(trainer.get("log_every", 5))
    for step in range(1, max_steps + 1):
        time.sleep(float(trainer.get("step_seconds", 0.05)))
        if step % every:
            continue
        values = {"loss": 10.0 / step, "mlm_accuracy": step / max_steps, "learning_rate": 1e-3 * step / max_steps,
                  "examples_per_sec": 100.0}
        print(f"step={step} " + " ".join(f"{k}={v:g}" for k, v in values.items()), flush=True)
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v)
                                             for k, v in values.items()])
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        writer.flush()
    writer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
