"""A Sphinx extension for gpumagic's docs: the magic reference, generated from the parsers at
build time, and module docstrings shown as pages of "how it works".

``magic-reference`` (a directive, no argument): one section per command that
:func:`magic_help.commands` finds by walking ``%gpu``'s table (and ``%%remote``), a table's rows
inside its section, each with the row's one-line summary and the help text the notebook prints for ``-h``
(:func:`magic_help.help_text`).  A sub-command added, renamed or given a new option shows in the
next build; nothing is written by hand.  Option ``:lang: zh-CN`` translates the words around
the help (the help itself is the parser's, in English).  Each section's id is
:attr:`magic_help.Command.anchor` (``magic-gpu-sync``), a label that ``{ref}`` reaches.

``module-doc`` (a directive, argument: a module name, or a program's path under ``gpumagic/``
such as ``remote/programs/kernel_keeper.py``): the module's docstring, read as reST
with its section titles.  Its cross-references (``:func:`_take_runner```) are resolved within
the module where they can be; one that names something the API pages do not show is kept as
text (it is internal), never a broken link.  ``:as-text:`` shows a docstring laid out as plain
text (aligned columns that are no reST) as it is written.
"""

from __future__ import annotations

import importlib
import inspect

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.parsers.rst import Parser as RSTParser
from docutils.utils import new_document
from sphinx.util.docutils import SphinxDirective

import magic_help

WORDS = {
    "en": {"help": "What `-h` prints:", "table": "What `help` prints:"},
    "zh-CN": {"help": "`-h` 打印的帮助（由解析器生成，英文）：", "table": "`help` 打印的子命令表（由解析器生成，英文）："},
}


class MagicReference(SphinxDirective):
    has_content = False
    option_spec = {"lang": directives.unchanged}

    def run(self):
        lang = self.options.get("lang", "en")
        words = WORDS[lang]
        prefix = "" if lang == "en" else lang.lower() + "-"
        ip = magic_help.shell()
        summaries = magic_help.summaries()
        out: list[nodes.Node] = []
        tables: dict[str, nodes.section] = {}  # a table's section holds its rows' sections
        for command in magic_help.commands():
            anchor = prefix + command.anchor
            section = nodes.section(ids=[anchor], names=[anchor])
            section += nodes.title("", "", nodes.literal(text=command.name))
            if summaries.get(command.name):
                section += nodes.paragraph(text=summaries[command.name])
            intro = nodes.paragraph()
            before, code, after = words["table" if command.table else "help"].split("`")
            intro += [nodes.Text(before), nodes.literal(text=code), nodes.Text(after)]
            section += intro
            text = magic_help.help_text(command, ip)
            block = nodes.literal_block(text, text, language="none")
            block["classes"].append("magic-help")
            section += block
            self.env.get_domain("std").note_hyperlink_target(anchor, self.env.docname, anchor, command.name)
            parent = max((name for name in tables if command.name.startswith(name + " ")), key=len, default=None)
            (tables[parent] if parent is not None else out).append(section)
            if command.table:
                tables[command.name] = section
        return out


class ModuleDoc(SphinxDirective):
    required_arguments = 1
    has_content = False
    option_spec = {"as-text": directives.flag}

    def run(self):
        name = self.arguments[0]
        if name.endswith(".py"):  # a program run on the machine, not imported here
            import ast
            from pathlib import Path

            import gpumagic

            path = Path(gpumagic.__file__).parent / name
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            name = "gpumagic." + name[:-3].replace("/", ".")
        else:
            doc = inspect.cleandoc(importlib.import_module(name).__doc__ or "")
        if "as-text" in self.options:  # a docstring laid out as plain text (aligned columns)
            return [nodes.literal_block(doc, doc, language="none")]
        saved = self.env.ref_context.get("py:module")
        self.env.ref_context["py:module"] = name
        try:
            # a docstring is reST (numpydoc), whatever the page is written in
            doc_tree = new_document(self.state.document["source"], self.state.document.settings)
            doc_tree.reporter = self.state.document.reporter
            RSTParser().parse(doc, doc_tree)
        finally:
            if saved is None:
                self.env.ref_context.pop("py:module", None)
            else:
                self.env.ref_context["py:module"] = saved
        return list(doc_tree.children)


def _internal_reference_as_text(app, env, node, contnode):
    """A Python reference to a gpumagic object that exists but that the API pages do not show
    (an internal function, a module): its text, unlinked.  A reference to nothing (a name
    misspelt, or renamed in the code) is left to fail the build."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip(".~")
    module, cls = node.get("py:module") or "", node.get("py:class") or ""
    names = [target]
    if module:
        names += [f"{module}.{cls}.{target}" if cls else "", f"{module}.{target}"]
    if any(name and name.split(".")[0] == "gpumagic" and _exists(name) for name in names):
        return contnode
    return None


def _exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute reached from one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if attr in getattr(obj, "__annotations__", {}) or attr in getattr(obj, "__dataclass_fields__", {}):
                return True
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _tutorial_lexer(app, docname, source):
    """The tutorials are IPython (``%gpu ... $var`` lines): highlight them as such.  Only the
    text read here is changed, never the notebook file."""
    if not docname.startswith("tutorials/"):
        return
    import json

    nb = json.loads(source[0])
    info = nb.setdefault("metadata", {}).setdefault("language_info", {})
    info.setdefault("name", "python")
    info["pygments_lexer"] = "ipython3"
    source[0] = json.dumps(nb)


def setup(app):
    app.add_directive("magic-reference", MagicReference)
    app.add_directive("module-doc", ModuleDoc)
    app.connect("missing-reference", _internal_reference_as_text)
    app.connect("source-read", _tutorial_lexer)
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True}
