"""Data Docs render offline: every asset a page loads is served from the output folder, and headless Chromium (Debian's
``chromium``, installed by ``make setup``) with the network off draws the validation results list. A control site
that keeps GX's CDN links draws nothing under the same conditions."""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

from photon.tools.quality import check_quality, data_docs_assets, remote_loads
from tests.integration.test_quality import END, HOUR, START, World

CHROMIUM = Path("/usr/bin/chromium")
VALIDATION_ROW = re.compile(r'<tr[^>]*data-href="validations/[^"]*"[^>]*data-index="\d+"')


def render(page: Path, profile: Path) -> tuple[str, str]:
    """The page's DOM after its scripts ran, and Chromium's console, with every request off this machine refused (no
    name resolves; any proxied request goes to a closed port)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make setup` installs Debian's chromium (apt-get install chromium)")
    run = subprocess.run(
        [
            str(CHROMIUM),
            *("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"),
            *("--disable-background-networking", "--disable-component-update", f"--user-data-dir={profile}"),
            *("--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9"),
            *("--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, "\n".join(line for line in run.stderr.splitlines() if ":CONSOLE" in line)


def build_site(root: Path) -> Path:
    """Two intervals of output checked, one passing and one failing: four validation results."""
    w = World()
    twice = World.row(END + 17, "dc-a")
    w.joined += [twice, {**twice, "pipeline": "dc-b"}]  # a click of the next hour joined by both: that check fails
    out, logs = w.write(root)
    assert check_quality(out, logs, START, END).success
    assert not check_quality(out, logs, END, END + HOUR).success
    return out / "_quality" / "data_docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert data_docs_assets() is not None, "the Data Docs assets are not installed: run `make setup`"
    return build_site(tmp_path_factory.mktemp("site"))


def test_index_lists_the_validation_results_offline(site: Path, tmp_path: Path) -> None:
    dom, console = render(site / "index.html", tmp_path)
    rows = VALIDATION_ROW.findall(dom)
    assert len(rows) == 6, dom[-3000:]  # joined, rates and completeness for each of the two intervals
    assert sum("interval%202025-11-21T04%3A00%3A00%2B3600s" in r for r in rows) == 3
    assert sum("interval%202025-11-21T05%3A00%3A00%2B3600s" in r for r in rows) == 3
    assert console == ""  # nothing failed to load, nothing threw


def test_a_failed_validation_page_renders_offline(site: Path, tmp_path: Path) -> None:
    page = next((site / "validations" / "photon_joined").glob("interval 2025-11-21T05*/*/*.html"))
    dom, console = render(page, tmp_path)
    assert len(re.findall(r'<tr[^>]*data-index="\d+"', dom)) > 5  # bootstrap-table drew the results' tables
    assert "expect_column_values_to_be_unique" in dom or "values must be unique" in dom
    assert console == ""


def test_every_asset_is_served_from_the_output_folder(site: Path) -> None:
    pages = list(site.rglob("*.html"))
    assert len(pages) >= 10  # index, 3 suites, 6 validation results
    for page in pages:
        html = page.read_text()
        assert remote_loads(html) == [], page
        for ref in re.findall(r"""<(?:script|link|img)\b[^>]*?\b(?:src|href)=["']([^"'#]+)""", html):
            assert (page.parent / unquote(ref)).resolve().is_file(), (page, ref)
        for ref in re.findall(r"""url\(["']?([^"')]+)""", html):
            assert ref.startswith("data:") or (page.parent / unquote(ref)).resolve().is_file(), (page, ref)
    # The icon font the stylesheet loads, beside it.
    css = site / "static" / "vendor" / "@fortawesome" / "fontawesome-free" / "css" / "all.min.css"
    for ref in set(re.findall(r"url\(([^)]+\.woff2)\)", css.read_text())):
        assert (css.parent / ref).resolve().is_file(), ref


def test_the_local_files_are_the_ones_gx_pins(site: Path) -> None:
    """GX pins two scripts by subresource-integrity hash: the npm packages' files are those very bytes."""
    import great_expectations

    template = Path(great_expectations.__file__).parent / "render" / "view" / "templates" / "js_script_imports.j2"
    pinned = dict(re.findall(r'src="([^"]+)" integrity="(sha384-[^"]+)"', template.read_text()))
    local = {
        "popper.min.js": site / "static/vendor/popper.js/dist/umd/popper.min.js",
        "bootstrap.min.js": site / "static/vendor/bootstrap/dist/js/bootstrap.min.js",
    }
    assert len(pinned) == 2
    for url, sri in pinned.items():
        data = local[url.rsplit("/", 1)[1]].read_bytes()
        assert "sha384-" + base64.b64encode(hashlib.sha384(data).digest()).decode() == sri, url


def test_control_gx_cdn_links_render_no_rows_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the local assets the pages keep GX's CDN links, and the same offline browser draws no validation row:
    what the test above would see if the rewrite broke."""
    monkeypatch.setenv("PHOTON_DATA_DOCS_ASSETS", str(tmp_path / "nowhere"))
    control = build_site(tmp_path / "control")
    index = (control / "index.html").read_text()
    assert any(u.startswith("https://unpkg.com/bootstrap-table@") for u in remote_loads(index))
    dom, console = render(control / "index.html", tmp_path / "profile")
    assert VALIDATION_ROW.findall(dom) == []
    assert "Uncaught ReferenceError: $ is not defined" in console, console  # jQuery never arrived
