#!/usr/bin/env python3
"""check_option_record.py — a tool's option rows reach its provenance record.

Every row of tools/kvq-TOOL.c's `rows[]` that is recorded (a `.record =`, or a
macro of the file that stands for one) must appear under "options" in at least
one of the given OUT.meta.json files (the union of their last runs: a row
recorded only by a shard, a --merge or a --tasks run shows in that run's
record).  A row without a record flag must not appear there under its name,
unless a group of cli.h records that key (--threads, --layers, ...).
    check_option_record.py TOOL_SOURCE META.json...
"""
import json
import re
import sys

GROUP_KEYS = {"text", "tokens", "tokenizer", "max-tokens", "threads", "layers", "heads", "queries", "per", "seed",
              "device", "meta", "no-hash"}


def rows_of(src):
    """(name, recorded) of each row of the file's rows[] table."""
    table = src[src.index("static const cli_optrow rows[]"):]
    table = table[:table.index("\n};")]
    macros = [m.group(1) for m in re.finditer(r"#define (\w+)\s+\.record\s*=", src)]
    starts = [m for m in re.finditer(r'(?:ROW\(|\.name = )"([\w-]+)"', table)]
    out = []
    for i, m in enumerate(starts):
        text = table[m.start():starts[i + 1].start() if i + 1 < len(starts) else len(table)]
        recorded = ".record =" in text or any(re.search(rf"\b{k}\b", text) for k in macros)
        out.append((m.group(1), recorded))
    return out


def main(src_path, metas):
    rows = rows_of(open(src_path).read())
    seen = set()
    for path in metas:
        seen |= set(json.load(open(path))["runs"][-1].get("options", {}))
    recorded = [n for n, r in rows if r]
    missing = [n for n in recorded if n not in seen]
    stray = [n for n, r in rows if not r and n in seen and n not in GROUP_KEYS]
    ok = len(rows) >= 2 and recorded and not missing and not stray
    print(f"check_option_record: {src_path}: {len(rows)} rows, {len(recorded)} recorded"
          + (f"; not in any record: {missing}" if missing else "")
          + (f"; recorded without a row flag: {stray}" if stray else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: check_option_record.py TOOL_SOURCE META.json...")
    sys.exit(main(sys.argv[1], sys.argv[2:]))
