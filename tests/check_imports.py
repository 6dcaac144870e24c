"""check_imports.py — libkvq's import graph, read from its object files
(`nm`: which file defines each symbol another file uses): no cycle between
files, and every room (lib/<room>/) uses only the rooms before it in
ORDER, as the README's layout says; with a second OBJDIR, the tools' shared
files (libkvqcli) likewise: each uses only those before it in TOOLS_ORDER
(tools/cli.h).  With the source root, the same order also holds for the
headers: a file of a room includes only the internal headers of its own
room and of the rooms before it (lib/internal.h is base's; the public
kvq*.h at the top are everyone's), so no coupling hides in a header.
    check_imports.py LIB_OBJDIR [TOOLS_OBJDIR [SOURCE_ROOT]]"""
import collections
import glob
import os
import re
import subprocess
import sys

ORDER = ["base", "math", "metrics", "formats", "io", "quant", "analysis", "model"]
TOOLS_ORDER = ["out.c.o", "hash.c.o", "meta.c.o", "cli.c.o", "optrows.c.o", "eval_shard.c.o", "eval_tasks.c.o"]


def graph(objdir):
    defs, uses = {}, collections.defaultdict(set)
    for o in glob.glob(os.path.join(objdir, "*.o")):
        name = os.path.basename(o)
        out = subprocess.run(["nm", o], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            p = line.split()
            if len(p) == 3 and p[1] in "TDRB":
                defs[p[2]] = name
            elif len(p) == 2 and p[0] == "U":
                uses[name].add(p[1])
    edges = collections.defaultdict(dict)  # file -> {file it uses: a symbol}
    for o, syms in uses.items():
        for s in sorted(syms):
            if s in defs and defs[s] != o:
                edges[o].setdefault(defs[s], s)
    return edges


def cycles(edges):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def include_problems(src):
    """Each `#include "..."` of lib/<room>/ against ORDER; the number of includes read."""
    lib, bad, n = os.path.join(src, "lib"), [], 0
    for f in sorted(glob.glob(os.path.join(lib, "*", "*.[ch]"))):
        room = os.path.basename(os.path.dirname(f))
        for inc in re.findall(r'^#include "([^"]+)"', open(f, encoding="utf-8").read(), flags=re.M):
            target = os.path.normpath(os.path.join(os.path.dirname(f), inc))
            if not os.path.exists(target):
                target = os.path.normpath(os.path.join(lib, inc))
            if not os.path.exists(target):
                continue  # generated (kvq_config.h) or the CUDA module's (kernels/)
            n += 1
            rel = os.path.relpath(target, lib)
            to = rel.split(os.sep)[0] if os.sep in rel else ("base" if rel == "internal.h" else None)
            if to is None or to == room:
                continue
            if room not in ORDER or to not in ORDER:
                bad.append(f"{os.path.relpath(f, lib)} includes {rel}: a room outside {ORDER}")
            elif ORDER.index(to) > ORDER.index(room):
                bad.append(f"{os.path.relpath(f, lib)} includes {rel}: {room}/ may include only "
                           f"{', '.join(ORDER[:ORDER.index(room) + 1])}")
    return bad, n


def main(objdir, tools_objdir=None, src=None):
    edges = graph(objdir)
    if not edges:
        print(f"check_imports: error: {objdir}: no object files")
        return 1
    bad = [f"files in a cycle: {' '.join(c)}" for c in cycles(edges)]
    room = lambda o: o.split("_")[0]  # meson names lib/<room>/x.c's object <room>_x.c.o
    for a, used in sorted(edges.items()):
        for b, sym in sorted(used.items()):
            ra, rb = room(a), room(b)
            if ra == rb:
                continue
            if ra not in ORDER or rb not in ORDER:
                bad.append(f"{a} -> {b}: a room outside {ORDER}")
            elif ORDER.index(rb) > ORDER.index(ra):
                bad.append(f"{a} uses {sym} from {b}: {ra}/ may use only {', '.join(ORDER[:ORDER.index(ra)])}")
    nfiles = len(edges)
    if tools_objdir:
        tedges = graph(tools_objdir)
        bad += [f"tools files in a cycle: {' '.join(c)}" for c in cycles(tedges)]
        for a, used in sorted(tedges.items()):
            for b, sym in sorted(used.items()):
                if a not in TOOLS_ORDER or b not in TOOLS_ORDER:
                    bad.append(f"tools: {a} -> {b}: a file outside {TOOLS_ORDER}")
                elif TOOLS_ORDER.index(b) > TOOLS_ORDER.index(a):
                    bad.append(f"tools: {a} uses {sym} from {b}, which comes after it in {TOOLS_ORDER}")
        nfiles += len(tedges)
    if src:
        ibad, nincludes = include_problems(src)
        assert nincludes > 50, nincludes
        bad += ibad
    for b in bad:
        print("check_imports:", b)
    print(f"check_imports: {nfiles} files, {'no' if not bad else len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
