"""kvqtest.py — what the Python test scripts (test_python.py, test_meta.py,
test_kvq_dump_py.py) share: check() and its tally, running a built tool,
and the closing line and exit status.  The scripts run as
`python3 tests/test_X.py BUILD SOURCE`, so this directory is on sys.path."""
import os
import subprocess
import sys

_tally = {"passed": 0, "failed": 0}


def check(ok, what):
    """One assertion: counted, and a FAIL line naming `what` when it does not hold."""
    if ok:
        _tally["passed"] += 1
    else:
        _tally["failed"] += 1
        print("FAIL:", what)


def run_tool(build, tool, *args, cwd=None):
    """BUILD/tools/TOOL ARGS..., its output captured as text."""
    return subprocess.run([os.path.join(build, "tools", tool), *args], cwd=cwd, capture_output=True, text=True)


def finish(name):
    """Prints NAME: P passed, F failed and exits 1 if anything failed."""
    print(f"{name}: {_tally['passed']} passed, {_tally['failed']} failed")
    sys.exit(1 if _tally["failed"] else 0)
