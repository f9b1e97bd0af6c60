"""`tpuctl export RUN --format hf --out DIR`: a run's latest checkpoint, from its bucket, in another framework's files."""

from __future__ import annotations

from pathlib import Path

import click

from tpuctl import config, console

SECTION = "Run a training job"


@click.command("export")
@click.argument("run")
@click.option("--format", "format", default="hf", show_default=True,
              help="one of the run's template's exporters; hf: Hugging Face Transformers (both built-in templates)")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="local directory to write")
@click.option("--bucket", help="the run's bucket, when no label or ledger entry names it")
@click.option("--template", "template_dir", type=click.Path(exists=True, file_okay=False),
              help="a user template's directory (default: the built-in, or the bundle this machine shipped)")
@click.option("--json", "as_json", is_flag=True, help="print what was written as JSON on stdout")
@click.option("--cloud", type=click.Choice(config.TARGETS), help="force the target (default: auto)")
@click.option("--project", help="Google Cloud project [env TPUCTL_PROJECT]")
def export_command(run, format, out, bucket, template_dir, as_json, cloud, project) -> None:
    """Export RUN's latest checkpoint (RUN, or gs://BUCKET/runs/RUN) from its bucket: works after the TPU is gone.

    `--format hf` writes model.safetensors, config.json and the tokenizer files that `transformers` loads
    (BertForMaskedLM / GPT2LMHeadModel and AutoTokenizer) with no code of ours.
    """
    from tpuctl import provision
    from tpuctl.jobs import export as exporting

    clients = provision.connect(config.settings(project=project, cloud=cloud))
    done = exporting.export(clients, run, format, Path(out), bucket=bucket,
                            template_dir=Path(template_dir) if template_dir else None)
    if as_json:
        console.emit_json(done.__dict__)
        return
    console.info(f"run {done.run} ({done.template}) exported as {format} from {done.model_dir} to {done.out_dir}: "
                 f"{', '.join(done.files)}")


export_command.section = SECTION
commands = [export_command]
