"""What tpuctl runs on a worker: the bootstrap script and the small status / cancel / tail commands.

Layout on each worker, relative to the login directory (the SSH user's home on a TPU VM):
`.tpuctl/runs/RUN/wN/` holds `bundle/` (the unpacked job), `bundle.sha`, `agent.pid` (also the job's
process group id), `launch.id` (which launch started it), `job.log` (the training program's output), `agent.log`,
`cancelled` once a cancel was asked for, and `exit_code` once the job ended. The worker index is part of the
path so workers sharing one file system never collide.

Every value interpolated into a command line is `shlex.quote`d; nothing here concatenates raw input.
"""

from __future__ import annotations

import re
import shlex
from importlib import resources

from tpuctl.errors import BadInput

_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
RUN_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
ENV_CACHE = ".tpuctl/env"


def check_run_name(run: str) -> str:
    """Run names become label values, bucket paths and directory names: GCP label rules, checked early."""
    if not RUN_NAME.match(run or ""):
        raise BadInput(
            f"invalid run name {run!r}",
            field="name",
            hint="use 1-63 lowercase letters, digits and dashes, starting with a letter (e.g. --name bert-tiny-1)",
        )
    return run


def workdir(run: str, worker: int) -> str:
    return f".tpuctl/runs/{check_run_name(run)}/w{int(worker)}"


def render(template: str, values: dict[str, object]) -> str:
    """Fill `{{name}}` placeholders with shell-quoted values; a placeholder without a value is an error
    (a typo must not silently become an empty string in a shell script)."""
    missing = sorted(set(_PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise KeyError(f"bootstrap template needs values for {missing}")
    return _PLACEHOLDER.sub(lambda m: shlex.quote(str(values[m.group(1)])), template)


def bootstrap_script(*, run: str, worker: int, python: str, project: str, bucket: str, bundle_object: str,
                     bundle_sha: str, launch_id: str, storage: str) -> str:
    """The worker's bootstrap for one launch. `storage` is the bundle's (job.json `storage`, STORAGE_KINDS): the
    bundle is fetched with the client that storage's agent uses. Raises BadInput for an unknown storage kind."""
    from .bundle import check_storage  # bundle imports this module

    template = resources.files("tpuctl.templates").joinpath("bootstrap.sh.tmpl").read_text()
    return render(template, {
        "run": check_run_name(run), "worker": int(worker), "python": python, "project": project, "bucket": bucket,
        "bundle_object": bundle_object, "bundle_sha": bundle_sha, "launch_id": launch_id, "workdir": workdir(run, worker),
        "env_cache": ENV_CACHE, "storage": check_storage(storage),
    })


def bootstrap_command(script: str) -> str:
    """The SSH command that runs a rendered bootstrap. The script travels as one quoted argument rather than
    over stdin, so the job's own stdin stays /dev/null and nothing waits on the channel."""
    return f"bash -c {shlex.quote(script)}"


def status_command(run: str, worker: int) -> str:
    """Prints one line: `exited N`, `running PID`, `lost` (started, no process, no exit code) or `absent`."""
    d = shlex.quote(workdir(run, worker))
    return (
        f"cd {d} 2>/dev/null || {{ echo absent; exit 0; }}; "
        "if [ -f exit_code ]; then echo \"exited $(cat exit_code)\"; "
        "elif [ -f agent.pid ] && kill -0 \"$(cat agent.pid)\" 2>/dev/null; then echo \"running $(cat agent.pid)\"; "
        "elif [ -f agent.pid ]; then echo lost; else echo absent; fi"
    )


def cancel_command(run: str, worker: int, grace_s: int = 10) -> str:
    """SIGTERM the job's process group (the agent forwards it, syncs, records the exit), SIGKILL after
    `grace_s`. Idempotent: a finished or absent job is left as it is. The `cancelled` file first: an agent
    still starting (SIGTERM ignored until its handler exists) reads it instead."""
    d = shlex.quote(workdir(run, worker))
    return (
        f"cd {d} 2>/dev/null || exit 0; [ -f agent.pid ] || exit 0; p=$(cat agent.pid); "
        "kill -0 \"$p\" 2>/dev/null || exit 0; : > cancelled; kill -TERM -- -\"$p\" 2>/dev/null || true; "
        f"for i in $(seq {int(grace_s) * 10}); do kill -0 \"$p\" 2>/dev/null || exit 0; sleep 0.1; done; "
        "kill -KILL -- -\"$p\" 2>/dev/null || true"
    )


def tail_command(run: str, worker: int, offset: int, follow: bool) -> str:
    """The job log from byte `offset` on; with `follow`, until the agent process exits (then what is left).

    Waits for the log to appear while the job is starting, so a `logs -f` right after launch works."""
    d = shlex.quote(workdir(run, worker))
    start = f"+{int(offset) + 1}"
    if not follow:
        return f"cd {d} 2>/dev/null && [ -f job.log ] && tail -c {start} job.log || true"
    return (
        f"cd {d} 2>/dev/null || exit 0; "
        "for i in $(seq 300); do [ -f job.log ] && break; [ -f exit_code ] && break; sleep 0.1; done; "
        "[ -f job.log ] || exit 0; "
        "if [ -f agent.pid ] && kill -0 \"$(cat agent.pid)\" 2>/dev/null; then "
        f"exec tail -c {start} --pid=\"$(cat agent.pid)\" -s 0.2 -F job.log 2>/dev/null; "
        f"else exec tail -c {start} job.log; fi"
    )


def shell_command(command: str | list[str]) -> str:
    """A user's command for `tpuctl ssh -- CMD...`: several words are quoted and joined (what they typed
    after `--` is argv, not shell), a single string is passed as the shell line it is."""
    if isinstance(command, str):
        return command
    return command[0] if len(command) == 1 else " ".join(shlex.quote(c) for c in command)
