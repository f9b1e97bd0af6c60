"""The `tpuctl` command: a thin layer that parses, calls the library and renders.

Each area registers its commands from its own module (`COMMAND_MODULES`); every module exposes
`commands`, a list of click commands or groups, each with a `section` attribute for `--help`.
"""

from __future__ import annotations

import importlib
import signal

import click

from tpuctl import __version__, console
from tpuctl.errors import EXIT_INTERRUPTED, Interrupted, TpuctlError

SECTIONS = (
    "Run a training job",
    "Provision and inspect",
    "Data",
    "Cost and cleanup",
    "Local cloud",
)

COMMAND_MODULES: tuple[str, ...] = ("data", "costs", "local", "provision", "jobs", "doctor")


class SectionedGroup(click.Group):
    """Groups `--help` by purpose instead of one alphabetical list."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = [(name, cmd) for name in self.list_commands(ctx)
                    if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        # One line per command: as much of its first sentence as fits beside the widest name.
        limit = max(30, formatter.width - formatter.current_indent - max((len(n) for n, _ in commands), default=0) - 6)
        by_section: dict[str, list[tuple[str, str]]] = {}
        for name, cmd in commands:
            section = getattr(cmd, "section", "Other")
            by_section.setdefault(section, []).append((name, cmd.get_short_help_str(limit=limit)))
        for section in (*SECTIONS, *sorted(set(by_section) - set(SECTIONS))):
            if section in by_section:
                with formatter.section(section):
                    formatter.write_dl(by_section[section])

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TpuctlError as exc:
            console.error(exc)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            console.error(Interrupted("interrupted"))
            ctx.exit(EXIT_INTERRUPTED)


@click.group(cls=SectionedGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="tpuctl")
def cli() -> None:
    """tpuctl: from a laptop to a trained model on Cloud TPUs and back to a zero bill.

    With no Google project or credentials configured, every command targets the embedded local cloud
    (`tpuctl local start`); `--cloud gcp|local` on a command forces either.
    """


for _name in COMMAND_MODULES:
    for _command in importlib.import_module(f"tpuctl.cli.{_name}").commands:
        cli.add_command(_command)


def _sigterm_as_interrupt(signum, frame) -> None:
    # SIGTERM takes the same teardown path as Ctrl-C: finally-blocks run, resources are deleted.
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    cli(prog_name="tpuctl")
