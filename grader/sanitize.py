"""Text from outside the grader made safe for the grader's outputs (the grader's side).

Every string that comes from a child, a notebook or the file system (a student's folder name,
a hint built from a student's exception, a cell's error, a note, a flag, a written answer, the
reason a notebook was not placed) passes through one of these functions before it reaches
grades.csv, a feedback file, a written-answers report or the summary printed on the terminal:

* `line`: one line of plain text. Always encodable as UTF-8 (a lone surrogate, as a folder
  name that is not UTF-8 gives, is shown as ``\\xff``, any other as ``\\ud800``), and every
  control character shown as an escape (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``, the
  bidirectional overrides and isolates ``\\u202e``, ``\\u2066``, ...), so that nothing can start
  a new line, move the cursor, hide text or reverse its order;
* `markdown_line`: `line`, then Markdown neutralised for a heading, a list item or a table cell:
  raw HTML and character references escaped, no image, link or autolink, no block construct at
  its start, ``|`` escaped;
* `markdown_block`: several lines (for a block quote) with the same rules on every line;
* `csv_cell`: `line`, then a spreadsheet formula neutralised (OWASP's CSV-injection rule: a cell
  that starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return gets a leading
  apostrophe), a number left a number;
* `file_name`: a name that can be a folder in the output on any file system, unique per input.

None of them raises on any ``str``; each returns text that encodes as strict UTF-8.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

__all__ = ["line", "markdown_line", "markdown_block", "csv_cell", "file_name"]

# Format characters (Unicode category Cf) that are kept: the joiners that some scripts and
# emoji need. Every other one (bidirectional controls, zero-width spaces, soft hyphens, tags)
# is shown as an escape.
_KEPT_FORMAT = {"\u200c", "\u200d"}
_FOLD = re.compile(r"[\t\n\r]+")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\uff1d", "\uff0b", "\uff0d", "\uff20")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_SCHEME = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*):(?=//)")
_WWW = re.compile(r"(?i)\bwww\.")
_BLOCK_START = re.compile(r"^( {0,3})([#>=+*_`~|:!\-]|\d+[.)])")
_INLINE = {"\\": "\\\\", "&": "&amp;", "<": "&lt;", ">": "&gt;", "[": "\\[", "]": "\\]",
           "|": "\\|"}
_NAME_PUNCTUATION = set(" ._+,=@()-")
_RESERVED = re.compile(r"(?i)^(con|prn|aux|nul|com\d|lpt\d)(\..*)?$")
NAME_BYTES = 100  # a safe name's length in UTF-8 bytes, well under every file system's 255


def _escape(char: str) -> str:
    code = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as os.fsdecode keeps it
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _hidden(char: str, keep: str) -> bool:
    """Whether ``char`` must be shown as an escape: a control, format (but the joiners),
    surrogate, private-use or unassigned character, or a line or paragraph separator."""
    if char in keep:
        return False
    if " " <= char <= "~":
        return False
    category = unicodedata.category(char)
    if category == "Cf":
        return char not in _KEPT_FORMAT
    return category in ("Cc", "Cs", "Co", "Cn", "Zl", "Zp")


def _visible(text: object, keep: str = "") -> str:
    if not isinstance(text, str):
        text = str(text)
    return "".join(_escape(c) if _hidden(c, keep) else c for c in text)


def line(text: object, fold: bool = False) -> str:
    """``text`` on one line of plain text, every control or invisible character shown as an
    escape (``"a\\nb\\udcff"`` -> ``"a\\\\nb\\\\xff"``); always encodable as UTF-8.
    Its result is printable, so that ``line(line(t)) == line(t)``: a layer that shows a name
    (`grader.submissions.shown`) and the output that shows it again agree.

    ``fold`` (for the grader's own prose, which may hold a student's text: a hint, a note, a
    cell's error) first turns each run of tabs, newlines and carriage returns into one space;
    every other control character is still shown as an escape."""
    if fold:
        text = _FOLD.sub(" ", text if isinstance(text, str) else str(text))
    return _visible(text)


def _inline(text: str) -> str:
    """Markdown's inline constructs made inert in ``text`` (already on one line)."""
    out = "".join(_INLINE.get(c, c) for c in text)
    out = _SCHEME.sub(r"\1\\[:\\]", out)  # "https://x" -> "https\[:\]//x": no autolink
    return _WWW.sub("www\\[.\\]", out)


def _no_block_start(text: str) -> str:
    """A backslash before a character that would start a heading, a quote, a list, a thematic
    break, a setext underline, a fence or a table at the start of a line."""
    match = _BLOCK_START.match(text)
    if not match:
        return text
    indent, mark = match.group(1), match.group(2)
    if mark[0].isdigit():  # "1." -> "1\."
        return indent + mark[:-1] + "\\" + mark[-1] + text[match.end():]
    return indent + "\\" + text[len(indent):]


def markdown_line(text: object, fold: bool = False) -> str:
    """`line`, then safe where Markdown renders it on one line (a heading, a list item, a table
    cell): raw HTML, character references, images, links and autolinks shown as text, ``|``
    escaped, and nothing at its start that opens a block."""
    return _no_block_start(_inline(line(text, fold)))


def markdown_block(text: object) -> str:
    """Several lines of ``text`` safe in Markdown, each as `markdown_line` (tabs kept): ``\\r\\n``
    and ``\\r`` become line ends, so that every line the reader sees passes the same rules."""
    if not isinstance(text, str):
        text = str(text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(_no_block_start(_inline(_visible(part, keep="\t")))
                     for part in text.split("\n"))


def csv_cell(text: object, fold: bool = False) -> str:
    """`line`, then safe as a spreadsheet's cell: text starting with ``=``, ``+``, ``-``, ``@``
    (or their full-width forms), a tab or a carriage return gets a leading apostrophe, so that
    no spreadsheet reads it as a formula; a number (``"-1.5"``, ``"2e3"``) is left as it is."""
    text = line(text, fold)
    if text.startswith(_FORMULA_START) and not _NUMBER.fullmatch(text):
        return "'" + text
    stripped = text.lstrip()
    if stripped != text and stripped.startswith(_FORMULA_START) and not _NUMBER.fullmatch(
            stripped):
        return "'" + text
    return text


def _name_char(char: str) -> bool:
    """A letter or digit of any script (with its combining marks), or ``._+,=@()-`` and a
    space."""
    return char in _NAME_PUNCTUATION or (
        unicodedata.category(char)[0] in "LNM" and not _hidden(char, ""))


def _is_safe_name(name: str) -> bool:
    return (bool(name) and all(_name_char(c) for c in name)
            and not name.startswith((".", "-", " "))
            and not name.endswith((".", " ")) and not _RESERVED.match(name)
            and len(name.encode("utf-8")) <= NAME_BYTES)


def file_name(name: str) -> str:
    """A folder name for ``name`` that every file system accepts: ``name`` itself when it is
    made of letters and digits (of any script), ``._+,=@()-`` and spaces (none of ``.-`` or a
    space first, no ``.`` or space last, not a device name of Windows, at most `NAME_BYTES`
    bytes); otherwise its safe characters with
    ``_`` for the others, cut, then ``-`` and 10 hex digits of the hash of its bytes, so that two
    different names never share a folder (``"a\\nb"`` -> ``"a_b-1f3a..."``)."""
    if _is_safe_name(name):
        return name
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(raw).hexdigest()[:10]
    stem = re.sub("_+", "_", "".join(c if _name_char(c) else "_" for c in name))
    stem = stem.strip("._ -")[:60].rstrip("._ -")
    return f"{stem or 'student'}-{digest}"
