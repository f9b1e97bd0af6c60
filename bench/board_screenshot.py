"""A person's look at `tpuctl board`: a real browser (headless Chromium) screenshots TensorBoard's scalars page of
a finished local-cloud run, and the picture is checked for the loss curve.

    .venv/bin/python bench/board_screenshot.py [--out docs/board.png] [--steps 300]

Runs, as a person would, on a fresh local cloud in a temporary TPUCTL_HOME: `tpuctl run examples/bert-tiny.yaml
--yes` (a copy of the spec with fewer steps), then `tpuctl board RUN --json`, then
`chromium --headless --screenshot` of the scalars dashboard filtered to the loss. Needs Debian's `chromium`
(`apt-get install chromium`); too heavy for CI, so it lives here, not in tests/.

The check: TensorBoard draws each run's line in the run's colour; the loss chart at the top of the page must hold
a line of that colour across most of its width that falls from left to right (a loss curve, not an empty chart,
another tag or an error page). Prints the PNG's path and what it found; exits 1 when the curve is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# TensorBoard's first run colour (its default palette starts with this orange): the only line on the chart.
RUN_RGB = (0xFF, 0x70, 0x43)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCTL_", "CLOUDSDK_", "GOOGLE_"))}
    env.update(TPUCTL_HOME=str(home), TPUCTL_CLOUD="local", NO_COLOR="1", PYTHONUNBUFFERED="1")
    return env


def _spec(workdir: Path, steps: int) -> Path:
    """The README's example with fewer steps (and its corpus beside it): the picture needs a curve, not a model."""
    import yaml

    spec = yaml.safe_load((REPO / "examples" / "bert-tiny.yaml").read_text())
    spec["name"] = "board-shot"
    spec["job"].setdefault("config", {}).setdefault("trainer", {}).update(max_steps=steps, log_every=10)
    shutil.copytree(REPO / "examples" / "data", workdir / "data")
    path = workdir / "board-shot.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def curve(png: Path) -> tuple[int, int, bool]:
    """In the first chart (the loss, alone in the "Tags matching" card at the top of the 1280x800 page): the pixels
    of the run's colour, the horizontal extent they cover (px) and whether the line falls from left to right."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    points = [(x, y) for x in range(330, img.width) for y in range(180, 480)
              if all(abs(a - b) <= 40 for a, b in zip(img.getpixel((x, y)), RUN_RGB))]
    if not points:
        return 0, 0, False
    xs = sorted(x for x, _ in points)
    left, right = xs[0] + (xs[-1] - xs[0]) // 3, xs[-1] - (xs[-1] - xs[0]) // 3
    mean_y = lambda sel: sum(y for x, y in points if sel(x)) / max(1, sum(1 for x, _ in points if sel(x)))  # noqa: E731
    # Image rows grow downwards: a falling loss sits higher (smaller y) on the left than on the right.
    return len(points), xs[-1] - xs[0], mean_y(lambda x: x <= left) < mean_y(lambda x: x >= right)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "docs" / "board.png"))
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: chromium: not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    exe = [sys.executable, "-m", "tpuctl"]
    with tempfile.TemporaryDirectory(prefix="board-shot-") as tmp:
        work = Path(tmp)
        env = _env(work / "home")
        spec = _spec(work, args.steps)
        t0 = time.monotonic()
        run = subprocess.run([*exe, "run", str(spec), "--yes"], env=env, cwd=work, capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stderr[-2000:], file=sys.stderr)
            return 1
        print(f"run: {time.monotonic() - t0:.0f} s")
        board = subprocess.Popen([*exe, "board", "board-shot", "--port", "0", "--json"], env=env, cwd=work,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            url = json.loads(board.stdout.readline())["url"].rstrip("/")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # TensorBoard loads the logdir in the background
                with urllib.request.urlopen(f"{url}/data/plugin/scalars/tags", timeout=10) as r:
                    if "loss" in json.loads(r.read()).get("board-shot", {}):
                        break
                time.sleep(1)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            # The scalars dashboard with its tag filter (kept in the URL's fragment) set to the loss, whose chart
            # is then drawn first, at the top of the page.
            page = f"{url}/#scalars&tagFilter=%5Eloss%24"
            shot = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                   "--window-size=1280,800", "--virtual-time-budget=20000",
                                   f"--user-data-dir={work / 'chromium'}", f"--screenshot={out}", page],
                                  capture_output=True, text=True, timeout=180)
            if shot.returncode != 0 or not out.exists():
                print(shot.stderr[-2000:], file=sys.stderr)
                return 1
        finally:
            board.send_signal(signal.SIGINT)
            try:
                board.wait(timeout=30)
            except subprocess.TimeoutExpired:
                board.kill()
            subprocess.run([*exe, "local", "stop"], env=env, cwd=work, capture_output=True, timeout=60)
        pixels, span, falls = curve(out)
        print(f"screenshot: {out} ({page})")
        print(f"loss chart: {pixels} pixels of the run's colour over {span} px, "
              f"{'falling' if falls else 'NOT falling'} from left to right")
        return 0 if pixels >= 150 and span >= 200 and falls else 1


if __name__ == "__main__":
    sys.exit(main())
