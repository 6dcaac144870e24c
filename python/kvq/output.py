"""output.py — reading what the kvq tools write: CSV or JSON lines, the
provenance record in its first JSON line (`--meta inline`) or beside it in
OUT.meta.json (docs/tools.md#provenance).  Plain Python (csv, json): no
numpy and no libkvq, so that the figure scripts' kvqplot reads through it too.

    rows, columns, meta = kvq.read_output("sweep.csv")   # cells as the file has them
    rows = kvq.parse_rows(text)                          # kvq-analyze's rows, typed
"""
import csv
import io
import json

from ._lib import Error

__all__ = ["read_output", "read_meta", "parse_output", "parse_rows"]


def parse_output(text, name="kvq output"):
    """The rows, column names and inline provenance record (or None) of a
    kvq tool's output given as text: JSON lines (cells as JSON values; a
    first line holding "kvq_meta" is the record) or CSV (cells as strings).
    FormatError naming `name` and the line for a line that is not a JSON
    object or CSV the csv module refuses."""
    meta = None
    if text.lstrip().startswith("{"):
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise Error(f"{name}: line {i}: not JSON ({e.msg})", "format") from None
            except RecursionError:  # json's decoder recurses once per nesting level
                raise Error(f"{name}: line {i}: JSON nested too deeply", "format") from None
            if not isinstance(row, dict):
                raise Error(f"{name}: line {i}: expected a JSON object", "format")
            if not rows and meta is None and "kvq_meta" in row:  # --meta inline: the provenance record
                meta = row
                continue
            rows.append(row)
        return rows, list(rows[0].keys()) if rows else [], meta
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        rows = list(reader)
    except csv.Error as e:
        raise Error(f"{name}: malformed CSV: {e}", "format") from None
    return rows, list(reader.fieldnames or []), None


def read_meta(path):
    """PATH.meta.json (the kvq tools' provenance record) as a dict, or None
    where there is none (or it is not one)."""
    try:
        with open(path + ".meta.json", encoding="utf-8") as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) and meta.get("kvq_meta") == 1 and meta.get("runs") else None
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply to be a record
        return None


def read_output(path):
    """parse_output of the file at path, with the record from its first line
    or else from PATH.meta.json: (rows, columns, meta).  FileError when it
    cannot be read, FormatError when it is not kvq output."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise Error(f"{path}: cannot read: {e}", "io" if isinstance(e, OSError) else "format") from None
    rows, cols, meta = parse_output(text, path)
    return rows, cols, meta or read_meta(path)


_TEXT_COLUMNS = ("dump", "quantizer", "spec")


def _cell(col, s):
    if col in _TEXT_COLUMNS:
        return s
    if col in ("layer", "head"):
        return s if s == "all" else int(s)
    return None if s == "" else float(s)


def parse_rows(text):
    """kvq-analyze's output (CSV or JSON lines) as a list of dicts: text
    columns as str, layer and head as int or "all", numbers as float, empty
    cells as None (JSON lines: the values as written, the record line left out)."""
    name = "kvq-analyze output"
    rows, _, _ = parse_output(text, name)
    if text.lstrip().startswith("{"):
        return rows
    out = []
    for i, row in enumerate(rows, 2):  # line 1 is the header (rows of one line each)
        typed = {}
        for c, v in row.items():
            if c is None or v is None:  # more cells than columns, or fewer
                raise Error(f"{name}: line {i}: {'more' if c is None else 'fewer'} cells than the header's "
                            f"columns", "format")
            try:
                typed[c] = _cell(c, v)
            except ValueError:
                raise Error(f"{name}: line {i}: {c} '{v}': expected "
                            f"{'an integer or all' if c in ('layer', 'head') else 'a number'}", "format") from None
        out.append(typed)
    return out
