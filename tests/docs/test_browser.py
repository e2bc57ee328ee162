"""The built documentation site, opened in a real browser (headless Chromium).

Run by ``make docs-test`` after ``make docs`` (CI installs Debian's ``chromium``); marked
``browser``, which the default run deselects. The site in ``docs/_build/html`` is served by
a local HTTP server and driven with Playwright's Python package, pointed at the system
Chromium (``JAXSOFT_CHROMIUM``, default ``/usr/bin/chromium``; Playwright's own browser
download is not used). The checks: the home page (its screenshot is written to
``docs/_build/screenshot-home.png``), the ``sparsemax`` API page with its formula rendered by
MathJax and its example, a notebook page with its plot loaded, the search page finding
``entmax``, and a crawl of every internal link of the site (none may 404).

With no built site, no browser or no Playwright the tests fail with a message saying what to
install or run (they never skip: the marker keeps them out of the default run instead).
"""

from __future__ import annotations

import contextlib
import functools
import html.parser
import http.server
import os
import pathlib
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.browser

ROOT = pathlib.Path(__file__).resolve().parents[2]
SITE = ROOT / "docs" / "_build" / "html"
SCREENSHOT = ROOT / "docs" / "_build" / "screenshot-home.png"
CHROMIUM = os.environ.get("JAXSOFT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage"]
TIMEOUT_MS = 30_000


def _unavailable(reason: str):
  pytest.fail(reason, pytrace=False)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, format, *args):  # noqa: A002
    del format, args


@contextlib.contextmanager
def _serve(directory: pathlib.Path) -> Iterator[str]:
  handler = functools.partial(_QuietHandler, directory=str(directory))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}/"
  finally:
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
  if not (SITE / "index.html").exists():
    _unavailable(f"no built site in {SITE}: run `make docs` first")
  with _serve(SITE) as url:
    yield url


@pytest.fixture(scope="module")
def browser():
  if not os.path.exists(CHROMIUM):
    _unavailable(f"no Chromium at {CHROMIUM}: install it (`apt-get install -y chromium`) "
                 "or point JAXSOFT_CHROMIUM at one")
  try:
    from playwright.sync_api import sync_playwright  # noqa: PLC0415
  except ImportError:
    _unavailable("Playwright's Python package is missing: pip install -e '.[docs]'")
  with tempfile.TemporaryDirectory(prefix="jaxsoft-chromium-") as profile:
    with sync_playwright() as playwright:
      context = playwright.chromium.launch_persistent_context(
          profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
          viewport={"width": 1280, "height": 900})
      context.set_default_timeout(TIMEOUT_MS)
      yield context
      context.close()


@pytest.fixture
def page(browser):
  page = browser.new_page()
  errors: list[str] = []
  page.on("pageerror", lambda error: errors.append(str(error)))
  yield page
  page.close()
  assert not errors, f"JavaScript errors: {errors}"


def test_home_page(site, page):
  response = page.goto(site + "index.html")
  assert response is not None and response.ok
  assert "jaxsoft" in page.title()
  assert page.locator("h1").first.inner_text().startswith("jaxsoft")
  nav = page.locator("nav.bd-links").inner_text()
  for entry in ("Getting started", "Numerics", "API reference"):
    assert entry in nav, f"{entry!r} missing from the navigation: {nav!r}"
  SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
  page.screenshot(path=str(SCREENSHOT), full_page=False)
  assert SCREENSHOT.stat().st_size > 10_000


def test_sparsemax_page_renders_its_formula_and_example(site, page):
  page.goto(site + "api/_autosummary/jaxsoft.normalizers.sparsemax.html")
  assert "sparsemax" in page.locator("h1").first.inner_text()
  # MathJax replaces the TeX source with its own output elements once it has typeset
  page.wait_for_selector("mjx-container", state="attached")
  formula = page.locator("div.math mjx-container").first
  assert formula.bounding_box()["width"] > 100
  assert "argmin" in page.locator("div.math").first.inner_text().replace("\n", "")
  example = page.locator("div.doctest, div.highlight-pycon, div.highlight-python").first
  text = example.inner_text()
  assert ">>> js.normalizers.sparsemax(jnp.array([1.0, 0.8, 0.1, -1.0]))" in text
  assert "Array([0.6, 0.4, 0. , 0. ], dtype=float32)" in text


def test_notebook_page_shows_its_plot(site, page):
  page.goto(site + "notebooks/01_normalizer_gallery.html")
  images = page.locator("div.cell_output img")
  assert images.count() > 0
  first = images.first
  first.scroll_into_view_if_needed()
  page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=first.element_handle())
  assert first.evaluate("img => img.naturalWidth") > 100


def test_search_finds_entmax(site, page):
  page.goto(site + "search.html?q=entmax")
  results = page.locator("#search-results ul.search li a")
  results.first.wait_for()
  titles = results.all_inner_texts()
  assert any("entmax" in title for title in titles), titles


def test_every_internal_link_resolves(site):
  """Crawls the site from the home page over HTTP (no browser needed for the 404s).

  Each HTML page's ``href`` and ``src`` targets inside the site are fetched; a page is
  parsed once. The crawl must reach the API pages and the notebooks.
  """
  class Links(html.parser.HTMLParser):
    def __init__(self):
      super().__init__()
      self.targets: list[str] = []

    def handle_starttag(self, tag, attrs):
      for key, value in attrs:
        if key in ("href", "src") and value and tag in ("a", "img", "link", "script"):
          self.targets.append(value)

  start = site + "index.html"
  seen, queue, broken = {start}, [start], []
  while queue:
    url = queue.pop()
    try:
      with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read()
        kind = response.headers.get_content_type()
    except urllib.error.HTTPError as error:
      broken.append(f"{url}: {error.code}")
      continue
    if kind != "text/html":
      continue
    parser = Links()
    parser.feed(body.decode("utf-8", "replace"))
    for target in parser.targets:
      absolute = urllib.parse.urldefrag(urllib.parse.urljoin(url, target))[0]
      absolute = absolute.split("?", 1)[0]
      if absolute.startswith(site) and absolute not in seen:
        seen.add(absolute)
        queue.append(absolute)
  assert not broken, f"{len(broken)} internal links do not resolve: {broken[:20]}"
  pages = {u for u in seen if u.endswith(".html")}
  assert any("/api/_autosummary/jaxsoft.normalizers.sparsemax.html" in u for u in pages)
  assert any("/notebooks/13_quantized_softmax.html" in u for u in pages)
  assert len(pages) > 300, len(pages)
