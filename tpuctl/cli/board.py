"""`tpuctl board RUN...`: TensorBoard on runs' event files, from their buckets, live and after the TPU is gone."""

from __future__ import annotations

import click

from tpuctl import config, console

SECTION = "Run a training job"


@click.command("board")
@click.argument("runs", nargs=-1, required=True)
@click.option("--port", type=click.IntRange(0, 65535), help="local port (default: 6006 or the next free one; 0: any)")
@click.option("--bucket", help="the runs' bucket, when no label or ledger entry names it")
@click.option("--interval", "interval_s", type=click.FloatRange(min=1.0), default=10.0, show_default=True,
              help="seconds between copies of new events from the bucket")
@click.option("--json", "as_json", is_flag=True,
              help="print the URL, the logdir and its source (bucket or mirror) as JSON on stdout once serving")
@click.option("--cloud", type=click.Choice(config.TARGETS), help="force the target (default: auto)")
@click.option("--project", help="Google Cloud project [env TPUCTL_PROJECT]")
def board_command(runs, port, bucket, interval_s, as_json, cloud, project) -> None:
    """Show RUNs (RUN, or gs://BUCKET/runs/RUN) in TensorBoard, side by side; Ctrl-C stops.

    Serves on 127.0.0.1. On Google, one RUN is read from its bucket by TensorBoard itself when it has a gs://
    reader (TensorFlow or gcsfs); otherwise (the local cloud, several RUNs) from a local copy of each run's
    TensorBoard files (under TPUCTL_HOME/board), kept in sync with its bucket while the run trains; works after
    the TPU is gone.
    """
    from tpuctl import provision
    from tpuctl.jobs import board

    def render(event) -> None:
        if not isinstance(event, board.BoardReady):
            console.report(event)
        elif as_json:
            console.emit_json_line({"url": event.url, "logdir": event.logdir, "runs": list(event.runs),
                                    "source": event.source, "why": event.why})
        else:
            console.info(f"TensorBoard for {', '.join(event.runs)} at {event.url} (logdir {event.logdir}: "
                         f"{event.why}); Ctrl-C stops")

    clients = provision.connect(config.settings(project=project, cloud=cloud, on_event=console.report))
    try:
        board.serve(clients, list(runs), port=port, bucket=bucket, interval_s=interval_s, on_event=render)
    except KeyboardInterrupt:  # the way to stop a board: nothing to tear down, so not an error
        console.note("TensorBoard stopped")


board_command.section = SECTION
commands = [board_command]
