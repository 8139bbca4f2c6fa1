"""Make the README's picture of a failure: a real failing check's HTML page, shot in headless Chromium.

    python tools/data/html_screenshot.py [--out docs/img/html-report.png] [--size 1000x1146]

Runs `veosnap check --model deepseek_v3 --dtype float32 --backend tests/faults.py:pad_leak --html ...`
(a mask bug: one sequence attends to its padding from layer 1 on), then shoots the top of the page.
Needs Chromium (`apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = ["check", "--model", "deepseek_v3", "--dtype", "float32", "--backend", "tests/faults.py:pad_leak"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "html-report.png")
    parser.add_argument("--size", default="1000x1146", help="window WIDTHxHEIGHT in CSS pixels")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("no Chromium installed (apt-get install chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="veosnap-shot-") as tmp:
        page = Path(tmp) / "report.html"
        subprocess.run([sys.executable, "-m", "veosnap", *COMMAND, "--html", str(page)], cwd=ROOT,
                       stdout=subprocess.DEVNULL, check=False)  # exit 1: the check fails, as it should
        if not page.is_file():
            print("veosnap check wrote no page (see its error above)", file=sys.stderr)
            return 2
        width, height = args.size.split("x")
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}",
                        f"--screenshot={args.out.resolve()}", page.as_uri()],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"{args.out}  {args.out.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
