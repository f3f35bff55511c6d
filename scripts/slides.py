#!/usr/bin/env python3
"""Renders the slide decks (slides/NN_topic.md) to HTML and PDF, and checks them.

    scripts/slides.py [--build build] [--out build/slides] [--check] [--screenshots] [--pdf]

- charts: scripts/charts.py draws every chart from the programs' own JSON (BUILD/bin/...);
- HTML: pandoc's dzslides, one self-contained file per deck (styles, scripts and images inside:
  it opens offline, and nothing is fetched at build time); slides are 800x600;
- --pdf: headless Chromium prints each deck, one slide a page;
- --check: headless Chromium opens each deck and measures every slide: it must render, every
  image must load, and nothing may overflow the slide; exits 1 otherwise;
- --screenshots: PNGs of the first, a middle and the last slide of each deck (OUT/shots/), for a
  person to look at.
Tools: pandoc, chromium and python3-matplotlib, from Debian (scripts/install-deps.sh).
"""
import argparse
import json
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A limit that guards against a hung browser, not a slow machine.
CHROMIUM_TIMEOUT_S = 300


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return [path, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--allow-file-access-from-files"]
    raise SystemExit("slides.py: no chromium found\nHINT: scripts/install-deps.sh installs it")


def render(deck: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    html = out / (deck.stem + ".html")
    cmd = ["pandoc", str(deck), "-t", "dzslides", "-s", "--self-contained", "--slide-level=1",
           f"--resource-path={out}:{deck.parent}", "--metadata", f"pagetitle={deck.stem}",
           f"--include-in-header={ROOT / 'slides' / 'style.html'}",
           f"--include-after-body={ROOT / 'slides' / 'check.html'}", "-o", str(html)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"slides.py: pandoc failed on {deck}:\n{r.stderr}")
    for line in r.stderr.splitlines():
        if "WARNING" in line or "Could not fetch" in line:
            print(f"{deck.name}: pandoc: {line}")
    return html


# One page that holds every deck in an 800x600 frame (a headless window's own size): each deck's
# check (slides/check.html) posts its slides to this page, which writes down each as it comes.
# The listener comes before the frames (a small deck answers before the page has loaded); a deck
# that did not answer is checked again on its own. One browser start for the lot: a start costs
# about 3 s of CPU, the most of a deck's check.
CHECK_ALL = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>slides check</title>
<script>
var got = {{}};
window.addEventListener('message', function (e) {{
  got[e.data.deck] = e.data.slides;
  var pre = document.getElementById('dtc-check-all') || document.createElement('pre');
  pre.id = 'dtc-check-all';
  pre.textContent = JSON.stringify(got);
  document.body.appendChild(pre);
}});
</script></head>
<body>{frames}</body></html>
"""


def unescape(text: str) -> str:
    return (text.replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">")
            .replace("&amp;", "&"))


def check_all(htmls: list[pathlib.Path], out: pathlib.Path) -> dict:
    """Every deck's check in one browser: {deck's file name: its slides}, or {} if it failed."""
    frames = "".join(f'<iframe src="{h.name}?check" width="800" height="600" '
                     f'style="border:0;display:block"></iframe>' for h in htmls)
    page = out / "check-all.html"
    page.write_text(CHECK_ALL.format(frames=frames))
    r = subprocess.run(chromium() + ["--virtual-time-budget=20000", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
    page.unlink(missing_ok=True)
    m = re.search(r'<pre id="dtc-check-all">(.*?)</pre>', r.stdout, re.S)
    return json.loads(unescape(m.group(1))) if m else {}


def check(html: pathlib.Path, slides=None):
    if slides is None:  # this deck alone, in a browser of its own
        r = subprocess.run(chromium() + ["--virtual-time-budget=5000", "--dump-dom",
                                         html.as_uri() + "?check"],
                           capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
        m = re.search(r'<pre id="dtc-check">(.*?)</pre>', r.stdout, re.S)
        if not m:
            return [f"{html.name}: the check did not run (chromium exit {r.returncode})"], 0
        slides = json.loads(unescape(m.group(1)))
    problems = []
    for s in slides:
        where = f"{html.name} slide {s['slide']} ({s['title'].strip()[:50]!r})"
        if s["overflow"]:
            problems.append(f"{where}: content overflows the 800x600 slide "
                            f"({s['width']}x{s['height']}): split it or shorten it")
        for im in s["images"]:
            if not im["ok"]:
                problems.append(f"{where}: image {im['alt']!r} does not load")
    if not slides:
        problems.append(f"{html.name}: no slides")
    return problems, len(slides)


def screenshot(html: pathlib.Path, slide: int, png: pathlib.Path):
    subprocess.run(chromium() + ["--window-size=800,600", "--virtual-time-budget=3000",
                                 f"--screenshot={png}", f"{html.as_uri()}#{slide}"],
                   capture_output=True, timeout=CHROMIUM_TIMEOUT_S)


def pdf(html: pathlib.Path):
    out = html.with_suffix(".pdf")
    subprocess.run(chromium() + ["--virtual-time-budget=5000", "--no-pdf-header-footer",
                                 f"--print-to-pdf={out}", html.as_uri() + "?print"],
                   capture_output=True, timeout=CHROMIUM_TIMEOUT_S)
    if not out.exists():
        raise SystemExit(f"slides.py: chromium wrote no {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--out", default=None, help="default: BUILD/slides")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--screenshots", action="store_true")
    ap.add_argument("--pdf", action="store_true")
    args = ap.parse_args()
    build = pathlib.Path(args.build).resolve()
    out = pathlib.Path(args.out).resolve() if args.out else build / "slides"
    (out / "charts").mkdir(parents=True, exist_ok=True)
    subprocess.run(["/usr/bin/python3", str(ROOT / "scripts" / "charts.py"), str(build),
                    str(out / "charts")], check=True)
    problems = []
    decks = sorted((ROOT / "slides").glob("[0-9][0-9]_*.md"))
    htmls = [render(deck, out) for deck in decks]
    together = check_all(htmls, out) if args.check else {}
    for deck, html in zip(decks, htmls):
        if args.pdf:
            pdf(html)
        if args.check:
            # a deck the page of them all did not hear from is checked again on its own
            found, count = check(html, together.get(html.name))
            problems += found
            print(f"{html.name}: {count} slides checked, {len(found)} problem(s)")
            if args.screenshots and count:
                (out / "shots").mkdir(exist_ok=True)
                for k in sorted({1, (count + 1) // 2, count}):
                    screenshot(html, k, out / "shots" / f"{deck.stem}-{k:02d}.png")
    for p in problems:
        print(f"slides: {p}", file=sys.stderr)
    if args.check:
        alone = [h.name for h in htmls if h.name not in together]
        print(f"slides: {len(htmls) - len(alone)} deck(s) checked in one browser"
              + (f", {len(alone)} on their own ({', '.join(alone)})" if alone else ""))
    print(f"slides: {len(decks)} deck(s) in {out}" + (" (+PDF)" if args.pdf else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
