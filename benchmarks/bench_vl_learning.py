"""The vision-language quickstart learns: GRPO on the shapes task from a random-init tiny Qwen2.5-VL.

Runs ``configs/quickstart_vl.yaml`` as written, in this process (``bench_quickstart_family.py``
with that recipe and the shapes task's validation metric), and records the greedy validation
reward per evaluation step, its start, the first evaluation step at which it reaches 0.8, its final
value and the wall time (for scale: the machine is shared), in benchmarks/results/vl_learning.json.

    OMP_NUM_THREADS=1 python benchmarks/bench_vl_learning.py
    python benchmarks/bench_vl_learning.py --steps 2 --out /tmp/smoke.json   # smoke (not a measurement)
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "vl_learning.json")


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, ROOT)
    from benchmarks import bench_quickstart_family

    argv = list(sys.argv[1:] if argv is None else argv)
    out = [] if "--out" in argv else ["--out", os.path.relpath(OUT)]
    bench_quickstart_family.main(
        ["--config", "quickstart_vl.yaml", "--val-key", "val/test_score/synthetic/shapes", *out, *argv]
    )


if __name__ == "__main__":
    main()
