#!/bin/bash
# check_commits.sh — the history keeps its habits: every commit after the
# one the habit was set at (004fc69, issue #37) has a subject of at most 72
# characters, a blank line, then a body that says why.  Merges are exempt.
# Skips (exit 77) outside a git checkout or where the history is too shallow
# to hold that commit.
#   tests/check_commits.sh [SOURCE_ROOT]
set -u
src=${1:-$(cd "$(dirname "$0")/.." && pwd)}
since=004fc69af57df07d359022a4b2a81fc5c800647f
if ! git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
    echo "SKIP: $src is not a git checkout"
    exit 77
fi
if ! git -C "$src" cat-file -e "$since^{commit}" 2>/dev/null; then
    echo "SKIP: the history does not hold $since (a shallow clone)"
    exit 77
fi
bad=0 n=0
while IFS= read -r c; do
    n=$((n + 1))
    subject=$(git -C "$src" log -1 --format=%s "$c")
    second=$(git -C "$src" log -1 --format=%B "$c" | sed -n 2p)
    body=$(git -C "$src" log -1 --format=%b "$c" | tr -d '[:space:]')
    if [ ${#subject} -gt 72 ]; then
        echo "check_commits: ${c:0:10}: subject of ${#subject} characters (at most 72): $subject"
        bad=$((bad + 1))
    fi
    if [ -n "$second" ] || [ -z "$body" ]; then
        echo "check_commits: ${c:0:10}: expected a blank line and a body after the subject: $subject"
        bad=$((bad + 1))
    fi
done < <(git -C "$src" rev-list --no-merges "$since..HEAD")
echo "check_commits: $n commits since ${since:0:7}, $bad problems"
[ $bad -eq 0 ]
