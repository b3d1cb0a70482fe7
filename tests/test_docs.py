"""The docs site (``docs/``): it builds with no warning, its magic reference is what each magic
prints for ``-h``, and every relative link of the READMEs and the docs names a file that exists.

The build is ``sphinx-build -W --keep-going -n`` (warnings are errors, every reference checked),
run once into a temporary folder for the module, offline: nothing in ``docs/conf.py`` fetches.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import magic_help  # noqa: E402  (docs/_ext: the commands the reference lists)


def _build(source: Path, out: Path) -> subprocess.CompletedProcess:
    try:
        import myst_nb  # noqa: F401
        import sphinx  # noqa: F401
    except ImportError:
        pytest.fail("the docs tools are missing: .venv/bin/pip install -e '.[docs]' (scripts/_setup.sh installs them)")
    # COLUMNS: argparse wraps the help to the terminal; a notebook kernel has none (80)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(out.parent), "COLUMNS": "80", "LANG": "C.UTF-8",
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                           "-d", str(out.parent / "doctrees"), str(source), str(out)],
                          capture_output=True, text=True, encoding="utf-8", env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "html"
    r = _build(DOCS, out)
    assert r.returncode == 0 and "WARNING" not in r.stderr and "ERROR" not in r.stderr, r.stderr[-6000:]
    return out


def test_the_docs_build_with_no_warning_and_every_page_is_there(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("*.html")}
    sources = {p.relative_to(DOCS).with_suffix(".html").as_posix()
               for p in list(DOCS.rglob("*.md")) + list(DOCS.rglob("*.ipynb"))
               if "_ext" not in p.parts and ".ipynb_checkpoints" not in p.parts}
    assert sources <= pages, sorted(sources - pages)
    # every tutorial, English and Chinese, rendered (docs/tutorials is example-notebooks/)
    notebooks = sorted(p.relative_to(ROOT / "example-notebooks").with_suffix(".html").as_posix()
                       for p in (ROOT / "example-notebooks").rglob("*.ipynb"))
    assert len(notebooks) >= 22 and {f"tutorials/{n}" for n in notebooks} <= pages
    # the API pages come from the docstrings
    api = (site / "reference" / "api.html").read_text(encoding="utf-8")
    for name in ("gpumagic.connect", "gpumagic.Machine.run", "gpumagic.Machine.push", "gpumagic.fleet.Fleet",
                 "gpumagic.current_machine", "gpumagic.KeepOptions"):
        assert f'id="{name}"' in api, name
    # nothing from the network: no page loads a script, style sheet or image from elsewhere
    remote = re.compile(r'<(?:script|link|img)\b[^>]*(?:src|href)="(?:https?:)?//', re.I)
    assert not [p for p in site.rglob("*.html") if remote.search(p.read_text(encoding="utf-8"))]


def _reference_blocks(page: Path, prefix: str = "") -> dict[str, str]:
    """The help text under each command's section of a built reference page, by section id."""
    text = page.read_text(encoding="utf-8")
    found = {}
    for m in re.finditer(r'<section id="(' + prefix + r'magic-[\w-]+)">(.*?)(?=<section id=|</article>)', text, re.S):
        pre = re.search(r"<pre>(.*?)</pre>", m.group(2), re.S)
        if pre:
            found[m.group(1)] = html.unescape(re.sub(r"<[^>]+>", "", pre.group(1))).rstrip("\n")
    return found


def _printed(ip, capsys, command: magic_help.Command) -> str:
    capsys.readouterr()
    if command.name == "%%remote":
        ip.run_cell_magic("remote", command.line, "pass")
    else:
        ip.run_line_magic("gpu", command.line)
    return capsys.readouterr().out.rstrip("\n")


@pytest.mark.parametrize("page, prefix", [("reference/magics.html", ""), ("zh-CN/magics.html", "zh-cn-")])
def test_each_magics_reference_is_what_it_prints_for_help(site, _ipython, capsys, monkeypatch, page, prefix):
    monkeypatch.setenv("COLUMNS", "80")
    blocks = _reference_blocks(site / page, prefix)
    commands = magic_help.commands()
    names = {c.name for c in commands}
    # every row of every table, found by the walk: %gpu's own rows and the groups' rows
    from gpumagic.notebook.magics import SUBCOMMANDS
    from gpumagic.notebook.magics.kernel import KERNEL
    assert {f"%gpu {name}" for name in SUBCOMMANDS} <= names
    assert {f"%gpu kernel {name}" for name in KERNEL} <= names
    assert {"%%remote", "%gpu budget set", "%gpu tunnel PORT", "%gpu budget [--host NAME]", "%gpu job move"} <= names
    assert sorted(blocks) == sorted(prefix + c.anchor for c in commands)
    differ = [c.name for c in commands if blocks[prefix + c.anchor] != _printed(_ipython, capsys, c)]
    assert differ == []
    assert "--delete" in blocks[prefix + "magic-gpu-sync"] and "--grace S" in blocks[prefix + "magic-remote"]


def test_a_broken_reference_fails_the_build(tmp_path):
    # the same configuration, one page with a reference to a page, a label and a gpumagic
    # function that do not exist, and one to an internal function that does (shown as text)
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text((DOCS / "conf.py").read_text(encoding="utf-8").replace(
        'HERE = Path(__file__).resolve().parent', f'HERE = Path({str(DOCS)!r})'), encoding="utf-8")
    (src / "index.md").write_text(
        "# Broken\n\n{doc}`guide/nowhere`, {ref}`magic-gpu-nowhere`, {py:func}`gpumagic.machine.no_such_function`,"
        " {py:func}`gpumagic.remote.execution.run`, [a file](nowhere.md)\n", encoding="utf-8")
    r = _build(src, tmp_path / "html")
    assert r.returncode != 0
    for missing in ("guide/nowhere", "magic-gpu-nowhere", "gpumagic.machine.no_such_function", "nowhere.md"):
        assert missing in r.stderr, missing
    assert "gpumagic.remote.execution.run" not in r.stderr


# -- links in the READMEs and the docs ------------------------------------------------------

#: A Markdown link or image: ``[text](target)``, ``![alt](target)``.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # not in code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def test_every_relative_link_of_the_readmes_and_the_docs_names_a_file_that_exists():
    files = [ROOT / "README.md", ROOT / "README.zh-CN.md"] + sorted(
        p for p in DOCS.rglob("*.md") if "_ext" not in p.parts)
    links = {(f, t) for f in files for t in _relative_links(f)}
    assert len(links) >= 40  # the READMEs link into the docs
    broken = [f"{f.relative_to(ROOT)}: {t}" for f, t in sorted(links)
              if not (f.parent / t.split("#")[0]).exists()]
    assert broken == []


def test_the_readmes_are_front_pages():
    for name in ("README.md", "README.zh-CN.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 200, name
        assert "as before" not in text, name
    # every user-guide page and "how it works" page is linked from the README
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT).as_posix() for sub in ("guide", "how-it-works", "reference")
                   for p in (DOCS / sub).glob("*.md"))
    assert [p for p in pages if f"]({p})" not in readme] == []
