"""Jobs: ship a templated training job to every TPU worker, watch it, survive preemption, and `tpuctl run`.

Modules, bottom up:
- `keys`: the per-user ed25519 key pair (created once, 0600) and its `ssh-keys` metadata line.
- `ssh`: connections to every worker at once (`Fleet`), host keys verified (published, else trust on
  first use, recorded), retried with a deadline while the key propagates.
- `remote`: the worker-side layout and every command sent there, values `shlex.quote`d; renders
  `templates/bootstrap.sh.tmpl`.
- `bundle`: template + resolved config + user files + the agent, as a reproducible tar.gz named by sha256.
- `agent/` (a package): shipped in the bundle; wraps the training process on each worker (stage data and checkpoints
  when storage is emulated, heartbeat + status.json, log copies to the bucket, exit status file).
- `launch`: bootstrap all workers, poll their job state, cancel.
- `logs`: worker-prefixed log streaming that resumes at the byte offset after a reconnect.
- `cluster`: a run's node/workers/bucket via `tpuctl.provision`, and its launch/status records in the bucket.
- `pipeline`: `tpuctl run` end to end, recovery from preemption, teardown in a `finally`.
"""
