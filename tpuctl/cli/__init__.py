"""The `tpuctl` command: a thin layer that parses, calls the library and renders.

Each area registers its commands from its own module (`COMMAND_MODULES`); every module exposes
`commands`, a list of click commands or groups, each with a `section` attribute for `--help`.
"""

from __future__ import annotations

import importlib
import signal
import traceback

import click

from tpuctl import __version__, config, console, paths
from tpuctl.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, BadInput, Interrupted, TpuctlError, Unexpected

SECTIONS = (
    "Run a training job",
    "Provision and inspect",
    "Data",
    "Cost and cleanup",
    "Local cloud",
)

COMMAND_MODULES: tuple[str, ...] = ("data", "costs", "local", "provision", "jobs", "doctor", "templates", "export",
                                   "fit", "board")


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

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            _usage_error(ctx, exc)
            raise

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # a subcommand's flags, arguments or name
            _usage_error(ctx, exc)
            raise
        except TpuctlError as exc:
            console.error(exc)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            console.error(Interrupted("interrupted"))
            ctx.exit(EXIT_INTERRUPTED)
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise  # click's own ways to end a command (`ctx.exit`, a subcommand's --help): click finishes them
        except Exception as exc:
            # A user's unusable key file is an error line, and so is anything else (exit 1, as the README says)
            bad = config.credentials_error(exc) or _unexpected(exc)
            console.error(bad)
            ctx.exit(bad.exit_code)


def _unexpected(exc: Exception) -> TpuctlError:
    """`exc` as one `error: unexpected ...` line. Its traceback, for the bug report, goes to
    $TPUCTL_HOME/logs/traceback.log (the last one), named in the hint; nowhere when TPUCTL_HOME is what failed."""
    error = Unexpected.of(exc)
    try:
        log = paths.logs_dir() / "traceback.log"
        log.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except OSError:
        return error
    return Unexpected(error.message, hint=f"{error.hint}; its traceback: {log}")


def _usage_error(ctx: click.Context, exc: click.UsageError) -> None:
    """Click's own usage errors (unknown flag, bad choice, missing argument) in the one-line `error: ...` form
    of every other error, keeping click's wording and its "did you mean" suggestion; exit 2.

    Returns only for `tpuctl GROUP` without a subcommand, which shows the group's help as click does."""
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):
        return
    param = getattr(exc, "param", None)
    plain_value_error = isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter)
    message = exc.message if plain_value_error and param is not None else exc.format_message()
    where = (exc.ctx or ctx).command_path
    console.error(BadInput(message, field=param.name if param is not None else None,
                           hint=f"see `{where} --help`"))
    ctx.exit(EXIT_BAD_INPUT)


@click.group(cls=SectionedGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="tpuctl")
def cli() -> None:
    """tpuctl: from a laptop to a trained model on Cloud TPUs and back to a zero bill.

    With no Google project named (flag, env, spec, config, gcloud), every command targets the embedded local cloud
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
    # A shell starts background jobs of a script with SIGINT ignored, and Python keeps an inherited "ignore":
    # without this, `kill -INT` could not stop such a tpuctl, nor make it clean up. Python's own handler
    # (not a function of ours) so asyncio.run still turns Ctrl-C into a clean cancellation of its task.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cli(prog_name="tpuctl")
