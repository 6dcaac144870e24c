#!/usr/bin/env python3
"""check_docs.py — every relative link in README.md and docs/*.md reaches a file
of the repository, and every #anchor a heading of that file (GitHub's slugs);
the maps are true to the tree: docs/layout.md's row of each lib/ room names
exactly the files in it, and every source file in lib/ is built (listed in
lib/meson.build or, for a family, in lib/quant/families.def).

Usage: check_docs.py SOURCE_ROOT.  Exit 1 with one line per broken link."""
import os
import re
import sys

LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped,
    spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r'[^\w\- ]', '', s)
    return s.replace(' ', '-')


def anchors(path):
    out, fence = set(), False
    with open(path, encoding='utf-8') as f:
        for line in f:
            if line.startswith('```'):
                fence = not fence
            elif not fence and line.startswith('#'):
                out.add(slug(line.lstrip('#')))
    return out


SOURCE = re.compile(r'`([\w.\-]+\.(?:c|h|def|in))`')


def check_layout(root):
    """docs/layout.md: the row of `lib/ROOM/` names every file of that room (the
    families' files aside: lib/quant/families.def lists them), and no other."""
    bad, seen = [], set()
    for line in open(os.path.join(root, 'docs', 'layout.md'), encoding='utf-8'):
        m = re.match(r'\| `lib/(\w+)/` \|(.*)\|\s*$', line)
        if not m:
            continue
        room, named = m.group(1), set(SOURCE.findall(m.group(2)))
        seen.add(room)
        here = {n for n in os.listdir(os.path.join(root, 'lib', room)) if SOURCE.fullmatch('`' + n + '`')}
        if room == 'quant':  # the families' files: families.def is their list (naming them is optional)
            named -= set(family_files(root))
            here -= set(family_files(root))
        bad += [f'docs/layout.md: lib/{room}/ row names {n}, which is not in lib/{room}/' for n in sorted(named - here)]
        bad += [f'docs/layout.md: lib/{room}/{n} is not in its row' for n in sorted(here - named)]
    rooms = {n for n in os.listdir(os.path.join(root, 'lib')) if os.path.isdir(os.path.join(root, 'lib', n))}
    bad += [f'docs/layout.md: no row for lib/{r}/' for r in sorted(rooms - seen)]
    return bad


def family_files(root):
    table = open(os.path.join(root, 'lib', 'quant', 'families.def'), encoding='utf-8').read()
    return re.findall(r'^KVQ_FAMILY\(\w+, "([\w.]+\.c)"\)', table, flags=re.M)


def check_sources(root):
    """Every .c file in lib/ is built: named in lib/meson.build or in the families' table."""
    text = open(os.path.join(root, 'lib', 'meson.build'), encoding='utf-8').read()
    listed = set(re.findall(r"'(\w+/[\w.]+\.c)'", text))
    listed |= {'quant/' + f for f in family_files(root)}
    bad = []
    for room in sorted(os.listdir(os.path.join(root, 'lib'))):
        d = os.path.join(root, 'lib', room)
        if os.path.isdir(d):
            bad += [f'lib/{room}/{n}: not built (not in lib/meson.build nor lib/quant/families.def)'
                    for n in sorted(os.listdir(d)) if n.endswith('.c') and f'{room}/{n}' not in listed]
    return bad


def table_rows_in_doc(root, table, row, doc, mention, what):
    """Every row of a lib/ table (its first field by the regex `row`) is mentioned in a docs page (the
    regex `mention` with {name} filled in), else one line per missing row."""
    names = re.findall(row, open(os.path.join(root, 'lib', table), encoding='utf-8').read(), flags=re.M)
    text = open(os.path.join(root, 'docs', doc), encoding='utf-8').read()
    bad = [] if names else [f'lib/{table}: no rows']
    return bad + [f'docs/{doc}: no {what} {n} (lib/{table})' for n in names
                  if not re.search(mention.format(name=re.escape(n)), text, flags=re.M)]


def check_archs(root):
    """Every architecture of lib/kvq_archs.def has its row in docs/models.md's Models table."""
    return table_rows_in_doc(root, 'kvq_archs.def', r'^KVQ_ARCH\(\w+, "([\w.-]+)"', 'models.md', r'^\| `{name}` \|',
                             'row for the architecture')


def check_metrics(root):
    """Every metric column of lib/kvq_metric_cols.def is described in docs/metrics.md."""
    return table_rows_in_doc(root, 'kvq_metric_cols.def', r'^KVQ_METRIC\((\w+),', 'metrics.md', r'`{name}`',
                             'description of the column')


def main():
    root = sys.argv[1]
    pages = [os.path.join(root, 'README.md')]
    docs = os.path.join(root, 'docs')
    pages += sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith('.md'))
    bad = []
    for page in pages:
        text = open(page, encoding='utf-8').read()
        text = re.sub(r'```.*?```', '', text, flags=re.S)
        for target in LINK.findall(text):
            if re.match(r'[a-z]+:', target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition('#')
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            where = os.path.relpath(page, root)
            if not os.path.exists(dest):
                bad.append(f'{where}: link to {target}: no such file')
            elif not os.path.realpath(dest).startswith(os.path.realpath(root) + os.sep):
                bad.append(f'{where}: link to {target}: outside the repository')
            elif anchor and dest.endswith('.md') and anchor not in anchors(dest):
                bad.append(f'{where}: link to {target}: no heading with that anchor')
    bad += check_layout(root) + check_sources(root) + check_archs(root) + check_metrics(root)
    for b in bad:
        print('check_docs: ' + b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
