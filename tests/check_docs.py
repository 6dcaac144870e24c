#!/usr/bin/env python3
"""check_docs.py — every relative link in README.md and docs/*.md reaches a file
of the repository, and every #anchor a heading of that file (GitHub's slugs).

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
    for b in bad:
        print('check_docs: ' + b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
