"""kvq_dump.py — the kvq-dump/1 writer, kept at its old path for scripts
that do `sys.path.insert(0, "tools"); from kvq_dump import write_dump`.
The code is the kvq package's (python/kvq/dump.py; docs/dump-format.md)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from kvq.dump import DumpError, write_dump  # noqa: E402,F401

__all__ = ["write_dump", "DumpError"]
