"""torchrun ranks of a *script* forked from a warm process (tests/warm_workers.py runs modules).

torch's launcher starts a script's ranks as ``$PYTHON_EXEC -u SCRIPT ARGS``; with PYTHON_EXEC
``tests.warm_workers.python_wrapper(folder, "-m", "tests.warm_script")``, ``-m tests.warm_script
SCRIPT ARGS`` goes to the zygote named by VM_WARM_SOCKET; the forked rank then runs SCRIPT as
``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` sets them. What the ranks do is the test's subject, not
how a fresh interpreter imports torch and megatron (~8 CPU s a rank).
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` has it
    runpy.run_path(script, run_name="__main__")
