"""The contact sheet in a real browser: headless Chromium (Debian's `chromium`) through playwright opens
the example job's sheet from the file system and through a static web server."""

import functools
import http.server
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import ROOT
from storyboard_cli.folder.picks import apply_picks, load_picks
from storyboard_cli.folder.sheet import write_sheet
from storyboard_cli.job.file import load_job
from storyboard_cli.run.render import RenderOptions, render

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")

# every <img> scrolled into view (they load lazily), then each one's natural width
LOAD_ALL = """async () => {
  const imgs = Array.from(document.images);
  for (const img of imgs) {
    img.scrollIntoView();
    if (!img.complete) await new Promise(r => { img.onload = img.onerror = r; });
  }
  return imgs.map(img => [img.getAttribute("src"), img.naturalWidth]);
}"""


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_cpu):
    """The example job (jobs/episode1.yaml: its 11 shots, 23 candidates, two control images) rendered at
    2 steps instead of 12 to keep CI fast, and its sheet."""
    job = load_job(ROOT / "jobs" / "episode1.yaml")
    job = replace(job, shots=tuple(replace(s, steps=2) for s in job.shots))
    out = tmp_path_factory.mktemp("browser") / "episode1"
    result = render(job, RenderOptions(out_dir=out), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 23
    write_sheet(out, job)
    return job, out


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    problems = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.goto(url)
    page.wait_for_load_state("load")
    return page, problems


def _check_thumbnails(page, out: Path) -> None:
    loaded = page.evaluate(LOAD_ALL)
    assert len(loaded) == 23 + 3  # every candidate, and the control image of the three shots that have one
    assert [src for src, width in loaded if width <= 0] == []
    assert all((out / src).is_file() for src, _ in loaded)


def test_sheet_from_the_file_system_picks_and_saves(example, browser, tmp_path):
    job, out = example
    page, problems = _open(browser, (out / "index.html").as_uri())
    _check_thumbnails(page, out)
    page.evaluate("window.scrollTo(0, 0)")
    shot = tmp_path / "sheet.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert page.locator("section.shot").count() == 11
    assert page.locator("#picks-count").inner_text() == "0 of 11 shots picked, 0 to reroll"

    page.locator('section[data-shot="s02-keeper-wakes"] input[value="s02-keeper-wakes/s02-keeper-wakes_c1_s1003.png"]'
                 ).click()
    page.locator('section[data-shot="s06-ship"] input[value="s06-ship/s06-ship_c3_s1009.png"]').click()
    page.locator('section[data-shot="s03-stairs"] input.reroll').click()
    with page.expect_download() as info:
        page.click("#save-picks")
    download = info.value
    assert download.suggested_filename == "picks.yaml"
    saved = tmp_path / "picks.yaml"
    download.save_as(str(saved))
    expected = (f"# bcg picks for \"{out}\"\n"
                "# apply: bcg pick OUT_DIR picks.yaml    reroll: bcg render JOB --reroll picks.yaml\n"
                "picks:\n"
                '  "s02-keeper-wakes": "s02-keeper-wakes/s02-keeper-wakes_c1_s1003.png"\n'
                '  "s06-ship": "s06-ship/s06-ship_c3_s1009.png"\n'
                "reroll:\n"
                '  - "s03-stairs"\n')
    assert saved.read_text(encoding="utf-8") == expected
    assert page.locator("#picks-yaml").input_value() == expected  # the same text, to copy
    assert page.locator("#picks-count").inner_text() == "2 of 11 shots picked, 1 to reroll"
    assert problems == []

    # what the page saves is what `bcg pick` reads
    picks = load_picks(saved, out, job)
    assert picks.reroll == ("s03-stairs",)
    written = apply_picks(out, picks, job)
    assert [p.name for p in written] == ["002_s02-keeper-wakes.png", "006_s06-ship.png"]
    # the rebuilt sheet starts from the recorded picks
    write_sheet(out, job)
    page.reload()
    page.wait_for_load_state("load")
    assert page.locator("#picks-yaml").input_value() == expected
    assert problems == []
    page.close()


def test_sheet_through_a_static_web_server(example, browser):
    job, out = example
    handler = functools.partial(QuietHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        page, problems = _open(browser, f"http://127.0.0.1:{server.server_address[1]}/index.html")
        _check_thumbnails(page, out)
        href = page.locator("section.shot a").first.get_attribute("href")
        response = page.request.get(f"http://127.0.0.1:{server.server_address[1]}/{href}")
        assert response.ok and response.body()[:8] == b"\x89PNG\r\n\x1a\n"
        assert problems == []
        page.close()
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_sheet_shows_a_refinement_after_its_source_with_the_mask_outlined(example, browser, tiny_cpu, tmp_path):
    """`bcg refine` on the example's folder (a shot with a LoRA, a cropped inpainting): the sheet in Chromium shows
    the refinement right after its source, the repainted box outlined over its thumbnail, pickable."""
    from storyboard_cli.run.refine import refine

    job, rendered = example
    out = tmp_path / "episode1"
    shutil.copytree(rendered, out)
    source = "s02-keeper-wakes/s02-keeper-wakes_c1_s1003.png"
    (tmp_path / "refines.yaml").write_text(f"refine:\n  - shot: s02-keeper-wakes\n    candidate: {source}\n"
                                           "    name: face\n    mask: {box: [64, 48, 96, 80], padding: 16}\n"
                                           "    prompt: the keeper's face, lantern light\n    strength: 0.5\n")
    result = refine(out, tmp_path / "refines.yaml", RenderOptions(), models=tiny_cpu)
    assert result.status == "done" and result.rendered == 1
    refined = "s02-keeper-wakes/s02-keeper-wakes_c1_s1003.face_c0_s1003.png"
    page, problems = _open(browser, (out / "index.html").as_uri())
    row = page.locator('section[data-shot="s02-keeper-wakes"] figure')
    hrefs = [row.nth(i).locator("a").get_attribute("href") for i in range(row.count())]
    assert hrefs[hrefs.index(source) + 1] == refined  # right after its source
    figure = page.locator("figure.refine")
    assert figure.count() == 1 and figure.get_attribute("data-source") == source
    figure.scroll_into_view_if_needed()
    img = figure.locator("img").bounding_box()
    rect = figure.locator("svg.mask-outline rect").bounding_box()
    scale = img["width"] / 256  # the 256x256 frame as its thumbnail shows it
    assert abs(rect["x"] - (img["x"] + 64 * scale)) <= 2 and abs(rect["y"] - (img["y"] + 48 * scale)) <= 2
    assert abs(rect["width"] - 96 * scale) <= 3 and abs(rect["height"] - 80 * scale) <= 3
    assert figure.locator("img").evaluate("img => img.naturalWidth") > 0
    figure.locator("input.pick").click()
    assert f'"s02-keeper-wakes": "{refined}"' in page.locator("#picks-yaml").input_value()
    assert problems == []
    page.close()
