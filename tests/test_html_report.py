"""`veosnap check --html FILE`: the page of a real failing check, opened in a real headless Chromium.

The browser reads the page back (its DOM after rendering, and where it drew each point), and every
number on it is held to the JSON document of the same check. Skips when no Chromium is installed
(`apt-get install chromium`).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from golden_repo import committed_golden

from veosnap.surfaces.cli import main

TESTS = Path(__file__).resolve().parent
BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)),
               None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
WINDOW = (1200, 1400)

# Run inside the page (a copy of it): where the browser drew each chart point, the bound line and
# the chart, and in which colour, written into the DOM for --dump-dom to bring back.
MEASURE = """<script>
const out = {points: [], charts: {}};
for (const svg of document.querySelectorAll('svg.chart')) {
  const key = svg.closest('figure').dataset.chart, box = svg.getBoundingClientRect();
  const bound = svg.querySelector('line.bound').getBoundingClientRect();
  const decades = {};
  for (const line of svg.querySelectorAll('line.grid')) {
    const r = line.getBoundingClientRect();
    const tick = svg.querySelector(`text.tick[data-decade="${line.dataset.decade}"]`);
    decades[line.dataset.decade] = {y: r.top + r.height / 2, label: tick.textContent};
  }
  out.charts[key] = {left: box.left, right: box.right, top: box.top, bottom: box.bottom,
                     bound: bound.top + bound.height / 2, decades: decades};
  for (const g of svg.querySelectorAll('g.pt')) {
    const r = g.getBoundingClientRect(), shape = g.querySelector(':not(title)');
    out.points.push({chart: key, tensor: g.dataset.tensor, x: r.left + r.width / 2, y: r.top + r.height / 2,
                     width: r.width, fill: getComputedStyle(shape).fill});
  }
}
const verdict = document.querySelector('.verdict').getBoundingClientRect();
out.verdict_top = verdict.top;
const pre = document.createElement('pre'); pre.id = 'measured'; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def run_check(project, capsys, backend: str, html: Path | None = None, fmt: str = "json") -> str:  # noqa: ANN001
    dirs = ["--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata", str(project.testdata)]
    args = ["check", *dirs, "--model", "qwen3_moe", "--dtype", "float32", "--backend", backend, "--format", fmt]
    assert main(args + (["--html", str(html)] if html else [])) == 1  # the check fails
    return capsys.readouterr().out


def browser(page: Path, tmp_path: Path, *args: str) -> str:
    proc = subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                           f"--window-size={WINDOW[0]},{WINDOW[1]}", *args, page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def rendered(page: Path, tmp_path: Path) -> tuple[Node, dict]:
    """The page's DOM as Chromium built it, and where Chromium drew the charts."""
    measured = tmp_path / "measured.html"
    measured.write_text(page.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = parse(browser(measured, tmp_path, "--dump-dom"))
    return dom, json.loads(dom.find(id="measured").text)


@needs_browser
def test_a_failing_checks_page_shows_the_jsons_numbers(repo_project, capsys, tmp_path):
    backend = f"{TESTS / 'faults.py'}:pad_leak"
    page = tmp_path / "report.html"
    result = json.loads(run_check(repo_project, capsys, backend, html=page))["results"][0]
    text = run_check(repo_project, capsys, backend, fmt="text")
    dom, drawn = rendered(page, tmp_path)
    tensors = {t["name"]: t for t in result["tensors"]}

    # At the top: the verdict, where it diverged, and what to run next.
    check = dom.find(cls="check")
    assert check.attrs["data-status"] == result["status"] == "FAIL"
    assert check.attrs["data-golden"] == result["golden"]
    # the verdict near the top: below the title, and the versions note where the goldens' versions differ
    assert drawn["verdict_top"] < (160 if dom.find_all(id="versions-note") else 120)
    assert dom.find(tag="dd", **{"data-key": "first diverging layer"}).text == result["first_divergence"]
    assert dom.find(tag="dd", **{"data-key": "first diverging gradient"}).text == result["first_gradient_divergence"]
    assert dom.find(id="next-0").text == result["next"]

    # Every tensor is one point, at the JSON's ratio, red when over its bound.
    points = dom.find_all(tag="g", cls="pt", **{"data-tensor": True})
    assert sorted(p.attrs["data-tensor"] for p in points) == sorted(tensors)
    for p in points:
        t = tensors[p.attrs["data-tensor"]]
        assert float(p.attrs["data-ratio"]) == t["ratio"]
        assert p.attrs["data-passed"] == str(t["passed"]).lower()
        assert ("fail" in p.classes) == (not t["passed"])
    # ... and Chromium drew it there: higher ratio, higher up; failing above the bound line, in red.
    for chart, box in drawn["charts"].items():
        here = [p for p in drawn["points"] if p["chart"] == chart]
        assert here
        assert all(p["width"] > 0 and box["left"] < p["x"] < box["right"] and box["top"] < p["y"] < box["bottom"]
                   for p in here)
        # A log scale: the axis labels its decade lines 10^k, evenly spaced, and each point with a
        # nonzero ratio sits where those lines put log10(ratio), to within a pixel of rounding.
        decades = sorted((int(k), d["y"], d["label"]) for k, d in box["decades"].items())
        assert all(float(label.removesuffix("x")) == 10.0 ** k for k, _, label in decades)
        step = (decades[-1][1] - decades[0][1]) / (decades[-1][0] - decades[0][0])
        assert step < 0 and all(abs(y - (decades[0][1] + (k - decades[0][0]) * step)) < 1.0 for k, y, _ in decades)
        for p in here:
            ratio = tensors[p["tensor"]]["ratio"]
            if ratio:
                assert abs(p["y"] - (decades[0][1] + (math.log10(ratio) - decades[0][0]) * step)) < 1.0, p
        for p in here:
            t = tensors[p["tensor"]]
            assert (p["y"] < box["bound"]) == (t["ratio"] > 1), p
            assert (p["fill"] == "rgb(209, 36, 47)") == (not t["passed"]), p
    x = {p["tensor"]: p["x"] for p in drawn["points"]}
    assert x["layers.0.output"] < x["layers.1.output"] < x["logits"] < x["loss"]  # forward order
    assert (x["grad.lm_head.weight"] < x["grad.model.layers.1.self_attn.q_proj.weight"]
            < x["grad.model.layers.0.self_attn.q_proj.weight"] < x["grad.model.embed_tokens.weight"])  # backward order

    # The table of every tensor carries the JSON's numbers, and prints them as the text report does.
    rows = dom.find(cls="tensor-table").find_all(tag="tr", **{"data-tensor": True})
    assert [r.attrs["data-tensor"] for r in rows] == [t["name"] for t in result["tensors"]]
    for row in rows:
        t = tensors[row.attrs["data-tensor"]]
        for key in ("error", "bound", "noise", "ratio"):
            assert float(row.attrs[f"data-{key}"]) == t[key]
        cells = [c.text for c in row.find_all(tag="td")]
        assert cells[4:8] == [f"{t['error']:.3g}", f"{t['bound']:.3g}", f"{t['noise']:.3g}", f"{t['ratio']:.3g}x"]
        assert cells[9] == (t["problem"] or t["where"])
        if not t["passed"]:
            assert f"{t['ratio']:.3g}x" in text  # as the text report prints it

    # The worst tokens, in forward order, layer 1's all in the leaking sequence.
    tokens = dom.find(cls="worst-rows").find_all(tag="tr", **{"data-tensor": True})
    assert [t.attrs["data-tensor"] for t in tokens] == ["routes.1.weights", "layers.1.output", "logits", "loss"]
    chips = tokens[1].find_all(cls="chip")
    worst = tensors["layers.1.output"]["worst_rows"]
    assert [float(c.attrs["data-ratio"]) for c in chips] == [w["ratio"] for w in worst]
    assert [c.text.split()[0] for c in chips] == [f"b{w['batch']}" for w in worst] == ["b1"] * 5

    assert dom.find(cls="routes").attrs["data-flips"] == "0"
    assert dom.find(id="text-report").text == text


@needs_browser
def test_route_flips_per_layer_and_expert_match_the_json(repo_project, capsys, tmp_path):
    backend = f"{TESTS / 'faults.py'}:one_token_rerouted"
    page = tmp_path / "flip.html"
    result = json.loads(run_check(repo_project, capsys, backend, html=page))["results"][0]
    dom, drawn = rendered(page, tmp_path)

    rows = dom.find(cls="route-table").find_all(tag="tr", **{"data-layer": True})
    assert [int(r.attrs["data-layer"]) for r in rows] == [r["layer"] for r in result["routes"]]
    for row, route in zip(rows, result["routes"]):
        assert int(row.attrs["data-flips"]) == route["clear_flips"]
        assert int(row.attrs["data-near-ties"]) == route["near_tie_flips"]
        cells = row.find_all(tag="td", cls="heat")
        assert [int(c.attrs["data-gained"]) for c in cells] == route["gained"]
        assert [int(c.attrs["data-lost"]) for c in cells] == route["lost"]
        for cell, gained, lost in zip(cells, route["gained"], route["lost"]):
            assert cell.text == " ".join(s for s in (f"+{gained}" if gained else "", f"\u2212{lost}" if lost else "")
                                         if s)
    flipped = result["routes"][0]
    assert dom.find(tag="dd", **{"data-key": "routes"}).text == flipped["message"]
    assert dom.find(tag="text", cls="flips").attrs["data-flips"] == str(flipped["clear_flips"]) == "1"
    assert dom.find(id="next-0").text == result["next"]
    assert len(drawn["points"]) == len(result["tensors"])


@needs_browser
def test_a_train_runs_updates_are_charted_from_the_lm_head_down(repo_project, capsys, tmp_path):
    committed_golden("qwen3_moe", "float32", "train")
    page = tmp_path / "train.html"
    dirs = ["--goldens", str(repo_project.goldens), "--configs", str(repo_project.configs)]
    assert main(["check", *dirs, "--model", "qwen3_moe", "--dtype", "float32", "--scenario", "train", "--backend",
                 f"{TESTS / 'faults.py'}:pad_leak", "--format", "json", "--html", str(page)]) == 1
    result = json.loads(capsys.readouterr().out)["results"][0]
    dom, drawn = rendered(page, tmp_path)
    charts = {c.attrs["data-chart"]: c for c in dom.find_all(tag="figure")}
    assert set(charts) == {"forward", "update"}
    updates = {t["name"]: t for t in result["tensors"] if t["name"].startswith("update.")}
    points = charts["update"].find_all(tag="g", cls="pt", **{"data-tensor": True})
    assert sorted(p.attrs["data-tensor"] for p in points) == sorted(updates) and len(updates) == 25
    assert all(float(p.attrs["data-ratio"]) == updates[p.attrs["data-tensor"]]["ratio"] for p in points)
    x = {p["tensor"]: p["x"] for p in drawn["points"]}
    assert x["update.lm_head.weight"] < x["update.model.layers.1.self_attn.v_proj.weight"] \
        < x["update.model.layers.0.self_attn.v_proj.weight"] < x["update.model.embed_tokens.weight"]
    assert {p.attrs["data-tensor"] for p in charts["forward"].find_all(tag="g", **{"data-tensor": True})} >= {
        "train.loss", "train.grad_norm", "routes.1.weights"}


@needs_browser
def test_several_checks_and_a_backend_that_raises_share_one_page(repo_project, capsys, tmp_path):
    (tmp_path / "broken.py").write_text("def kernel(model):\n    raise RuntimeError('kernel not built for sm_75')\n")
    page = tmp_path / "errors.html"
    dirs = ["--goldens", str(repo_project.goldens), "--configs", str(repo_project.configs)]
    assert main(["check", *dirs, "--model", "llama", "--model", "qwen3", "--dtype", "float32", "--backend",
                 f"{tmp_path / 'broken.py'}:kernel", "--format", "json", "--html", str(page)]) == 1
    results = json.loads(capsys.readouterr().out)["results"]
    dom, drawn = rendered(page, tmp_path)
    assert dom.find(id="summary").text == "0 passed, 2 failed"
    assert [a.attrs["href"] for a in dom.find(cls="toc").find_all(tag="a")] == ["#check-0", "#check-1"]
    for i, result in enumerate(results):
        check = dom.find(id=f"check-{i}")
        assert check.attrs["data-status"] == result["status"] == "ERROR"
        assert check.find(tag="dd", **{"data-key": "error"}).text == result["error"]
        assert "kernel not built for sm_75" in result["error"]
        assert check.find(id=f"next-{i}").text == result["next"]
    assert drawn["points"] == [] and drawn["charts"] == {}  # nothing ran, nothing drawn


@needs_browser
def test_the_page_is_a_screenshot(repo_project, capsys, tmp_path):
    page = tmp_path / "report.html"
    run_check(repo_project, capsys, f"{TESTS / 'faults.py'}:pad_leak", html=page)
    shot = tmp_path / "shot.png"
    browser(page, tmp_path, f"--screenshot={shot}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == WINDOW


def test_the_page_is_self_contained(repo_project, capsys, tmp_path):
    page = tmp_path / "report.html"
    run_check(repo_project, capsys, f"{TESTS / 'faults.py'}:pad_leak", html=page)
    html = page.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    for fetching in ("<link", "<img", "<iframe", "src=", "@import", "url(", "http://", "https://"):
        assert fetching not in html.replace('xmlns="http://www.w3.org/2000/svg"', ""), fetching
    assert list(tmp_path.iterdir()) == [page]  # nothing but the page, and no temp file left behind


@pytest.mark.parametrize("target, message", [
    ("missing/report.html", "--html {tmp}/missing/report.html: directory {tmp}/missing does not exist"),
    (".", "--html {tmp}: is a directory; name the page to write, e.g. {tmp}/veosnap.html"),
])
def test_a_bad_html_path_is_one_line_before_any_check_runs(repo_project, capsys, tmp_path, target, message):
    path = (tmp_path / target) if target != "." else tmp_path
    assert main(["check", "--goldens", str(repo_project.goldens), "--model", "qwen3_moe", "--html", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"veosnap: error: {message.format(tmp=tmp_path)}\n"
    assert captured.out == ""  # refused before checking anything
    assert list(tmp_path.iterdir()) == []


# --- a small DOM, from what the browser dumps ---------------------------------------------------------

class Node:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs, self.children, self.parts = tag, attrs, [], []

    @property
    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts if not (
            isinstance(p, Node) and p.tag == "title"))

    def matches(self, tag: str | None, cls: str | None, id: str | None, attrs: dict) -> bool:  # noqa: A002
        return ((tag is None or self.tag == tag) and (cls is None or cls in self.classes)
                and (id is None or self.attrs.get("id") == id)
                and all((k in self.attrs) if v is True else self.attrs.get(k) == v for k, v in attrs.items()))

    def find_all(self, tag: str | None = None, cls: str | None = None, id: str | None = None,  # noqa: A002
                 **attrs) -> list[Node]:
        found = []
        for child in self.children:
            if child.matches(tag, cls, id, attrs):
                found.append(child)
            found += child.find_all(tag, cls, id, **attrs)
        return found

    def find(self, tag: str | None = None, cls: str | None = None, id: str | None = None,  # noqa: A002
             **attrs) -> Node:
        found = self.find_all(tag, cls, id, **attrs)
        assert found, f"no element {tag} .{cls} #{id} {attrs}"
        return found[0]


class _Builder(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        self.stack[-1].parts.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].parts.append(data)


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    return builder.root

