"""Sphinx additions of The Tested Transformer, loaded through
``sphinx.local_extensions`` in _config.yml.

- ``authoryear``: a pybtex style whose bibliography labels read as the citations in
  the text do ("Vaswani et al., 2017", not "[VSP+17]"), sorted by author, year and
  title.
- pybtex's plain-text backend registered at run time, so that finding it
  does not read every installed package's entry points at each citation.
- Inline scripts written twice into a page are written once: sphinx-thebe's settings
  and sphinx-togglebutton's selector. Sphinx keeps both the copy that an extension
  registers before the builder exists and the copy it adds to the builder, because
  their empty file names differ (None and ""). A second ``const THEBE_JS_URL = ...``
  is a SyntaxError in the browser's console.
- The search: chapters found first by their key terms, snippets of prose
  (``tested_transformer_search``, beside this file).
- In the PDF, a table too tall to sit in what is left of a page is set as a
  ``longtable``, which breaks across pages (the ``tabulary`` that Sphinx uses
  otherwise cannot break, and leaves the rest of the page empty before it), with
  its columns as wide as their longest cell asks.
"""

from __future__ import annotations

import codecs
import math
from typing import Any

import latexcodec  # noqa: F401 (registers the "ulatex" codec)
from docutils import nodes
from pybtex.backends.plaintext import Backend as PlaintextBackend
from pybtex.plugin import register_plugin
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting.author_year_title import SortingStyle
from sphinx.transforms.post_transforms import SphinxPostTransform


def _plain(text: str) -> str:
    """BibTeX's LaTeX as Unicode text: ``Veli{\\v{c}}kovi{\\'c}`` -> ``Veličković``."""
    return codecs.decode(text, "ulatex").replace("{", "").replace("}", "")


def _last_names(entry) -> list[str]:
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    return [_plain(" ".join(p.prelast_names + p.last_names)) for p in people]


def author_year_label(entry) -> str:
    """The label as the text cites the work: "Clark et al., 2019", "Ba and Kiros,
    2016", "Vaswani, 2017"."""
    names = _last_names(entry)
    year = entry.fields.get("year", "n.d.")
    if not names:
        who = _plain(entry.fields.get("title", entry.key)).split(":")[0]
    elif len(names) == 1:
        who = names[0]
    elif len(names) == 2:
        who = f"{names[0]} and {names[1]}"
    else:
        who = f"{names[0]} et al."
    return f"{who}, {year}"


class AuthorYearLabelStyle(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        labels = [author_year_label(e) for e in sorted_entries]
        # Two works with the same label become "..., 2019a" and "..., 2019b".
        counts: dict[str, int] = {}
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
        seen: dict[str, int] = {}
        for label in labels:
            if counts[label] > 1:
                seen[label] = seen.get(label, 0) + 1
                yield label + "abcdefghijklmnopqrstuvwxyz"[seen[label] - 1]
            else:
                yield label


class AuthorYearStyle(UnsrtStyle):
    default_label_style = AuthorYearLabelStyle
    default_sorting_style = SortingStyle


register_plugin("pybtex.style.formatting", "authoryear", AuthorYearStyle)

# sphinxcontrib-bibtex asks pybtex for its plain-text backend at every
# citation (a tooltip), and pybtex looks for a plugin first among those
# registered at run time, then among the installed packages' entry points,
# reading all their metadata each time: about 20 ms, some 190 times a build.
# Registered here, the same class is found at once.
register_plugin("pybtex.backends", "plaintext", PlaintextBackend, force=True)


def _one_copy_of_each_inline_script(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        attributes = getattr(js, "attributes", {}) or {}
        body = attributes.get("body")
        # Registered once with the file name None and once with "": the same script.
        key = (str(getattr(js, "filename", "") or ""), body) if body else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        kept.append(js)
    scripts[:] = kept


# Characters of body text on a line of the PDF's text block, and the estimated
# height, in lines, from which a table is set as a longtable: a third of a page.
LINE_CHARACTERS = 110
LONG_TABLE_LINES = 18
NARROWEST_COLUMN = 0.12  # of the table's width


def table_layout(rows: list[list[str]]) -> tuple[list[float], float]:
    """Column widths (fractions of the table's width, each column as wide as its
    longest cell asks, none narrower than NARROWEST_COLUMN) and the table's
    estimated height in lines."""
    columns = max(len(row) for row in rows)
    longest = [
        max((len(row[i]) for row in rows if i < len(row)), default=1)
        for i in range(columns)
    ]
    widths = [max(n / max(1, sum(longest)), NARROWEST_COLUMN) for n in longest]
    widths = [w / sum(widths) for w in widths]
    height = 0.0
    for row in rows:
        room = [max(1.0, widths[i] * LINE_CHARACTERS - 2) for i in range(len(row))]
        lines = [math.ceil(len(text) / room[i]) for i, text in enumerate(row)]
        height += max(lines, default=0) + 0.3
    return widths, height


class BreakableTables(SphinxPostTransform):
    """Tall tables of the LaTeX output as longtables with given column widths."""

    default_priority = 400
    builders = ("latex",)

    def run(self, **kwargs: Any) -> None:
        for table in self.document.findall(nodes.table):
            tgroups = [n for n in table.children if isinstance(n, nodes.tgroup)]
            if len(tgroups) != 1 or "longtable" in table["classes"]:
                continue
            rows = [
                [entry.astext() for entry in row.findall(nodes.entry)]
                for row in tgroups[0].findall(nodes.row)
            ]
            colspecs = [n for n in tgroups[0].children if isinstance(n, nodes.colspec)]
            if not rows or len(colspecs) != max(len(row) for row in rows):
                continue
            widths, height = table_layout(rows)
            if height < LONG_TABLE_LINES:
                continue
            for colspec, width in zip(colspecs, widths, strict=True):
                colspec["colwidth"] = max(1, round(100 * width))
            table["classes"] += ["longtable", "colwidths-given"]


def setup(app) -> dict[str, Any]:
    app.setup_extension("tested_transformer_search")
    app.add_post_transform(BreakableTables)
    # Late (priority 900), after the extensions that add scripts to the page context.
    app.connect("html-page-context", _one_copy_of_each_inline_script, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
