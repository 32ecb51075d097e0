"""The code sandbox's own root: model-written code sees the interpreter and its libraries,
read-only, and its private working directory; not the host's /etc, home directory, the
project, nor any process outside (issue 30)."""

import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

from verl_megatron.reward import sandbox
from verl_megatron.reward.scorers import code_exec as ce

REPO = Path(__file__).resolve().parents[1]
HOME = os.path.expanduser("~")

PROBE = textwrap.dedent(
    """
    import errno, json, os, sys
    def read(path):
        try:
            with open(path, "rb") as f:
                return "read %d bytes" % len(f.read())
        except OSError as err:
            return type(err).__name__
    def write(path):
        try:
            with open(path, "w") as f:
                f.write("x")
            return "written"
        except OSError as err:
            return errno.errorcode[err.errno]
    def listing(path):
        try:
            return sorted(os.listdir(path))
        except OSError as err:
            return type(err).__name__
    paths = json.loads(sys.stdin.read())
    print(json.dumps({
        "read": {p: read(p) for p in paths["read"]},
        "list": {p: listing(p) for p in paths["list"]},
        "write": {p: write(p) for p in paths["write"]},
        "exists": {p: os.path.lexists(p) for p in paths["exists"]},
        "pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
        "cmdline": open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode(),
    }))
    """
)


def _visible_names(parent: str) -> list[str]:
    """Names directly under ``parent`` that the sandbox's root must hold: the first step
    below it of every bound path or symlink (the interpreter's way through it)."""
    binds, links = sandbox.root_entries([*sandbox.interpreter_paths(), sys.executable])
    prefix = parent.rstrip("/") + "/"
    return sorted({p[len(prefix) :].split("/")[0] for p in [*binds, *links] if p.startswith(prefix)})


def _probe(read, listing, exists, write=()):
    paths = json.dumps({"read": read, "list": listing, "exists": exists, "write": list(write)}).encode()
    run = sandbox.run_sandboxed([sys.executable, "-I", "-S", "-c", PROBE], paths, isolation="namespaces")
    assert run.cause == sandbox.EXITED and run.returncode == 0, run
    return json.loads(run.stdout)


def test_model_code_sees_no_host_file_home_project_or_process():
    secret_files = ["/etc/passwd", str(REPO / "pyproject.toml"), __file__]
    assert all(os.path.isfile(path) for path in secret_files)  # here, outside, they are readable
    home_entries = sorted(set(os.listdir(HOME)) - set(_visible_names(HOME)))
    outside_pid = os.getpid()
    seen = _probe(
        read=secret_files + [f"{HOME}/{name}" for name in home_entries],
        listing=["/", "/etc", HOME, str(REPO)],
        exists=[f"/proc/{outside_pid}", f"/proc/{outside_pid}/environ", str(REPO / "verl_megatron")],
        write=["/x", "/tmp/x", "/usr/x", f"{sys.prefix}/x", f"{sys.base_prefix}/x"],
    )
    assert set(seen["write"].values()) == {"EROFS"}, seen["write"]  # the whole tree is read-only
    assert set(seen["read"].values()) == {"FileNotFoundError"}, seen["read"]
    # the loader's index, nothing else of /etc
    assert seen["list"]["/etc"] == (
        ["ld.so.cache"] if os.path.exists("/etc/ld.so.cache") else "FileNotFoundError"
    )
    # only the way to the interpreter (here /root/.pyenv, /work/main/.venv), or nothing at all
    assert seen["list"][HOME] == (_visible_names(HOME) or "FileNotFoundError")
    assert seen["list"][str(REPO)] == (_visible_names(str(REPO)) or "FileNotFoundError")
    # the top level: the mount points the sandbox makes and the way to the interpreter
    assert seen["list"]["/"] == sorted({"dev", "proc", "tmp", *_visible_names("/")}), seen["list"]["/"]
    assert not any(seen["exists"].values()), seen["exists"]
    # pid 1 of its own namespace, its own /proc: the program itself and nothing else
    assert seen["pids"] == ["1"] and seen["cmdline"] == sys.executable, seen


ORDINARY = textwrap.dedent(
    """
    import bisect, bz2, collections, csv, ctypes, datetime, decimal, fractions, hashlib, heapq
    import io, itertools, json, lzma, math, os, random, re, sqlite3, statistics, string, struct
    import tempfile, threading, typing, unicodedata, zlib
    a, b = map(int, input().split())
    with tempfile.TemporaryFile() as f:  # a temporary file lands in the private working dir
        f.write(b"x" * 1000)
        f.seek(0)
        size = len(f.read())
    with open("notes.txt", "w") as f:
        f.write("kept")
    open("/dev/null", "w").write("gone")
    digest = hashlib.sha256(zlib.compress(b"abc")).hexdigest()[:8]
    con = sqlite3.connect(":memory:")
    total = con.execute("select ?+?", (a, b)).fetchone()[0]
    print(total, math.comb(a + b, a), size, open("notes.txt").read(), len(os.urandom(4)))
    print(fractions.Fraction(a, b), ctypes.sizeof(ctypes.c_int), digest)
    """
)


DIGEST = __import__("hashlib").sha256(__import__("zlib").compress(b"abc")).hexdigest()[:8]


def test_ordinary_programs_still_run():
    run = sandbox.run_sandboxed([sys.executable, "-I", "-c", ORDINARY], b"3 4\n", isolation="namespaces")
    assert run.cause == sandbox.EXITED and run.returncode == 0, run
    assert run.stdout.decode().split() == ["7", "35", "1000", "kept", "4", "3/4", "4", DIGEST], run


def test_scored_programs_import_stdlib_and_site_packages():
    add = json.dumps({"inputs": ["1 2\n", "30 12\n"], "outputs": ["3\n", "42\n"]})
    programs = [
        "import numpy as np\nprint(int(np.array(input().split(), dtype=np.int64).sum()))",
        "from collections import Counter\nimport re\nprint(sum(int(x) for x in re.findall(r'\\d+', input())))",
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
    ]
    responses = [f"```python\n{p}\n```" for p in programs]
    results = ce.compute_score_batch(responses, [add] * len(programs), ce.CodeSandboxConfig(max_workers=2))
    assert results == [{"score": 1.0}] * len(programs), results


def test_root_entries_follow_symlinks_and_bind_real_paths(tmp_path):
    (tmp_path / "real" / "lib").mkdir(parents=True)
    (tmp_path / "real" / "lib" / "python").write_text("")
    (tmp_path / "alias").symlink_to("real")  # relative, like /lib -> usr/lib
    (tmp_path / "real" / "bin").mkdir()
    (tmp_path / "real" / "bin" / "py").symlink_to(tmp_path / "real" / "lib" / "python")  # absolute
    binds, links = sandbox.root_entries([str(tmp_path / "alias" / "bin" / "py"), str(tmp_path / "missing")])
    real = str(tmp_path / "real")
    assert links == {str(tmp_path / "alias"): "real", f"{real}/bin/py": f"{real}/lib/python"}
    # the file the path ends at and each symlink's target, as real paths; the missing path left out
    assert sorted(binds) == [real, f"{real}/lib/python"]


def test_root_adds_little_to_a_run():
    """Interleaved runs with and without the namespaces (basic mode: no mounts at all), so the
    machine's load hits both alike; the root's mounts cost a few milliseconds against the
    interpreter's start, bounded here at 3x basic mode's median."""
    argv = [sys.executable, "-I", "-S", "-c", "import math\nprint(math.isqrt(int(input())))"]
    times = {sandbox.NAMESPACES: [], sandbox.BASIC: []}
    for _ in range(10):
        for mode, spent in times.items():
            start = time.perf_counter()
            run = sandbox.run_sandboxed(argv, b"49\n", isolation=mode)
            spent.append(time.perf_counter() - start)
            assert run.stdout == b"7\n", run
    ratio = statistics.median(times[sandbox.NAMESPACES]) / statistics.median(times[sandbox.BASIC])
    assert ratio < 3.0, (ratio, times)


def test_without_pivot_root_the_moved_root_hides_the_host_too(tmp_path, monkeypatch):
    """Where the kernel refuses pivot_root (a root that is not a mount point), the boot moves
    its root over / and chroots into it: the host's files stay out of sight just the same."""
    from verl_megatron.reward import sandbox_boot

    wrapper = tmp_path / "boot_without_pivot_root.py"
    wrapper.write_text(
        "import importlib.util, os\n"
        f"spec = importlib.util.spec_from_file_location('boot', {sandbox_boot.__file__!r})\n"
        "boot = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(boot)\n"
        "boot.SECCOMP_ARCHES.get(os.uname().machine, {}).pop('pivot_root', None)\n"
        "boot.main()\n"
    )
    monkeypatch.setattr(sandbox_boot, "__file__", str(wrapper))
    code = "import os\nprint(os.path.exists('/etc/passwd'), sorted(os.listdir('/etc')), os.listdir('/proc').count('1'))"
    run = sandbox.run_sandboxed([sys.executable, "-I", "-S", "-c", code], isolation="namespaces")
    assert run.cause == sandbox.EXITED and run.returncode == 0, run
    etc = ["ld.so.cache"] if os.path.exists("/etc/ld.so.cache") else []
    assert run.stdout.decode().split("\n")[0] == f"False {etc} 1", run
