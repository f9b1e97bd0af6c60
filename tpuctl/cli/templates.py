"""`tpuctl templates`: the training templates (built-in, or a directory) and their presets with their sizes."""

from __future__ import annotations

import click

from tpuctl import console
from tpuctl.templates import contract

SECTION = "Run a training job"


def _rows(templates: list[contract.Template]) -> list[dict]:
    rows = []
    for t in templates:
        for p in t.presets.values() or [None]:
            params = t.parameter_count(p.name) if p is not None and t.parameter_count else None
            rows.append({"template": t.name, "preset": p.name if p else "", "parameters": params,
                         "seq_len": p.task.get("seq_len") if p else None,
                         "tokenizer": t.data.tokenizer if t.data else "", "entry": t.entry_module,
                         "default": bool(p) and p.name == t.default_preset, "description": p.description if p else t.description})
    return rows


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


@click.command("templates")
@click.argument("directory", nargs=-1, type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="one record per preset")
def templates(directory: tuple[str, ...], as_json: bool) -> None:
    """List training templates and their presets with their sizes (built-ins, plus DIRECTORY templates)."""
    found = contract.builtins() + [contract.load(d) for d in directory]
    rows = _rows(found)
    if as_json:
        console.emit_json(rows)
        return
    console.table(("template", "preset", "params", "seq", "tokenizer", "description"),
                  [(r["template"], r["preset"] + (" *" if r["default"] else ""), _size(r["parameters"]),
                    r["seq_len"] or "-", r["tokenizer"] or "-", r["description"]) for r in rows])


templates.section = SECTION
commands = [templates]
