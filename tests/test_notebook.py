"""examples/quickstart.ipynb runs top to bottom (up, bert-tiny for 10 steps, metrics, down) so it cannot rot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "quickstart.ipynb"


@pytest.mark.slow  # fast tier: the library it calls: test_library
@pytest.mark.timeout(900)
def test_quickstart_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    import tpuctl

    # A reader's machine: no Google project, no emulator settings from this session; the notebook's own
    # embedded local cloud under a private TPUCTL_HOME.
    for name in list(os.environ):
        if name.startswith(("TPUCTL_", "GOOGLE_", "CLOUDSDK_")) or name == "STORAGE_EMULATOR_HOST":
            monkeypatch.delenv(name)
    monkeypatch.setenv("TPUCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud config or ADC of the person running the tests
    nb = nbformat.read(NOTEBOOK, as_version=4)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    finally:
        tpuctl.local.stop()  # the notebook stops it; a failed cell must not leave it running either
    text = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
    assert "==> train" in text and "step 10: loss" in text and "succeeded at step 10" in text, text
    assert "deleted:" in text
