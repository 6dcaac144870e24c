"""Retrieval tasks (docs/models.md#retrieval-tasks): the task files kvq-gen --task
writes and kvq-eval --tasks reads, generated and read by libkvq itself, so a
Python pipeline gets exactly the tasks and the checks the tools use.

    tasks = kvq.tasks("kv", 100, 256, seed=1)      # [{"id", "task", "depth", "context", "question", "answer"}]
    kvq.write_tasks("kv.jsonl", tasks)             # for kvq-eval MODEL --tasks kv.jsonl
    tasks = kvq.read_tasks("mine.jsonl")           # checked as kvq-eval checks them
    rows, columns, meta = kvq.read_output("recall.csv")   # kvq-eval --tasks's rows
"""
import ctypes
import json
import os

from . import _lib
from ._lib import UsageError

KINDS = ("needle", "multikey", "kv", "mqar")


def _lines_to_dicts(L, arr, n, kind):
    out = []
    for i in range(n):
        p = L.kvq_task_json(ctypes.byref(arr[i]), kind)
        if not p:
            raise _lib.Error("out of memory writing a task", "nomem")
        try:
            out.append(json.loads(ctypes.string_at(p).decode("utf-8", "replace")))
        finally:
            L.kvq_free(p)
    return out


def tasks(kind, count, context_tokens, *, seed=0):
    """count seeded tasks of kind (needle, multikey, kv, mqar), each context as many
    sentences or pairs as fit in context_tokens tokens (counted one per word, digit and
    punctuation mark: exactly data/kvq-retrieval.gguf's tokens), depths evenly over 0..1
    — what `kvq-gen --task KIND --count N --context-tokens L --seed S` writes."""
    if kind not in KINDS:
        raise UsageError(f"task kind {kind!r}: expected one of {', '.join(KINDS)}", "usage")
    for v, what in ((count, "count"), (context_tokens, "context_tokens")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"{what} {v!r}: expected a positive integer", "usage")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
        raise UsageError(f"seed {seed!r}: expected an integer 0..2^64-1", "usage")
    L, err = _lib.lib(), _lib.new_error()
    out = ctypes.POINTER(_lib.Task)()
    _lib.check(L.kvq_tasks_generate(KINDS.index(kind), count, context_tokens, seed, None, None, ctypes.byref(out),
                                    ctypes.byref(err)), err)
    try:
        return _lines_to_dicts(L, out, count, kind.encode())
    finally:
        L.kvq_tasks_free(out, count)


def read_tasks(path):
    """The tasks of a JSON-lines file as kvq-eval --tasks reads them: dicts with
    context, question, answer, and id and depth (None when absent); a bad line
    raises kvq.FormatError naming the file and the line."""
    with open(os.fspath(path), "rb") as f:
        data = f.read()
    L, err = _lib.lib(), _lib.new_error()
    out, n = ctypes.POINTER(_lib.Task)(), ctypes.c_size_t()
    _lib.check(L.kvq_tasks_parse(os.fsencode(path), data, len(data), ctypes.byref(out), ctypes.byref(n),
                                 ctypes.byref(err)), err)
    try:
        rows = _lines_to_dicts(L, out, n.value, None)
    finally:
        L.kvq_tasks_free(out, n.value)
    for r in rows:
        r.setdefault("id", None)
        r.setdefault("depth", None)
    return rows


def write_tasks(path, tasks):
    """Writes tasks (dicts with context, question, answer; optional id, depth, task) as
    JSON lines, atomically (a temporary renamed into place)."""
    lines = []
    for i, t in enumerate(tasks):
        for k in ("context", "question", "answer"):
            if not isinstance(t.get(k), str):
                raise UsageError(f"task {i}: {k!r}: expected a string", "usage")
        lines.append(json.dumps({k: t[k] for k in ("id", "task", "depth", "context", "question", "answer")
                                 if t.get(k) is not None}, ensure_ascii=False))
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
