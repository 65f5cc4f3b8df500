"""The documentation site: built, its examples run, every page opened in headless Chromium.

* ``mkdocs build --strict`` (``mkdocs.yml``) into a temporary folder: a broken link or anchor between pages, a page
  missing from the nav or a nav entry without its page fails the build;
* every ```` ```python ```` block of every ``docs/**/*.md`` page and of ``README.md`` runs as written, on the CPU
  (``TRITON_INTERPRET=1``, no CUDA device visible), the blocks of a page in order in one interpreter, as a reader
  follows the page; each block's own asserts are its checks (``MXLIB_DOCS_EXPERTS=8``: the getting-started page's
  model of Qwen3-30B-A3B's layer shape has 8 experts instead of 128, as the page says);
* every ``docs/**/*.md`` is in the nav, and every nav entry is a page;
* every built page is opened from disk (``file://``, as a reader opens ``build/docs/index.html``) in one headless
  Chromium driven over the DevTools protocol: no console error, no uncaught exception, no failed load, no
  resource fetched from the network (the network is mapped away); every internal link resolves to a built file
  and every ``#anchor`` to an element id of its target page;
* the API pages document every public name: ``mxlib.__all__`` where the package has one, and the ``__all__`` of
  every public module; a name counts as documented when an API page has an anchor ``<module>.<name>`` whose module
  holds the same object (mkdocstrings' heading ids).

Chromium is the Debian package ``chromium``; ``tools/ensure_chromium.sh`` installs it. mkdocs comes with the
``docs`` extra (``pip install -e ".[docs]"``; ``make test`` installs ``.[dev]``, which includes it).
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pkgutil
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from _util import chromium_binary

pytestmark = pytest.mark.notebook  # builds the site and drives Chromium: the second stage of `make test`

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# pages whose ```python blocks run: the docs pages and the README
EXAMPLE_PAGES = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md")) + ["README.md"]
# built files that are no page a reader opens from disk: the executed notebooks' HTML that tools/docs_hooks.py
# publishes, and the web server's 404 page (its asset URLs are absolute, for a server)
NOT_PAGES = ("workbook/", "404.html")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", flags=re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```` ```python ```` fences of a Markdown text (fences at the start of a line)."""
    return PYTHON_BLOCK.findall(text)


# ----------------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built with ``--strict`` into a temporary folder."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail('mkdocs is not installed: pip install -e ".[docs]" (make test installs it)')
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def nav_pages(nav) -> list[str]:
    """The page paths of an mkdocs ``nav`` (nested lists of ``{title: path}``, ``{title: [...]}`` or paths)."""
    pages = []
    for item in nav:
        values = item.values() if isinstance(item, dict) else [item]
        for v in values:
            pages += nav_pages(v) if isinstance(v, list) else [v]
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    in_nav = nav_pages(config["nav"])
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(in_nav)) == sorted(in_nav), f"pages listed twice in the nav: {in_nav}"
    assert not set(on_disk) - set(in_nav), f"docs pages missing from mkdocs.yml's nav: {set(on_disk) - set(in_nav)}"
    assert not set(in_nav) - set(on_disk), f"nav entries without a page in docs/: {set(in_nav) - set(on_disk)}"


def test_nav_pages_reads_nested_sections():
    nav = [{"Home": "index.md"}, "a.md", {"Guides": [{"X": "x.md"}, {"Deeper": ["y/z.md"]}]}]
    assert nav_pages(nav) == ["index.md", "a.md", "x.md", "y/z.md"]


def test_the_site_holds_every_page_and_the_notebooks(site):
    for page in DOCS.rglob("*.md"):
        built = site / page.relative_to(DOCS).with_suffix(".html")
        assert built.is_file(), f"{page.relative_to(ROOT)} was not built into {built.relative_to(site)}"
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert (site / "notebooks" / nb.name).read_bytes() == nb.read_bytes(), f"notebooks/{nb.name} not published"


def test_docstring_tables_and_literal_blocks_become_markdown():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from docs_griffe import rst_to_markdown
    finally:
        sys.path.remove(str(ROOT / "tools"))
    text = (
        "Intro.\n\n======  ==========\nname    meaning\n======  ==========\n``a``   first, and\n"
        "        more | text\nb       second\n======  ==========\n\nThen::\n\n    x = 1\n      y\n\nEnd.\n"
    )
    assert rst_to_markdown(text).splitlines() == [
        "Intro.",
        "",
        "",
        "| name | meaning |",
        "|---|---|",
        "| ``a`` | first, and more \\| text |",
        "| b | second |",
        "",
        "",
        "Then:",
        "",
        "```text",
        "x = 1",
        "  y",
        "```",
        "",
        "",
        "End.",
    ]
    assert rst_to_markdown(rst_to_markdown(text)) == rst_to_markdown(text)  # aliases see a docstring twice
    plain = "No table: a == b, and\n=====\nis a heading rule."
    assert rst_to_markdown(plain) == plain


def test_module_wildcards_name_every_other_public_module():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from docs_hooks import expand_module_wildcards
    finally:
        sys.path.remove(str(ROOT / "tools"))
    on_disk = sorted(p.stem for p in (ROOT / "mxlib" / "moe").glob("*.py") if not p.stem.startswith("_"))
    out = expand_module_wildcards("::: mxlib.moe.schemes\n    options:\n      heading_level: 2\n\n::: mxlib.moe.*\n")
    named = re.findall(r"^::: (\S+)$", out, flags=re.M)
    assert named == ["mxlib.moe.schemes"] + [f"mxlib.moe.{n}" for n in on_disk if n != "schemes"], named
    assert "heading_level: 2" in out
    assert expand_module_wildcards("::: mxlib.formats.*\n").strip() == ""  # a plain module has no submodules


# ----------------------------------------------------------------------------- the examples

_RUN_BLOCKS = r"""
import json, sys, traceback
page, blocks = sys.argv[1], json.load(sys.stdin)
ns = {"__name__": "__main__"}
for i, code in enumerate(blocks):
    try:
        exec(compile(code, f"{page} python block {i + 1} of {len(blocks)}", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"{page}: python block {i + 1} of {len(blocks)} failed")
"""


def test_python_blocks_are_found():
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n  ```python\nindented\n  ```\n```python\nb = 2\n```\n"
    assert python_blocks(text) == ["a = 1\n", "b = 2\n"]
    assert python_blocks((DOCS / "getting-started.md").read_text(encoding="utf-8")), "getting-started has no example"


@pytest.mark.parametrize("page", [p for p in EXAMPLE_PAGES if python_blocks((ROOT / p).read_text(encoding="utf-8"))])
def test_python_blocks_run_as_written(page, tmp_path):
    blocks = python_blocks((ROOT / page).read_text(encoding="utf-8"))
    path = os.environ.get("PYTHONPATH", "")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        CUDA_VISIBLE_DEVICES="",  # the CPU, as on a laptop
        MXLIB_DOCS_EXPERTS="8",  # getting-started's Qwen3-30B-A3B-shaped layer with 8 experts, not 128
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in path.split(os.pathsep) if p]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_BLOCKS, page],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # whatever a block writes stays in the test's folder
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stderr[-4000:]}"


# ----------------------------------------------------------------------------- Chromium


class Chromium:
    """One headless Chromium, driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: the
    browser reads commands from fd 3 and writes replies and events to fd 4, NUL-separated JSON)."""

    def __init__(self, binary: str):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def child_fds():  # runs in the child: the two pipe ends onto fds 3 and 4
            hi_r, hi_w = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 100), fcntl.fcntl(out_w, fcntl.F_DUPFD, 100)
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        args = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--window-size=1280,900",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: a page that needs the network fails to load it
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args, pass_fds=(3, 4), preexec_fn=child_fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._out_r], [], [], max(left, 0))
            if not ready:
                raise TimeoutError("chromium: no reply")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited ({self.proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool = False, timeout: float = 60, **params) -> dict:
        """Send one command and return its result; events read meanwhile go to ``self.events``."""
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, event: str, timeout: float = 60) -> None:
        """Read events until ``event`` arrives (or is already among the unread ones)."""
        deadline = time.monotonic() + timeout
        while not any(e["method"] == event for e in self.events):
            reply = self._read(deadline)
            if "method" in reply:
                self.events.append(reply)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, awaitPromise=True,
                           returnByValue=True)  # fmt: skip
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)


# What a page reports once loaded and settled: its element ids, its links, every resource it loaded.
_PAGE_REPORT = """
new Promise(resolve => setTimeout(resolve, 300)).then(() => JSON.stringify({
  ids: Array.from(document.querySelectorAll('[id]'), e => e.id),
  links: Array.from(document.querySelectorAll('a[href]'), a => a.getAttribute('href')),
  resources: performance.getEntriesByType('resource').map(r => r.name),
  assets: Array.from(document.querySelectorAll('script[src], img[src], iframe[src], source[src], link[href]'),
                     e => e.getAttribute(e.tagName === 'LINK' ? 'href' : 'src')),
  h1: Array.from(document.querySelectorAll('article h1'), h => h.textContent.trim()),
}))
"""


def problems_of(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions, failed loads and network requests among DevTools events."""
    out = []
    for e in events:
        m, p = e["method"], e.get("params", {})
        if m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            out.append(
                f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
            )
        elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
            out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}".strip())
        elif m == "Network.loadingFailed" and not p.get("canceled"):
            out.append(f"failed load: {p.get('errorText')} (request {p['requestId']})")
        elif m == "Network.requestWillBeSent" and urlsplit(p["request"]["url"]).scheme in ("http", "https", "ws"):
            out.append(f"network request: {p['request']['url']}")
    return out


def visit_pages(site: Path, pages: list[Path]) -> dict[str, dict]:
    """Open each page in one Chromium; ``{path relative to site: report + "problems"}``."""
    browser = Chromium(chromium_binary())
    reports = {}
    try:
        for page in pages:
            browser.events.clear()
            browser.call("Page.navigate", session=True, url=page.as_uri())
            browser.wait_for("Page.loadEventFired")
            report = json.loads(browser.evaluate(_PAGE_REPORT))
            report["problems"] = problems_of(browser.events)
            reports[page.relative_to(site).as_posix()] = report
    finally:
        browser.close()
    return reports


def broken_links(site: Path, reports: dict[str, dict]) -> list[str]:
    """Internal links of the visited pages whose file is not in the site, or whose anchor is no id there."""
    bad = []
    for page, report in reports.items():
        for href in report["links"]:
            parts = urlsplit(href)
            if parts.scheme in ("http", "https", "mailto"):
                continue
            if parts.scheme or parts.netloc:
                bad.append(f"{page}: link {href!r} leaves the site")
                continue
            target = (site / page).parent / unquote(parts.path) if parts.path else site / page
            target = target.resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_relative_to(site.resolve()) or not target.is_file():
                bad.append(f"{page}: link {href!r}: no file {target}")
                continue
            if parts.fragment:
                rel = target.relative_to(site.resolve()).as_posix()
                ids = reports[rel]["ids"] if rel in reports else None
                if ids is None:
                    bad.append(f"{page}: link {href!r}: anchor into {rel}, a page that was not visited")
                elif unquote(parts.fragment) not in ids:
                    bad.append(f"{page}: link {href!r}: no id {parts.fragment!r} in {rel}")
    return bad


def built_pages(site: Path) -> list[Path]:
    return sorted(
        p for p in site.rglob("*.html") if not p.relative_to(site).as_posix().startswith(NOT_PAGES)
    )  # fmt: skip


@pytest.fixture(scope="module")
def page_reports(site) -> dict[str, dict]:
    return visit_pages(site, built_pages(site))


def test_every_page_renders_without_errors_or_network(site, page_reports):
    assert len(page_reports) >= len(list(DOCS.rglob("*.md"))), sorted(page_reports)
    problems = {page: r["problems"] for page, r in page_reports.items() if r["problems"]}
    assert not problems, json.dumps(problems, indent=1)
    for page, r in page_reports.items():
        assert all(urlsplit(u).scheme == "file" for u in r["resources"]), f"{page}: {r['resources']}"
        remote = [a for a in r["assets"] if urlsplit(a).scheme or a.startswith("//")]  # loaded now or later
        assert not remote, f"{page}: assets from outside the site: {remote}"
        assert len(r["h1"]) == 1 and r["h1"][0], f"{page}: expected one page title, got {r['h1']}"


def test_every_internal_link_and_anchor_resolves(site, page_reports):
    links = sum(len(r["links"]) for r in page_reports.values())
    assert links > 100, f"only {links} links on {len(page_reports)} pages"
    bad = broken_links(site, page_reports)
    assert not bad, "\n".join(bad)


def test_the_browser_checks_catch_errors_broken_links_and_the_network(tmp_path):
    """The checks can fail: a console error, an uncaught exception, a missing script, a network asset, a link to
    a missing page and one to a missing anchor are each reported."""
    (tmp_path / "a.html").write_text(
        '<html><head><script src="missing.js"></script><script src="https://example.com/x.js"></script></head>'
        '<body><h1 id="top">A</h1><a href="b.html#top">ok</a><a href="b.html#nowhere">bad anchor</a>'
        '<a href="c.html">missing page</a><a href="#top">self</a>'
        '<script>console.error("boom"); undefined_function();</script></body></html>',
        encoding="utf-8",
    )
    (tmp_path / "b.html").write_text('<html><body><h2 id="top">B</h2></body></html>', encoding="utf-8")
    reports = visit_pages(tmp_path, [tmp_path / "a.html", tmp_path / "b.html"])
    found = "\n".join(reports["a.html"]["problems"])
    for needle in ("console.error: boom", "undefined_function", "missing.js", "network request: https://example.com"):
        assert needle in found, f"{needle!r} not reported in:\n{found}"
    assert reports["b.html"]["problems"] == []
    assert "https://example.com/x.js" in reports["a.html"]["assets"]
    bad = "\n".join(broken_links(tmp_path, reports))
    assert "'b.html#nowhere': no id 'nowhere'" in bad and "'c.html': no file" in bad, bad
    assert "#top'" not in bad and "'b.html#top'" not in bad, bad


# ----------------------------------------------------------------------------- the API pages


def public_names() -> dict[str, list[str]]:
    """``{module: names}`` the API pages must document: ``mxlib.__all__`` where the package has one (its dunder
    names aside), and the ``__all__`` of every public module (no leading underscore in its path)."""
    import mxlib

    out = {}
    if hasattr(mxlib, "__all__"):  # module metadata such as __version__ is no API entry
        out["mxlib"] = [n for n in mxlib.__all__ if not n.startswith("__")]
    for info in pkgutil.walk_packages(mxlib.__path__, "mxlib."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        if hasattr(module, "__all__"):
            out[info.name] = list(module.__all__)
    return out


def undocumented(names: dict[str, list[str]], ids: set[str]) -> list[str]:
    """The ``module.name`` pairs no anchor documents: an anchor ``m.name`` counts when module ``m`` holds the same
    object as ``module.name`` (the object itself, or re-exported)."""
    by_name: dict[str, list[str]] = {}
    for anchor in ids:
        mod, _, name = anchor.rpartition(".")
        if mod.startswith("mxlib"):
            by_name.setdefault(name, []).append(mod)
    missing = []
    for mod_name, mod_names in names.items():
        module = importlib.import_module(mod_name)
        for name in mod_names:
            obj = getattr(module, name)
            holders = []
            for m in by_name.get(name, []):
                try:
                    holders.append(importlib.import_module(m))
                except ImportError:  # an anchor of a class member: "mxlib.x.Class.method"
                    continue
            if not any(getattr(h, name, None) is obj for h in holders):
                missing.append(f"{mod_name}.{name}")
    return missing


def test_undocumented_finds_what_no_anchor_documents():
    ids = {"mxlib.reference.quantize_mx", "mxlib.moe.factory.make_emulation_experts", "mxlib.formats.Numerics.VLLM"}
    names = {"mxlib.reference": ["quantize_mx", "dequantize_mx"], "mxlib.moe": ["make_emulation_experts"]}
    assert undocumented(names, ids) == ["mxlib.reference.dequantize_mx"]


def test_the_api_pages_document_every_public_name(page_reports):
    ids = {i for page, r in page_reports.items() if page.startswith("api/") for i in r["ids"]}
    names = public_names()
    assert sum(len(v) for v in names.values()) > 50, names
    missing = undocumented(names, ids)
    assert not missing, f"public names on no API page ({len(missing)}): {missing}"
