"""check_lengths.py — the house's size limits (issue #50): no function in
tools/ over 60 lines and no parse_options over 30 (a tool's options are
rows, tools/optrows.c), no function in lib/ over 100 lines but the GGUF
parser's, and lib/internal.h only the base room's (at most 120 lines: each
room keeps its own internal header).  A function is counted from the line
holding its name to its closing brace, the lines between included.
    check_lengths.py SOURCE_ROOT"""
import glob
import os
import re
import sys

LIMITS = [("tools/*.c", 60), ("lib/**/*.c", 100)]
EXEMPT = {"kvq_gguf_parse"}  # GGUF's container, key by key (lib/model/gguf.c)
OPTIONS_LIMIT, INTERNAL_H_LIMIT = 30, 120
SIG = re.compile(r"^[A-Za-z_][^;=]*\)\s*$|^[A-Za-z_][^;=]*\)\s*\{\s*$")


def functions(path):
    """(name, first line, lines) of each top-level function: a signature at
    column 0, its body from a '{' to the first '}' at column 0."""
    lines = open(path, encoding="utf-8", errors="replace").read().split("\n")
    i = 0
    while i < len(lines):
        opens = lines[i] == "{" or (lines[i].endswith("{") and SIG.match(lines[i]))
        if opens and not lines[i].startswith(("struct", "enum", "typedef", "static const", "const", "union")):
            k = i if lines[i] != "{" else i - 1
            while k > 0 and "(" not in lines[k]:
                k -= 1
            m = re.search(r"(\w+)\s*\(", lines[k])
            e = i + 1
            while e < len(lines) and lines[e] != "}":
                e += 1
            yield (m.group(1) if m else "?"), k + 1, e - k + 1
            i = e
        i += 1


def main(root):
    bad = []
    for pattern, limit in LIMITS:
        files = sorted(glob.glob(os.path.join(root, pattern), recursive=True))
        assert files, pattern
        for f in files:
            rel = os.path.relpath(f, root)
            for name, line, n in functions(f):
                cap = OPTIONS_LIMIT if name == "parse_options" else limit
                if n > cap and name not in EXEMPT:
                    bad.append(f"{rel}:{line}: {name} is {n} lines (at most {cap})")
    n = len(open(os.path.join(root, "lib", "internal.h")).read().split("\n"))
    if n > INTERNAL_H_LIMIT:
        bad.append(f"lib/internal.h is {n} lines (at most {INTERNAL_H_LIMIT}: the base room's alone)")
    for b in bad:
        print(b)
    print(f"check_lengths: {len(bad)} over the limits")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
