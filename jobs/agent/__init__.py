"""The worker-side agent: shipped in every job bundle as the package `tpuctl_agent`, run by the
bootstrap as `python -m tpuctl_agent prepare|run`.

Needs only the standard library and google-cloud-storage (the worker's runtime Python has no tpuctl).

`prepare`: installs the template's requirements into this Python once per requirements hash (a marker file
caches it), skipping distributions that are already installed (the local cloud has no network). Keras is
pinned to the release the template is tested with for this interpreter's TensorFlow (template.json's
`keras_by_tensorflow`, by TF minor version): the runtime image's TensorFlow decides, never pip's newest
Keras; a TensorFlow older than every tested one fails here, with what to use instead.

`run`: wraps the training process. When the bundle chose the `mirror` storage (a storage emulator, which
TensorFlow's gs:// filesystem cannot read; `storage.py`) it mirrors the config's gs:// data and model locations to local disk, restores the
latest checkpoint from the bucket before the start (resume after preemption), and worker 0 syncs the model
directory (checkpoints, TensorBoard events, exports) back periodically and at exit. On a real TPU VM the
program writes gs:// itself and the agent only heartbeats and copies logs. Every worker copies its log to
`gs://BUCKET/runs/RUN/logs/worker-N.log` and its state to `.../workers/worker-N.json`; `.../status.json`
aggregates them: {"state": running|succeeded|failed, "heartbeat", "step", "exit_code", "workers"}, merged into
what the laptop wrote there (`storage.merge_status`; the record's schema is `status.py`).
`exit_code` (local file) is written last: when it exists, logs and checkpoints are in the bucket.

Preemption notices: the agent watches the guest's metadata server (`instance/preempted`, `instance/maintenance-event`,
`?wait_for_change=true`) and on a notice writes the save request file the program finds through
`TPUCTL_SAVE_REQUEST` (templates/README.md, "Save on notice"): the program checkpoints at its next step boundary.
The guest's shutdown then SIGTERMs every process (the program too: it saves, if it has not, and ends); the agent
forwards its own SIGTERM to the program and syncs the checkpoint to the bucket before the power goes off (30 s
after the shutdown starts on a Spot VM: compute.v1 `Scheduling.skipGuestOsShutdown`).

Modules (all shipped; standard library only at import, google-cloud-storage imported where a bucket is used):
- `__main__`: the command line (`prepare`, `run`).
- `install`: `prepare`, the requirements installer.
- `storage`: the storage interface (the run's bucket records, and what the program's storage needs), Cloud
  Storage itself; `mirror`: the same for a storage emulator (a local mirror of the program's gs:// locations).
- `status`: the status.json schema, shared with tpuctl.
- `notice`: the metadata server's preemption and maintenance notices, turned into save requests.
- `supervisor`: `run`, the process supervisor (staging, heartbeat, log copies, exit status).

Inside the package every import is relative: it is `tpuctl.jobs.agent` on the laptop and `tpuctl_agent` on a worker.
"""
