"""Code-execution reward throughput: sandboxed vs a plain subprocess.

Scores stdin/stdout programming samples (APPS-style, 3 test cases each) with the code
scorer (``verl_megatron.reward.scorers.code_exec``: each program in its own sandbox)
and, as the peer, runs the same harness on the same programs in a plain subprocess
(no namespaces, no limits, no seccomp: what a scorer without a sandbox costs), both
``workers`` programs at a time. Two workloads: all correct programs, and a mix in which
10% are hostile (CPU loop, sleep, socket, write outside), which the peer survives only
because its harness's per-case timer stops the loops (fork and memory bombs are left out
of the peer's mix on purpose: unconfined they would harm the machine)::

    python benchmarks/bench_sandbox.py            # 200 samples per workload
    python benchmarks/bench_sandbox.py --quick    # smoke test: 8 samples

Both sides must give every sample the same score; the run fails otherwise.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from common import Section, ratio, run_alone

from verl_megatron.reward import sandbox
from verl_megatron.reward.scorers import code_exec, code_harness


@dataclass(frozen=True)
class SandboxBenchConfig:
    samples: int = 200
    cases: int = 3
    hostile_fraction: float = 0.1
    case_timeout_s: float = 1.0  # CPU seconds: a busy machine does not turn correct programs into timeouts
    case_wall_factor: float = 4.0
    workers: int = 2
    seed: int = 0


FULL = SandboxBenchConfig()
QUICK = SandboxBenchConfig(samples=10, cases=2, case_timeout_s=0.5)

CORRECT = (
    "n = int(input())\nvalues = list(map(int, input().split()))\nprint(sum(values) % 1000003, max(values))\n"
)
WRONG = "n = int(input())\nvalues = list(map(int, input().split()))\nprint(sum(values), min(values))\n"
HOSTILE = {
    "cpu_loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(30)\n",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n",
    "write_outside": "open({path!r}, 'w').write('x')\n",
}


def make_samples(cfg: SandboxBenchConfig, hostile: bool, scratch: Path) -> list[tuple[str, str]]:
    """(response, ground truth) pairs: 3/4 correct, 1/4 wrong, and with ``hostile`` one in
    ten replaced by a hostile program (in turn from ``HOSTILE``)."""
    rng = random.Random(cfg.seed)
    samples = []
    every = round(1 / cfg.hostile_fraction)
    for index in range(cfg.samples):
        inputs, outputs = [], []
        for _ in range(cfg.cases):
            values = [rng.randint(1, 10**9) for _ in range(rng.randint(1, 200))]
            inputs.append(f"{len(values)}\n{' '.join(map(str, values))}\n")
            outputs.append(f"{sum(values) % 1000003} {max(values)}\n")
        program = CORRECT if rng.random() < 0.75 else WRONG
        if hostile and index % every == every - 1:
            name = list(HOSTILE)[(index // every) % len(HOSTILE)]
            program = HOSTILE[name].format(path=str(scratch / f"outside_{index}.txt"))
        truth = json.dumps({"inputs": inputs, "outputs": outputs})
        samples.append((f"```python\n{program}```", truth))
    return samples


def peer_score(response: str, truth: str, config: code_exec.CodeSandboxConfig) -> float:
    """The same harness and comparison, in a plain subprocess (the trainer's env and cwd)."""
    tests = code_exec.parse_tests(truth)
    spec = {
        "code": code_exec.extract_code(response),
        "fn_name": None,
        "case_timeout_s": config.case_timeout_s,
        "case_wall_s": config.case_timeout_s * config.case_wall_factor,
        "max_output_bytes": config.max_output_bytes,
        "cases": [{"input": text, "append": ""} for text in tests["inputs"]],
    }
    limits = config.limits(len(tests["inputs"]))
    with tempfile.TemporaryDirectory() as workdir:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-B", code_harness.__file__],
                input=json.dumps(spec).encode(),
                capture_output=True,
                timeout=limits.wall_s,
                cwd=workdir,
            )
        except subprocess.TimeoutExpired:
            return 0.0
    reports = {}
    for line in proc.stdout.decode(errors="replace").splitlines():
        report = json.loads(line)
        reports[report["case"]] = report
    passed = sum(
        index in reports
        and reports[index]["status"] == "ok"
        and code_exec.stdio_match(reports[index]["output"] or "", tests["outputs"][index])
        for index in range(len(tests["inputs"]))
    )
    return passed / len(tests["inputs"])


def _cpu_seconds() -> float:
    """CPU time of this process (all threads) and of every child it has waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _timed(fn, samples: list[tuple[str, str]], workers: int) -> tuple[list[float], float, float]:
    """Scores, wall seconds and CPU seconds (this process and its children: the load-robust
    measure on a shared machine)."""
    start, cpu = time.perf_counter(), _cpu_seconds()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        scores = list(pool.map(fn, samples))
    return scores, time.perf_counter() - start, _cpu_seconds() - cpu


def run(cfg: SandboxBenchConfig, workdir: Path) -> Section:
    config = code_exec.CodeSandboxConfig(
        case_timeout_s=cfg.case_timeout_s, case_wall_factor=cfg.case_wall_factor, max_workers=cfg.workers
    )
    mode = sandbox.detect_isolation()
    code_exec.compute_score(*make_samples(cfg, False, workdir)[0], config=config)  # warm-up
    section = Section(
        name="sandbox",
        title="Code-execution reward throughput: sandboxed vs plain subprocess",
        columns=[
            "workload",
            "runner",
            "samples",
            "seconds",
            "samples_per_s",
            "cpu_ms_per_sample",
            "samples_per_cpu_s",
            "mean_score",
        ],
        config={**asdict(cfg), "isolation": mode},
    )
    for workload, hostile in (("correct programs", False), ("10% hostile", True)):
        scratch = workdir / f"scratch_{int(hostile)}"
        scratch.mkdir(parents=True, exist_ok=True)
        samples = make_samples(cfg, hostile, scratch)
        ours, ours_s, ours_cpu = _timed(
            lambda s: code_exec.compute_score(*s, config=config)["score"], samples, cfg.workers
        )
        peer, peer_s, peer_cpu = _timed(lambda s: peer_score(*s, config), samples, cfg.workers)
        if ours != peer:
            diff = [i for i, (a, b) in enumerate(zip(ours, peer)) if a != b]
            raise RuntimeError(f"{workload}: sandboxed and plain scores differ at samples {diff[:10]}")
        sides = (("sandboxed (ours)", ours_s, ours_cpu, ours), ("plain subprocess", peer_s, peer_cpu, peer))
        for runner, seconds, cpu, scores in sides:
            section.rows.append(
                {
                    "workload": workload,
                    "runner": runner,
                    "samples": len(samples),
                    "seconds": seconds,
                    "samples_per_s": len(samples) / seconds,
                    "cpu_ms_per_sample": 1000 * cpu / len(samples),
                    "samples_per_cpu_s": len(samples) / cpu,
                    "mean_score": sum(scores) / len(scores),
                }
            )
        section.ratios[f"samples/s {workload}: sandboxed / plain"] = ratio(
            len(samples) / ours_s, len(samples) / peer_s
        )
        section.ratios[f"samples per CPU-second {workload}: sandboxed / plain"] = ratio(
            len(samples) / ours_cpu, len(samples) / peer_cpu
        )
    section.notes.append(
        f"isolation mode '{mode}'; {cfg.workers} programs at a time on each side; "
        f"hostile programs: {', '.join(HOSTILE)} (fork and memory bombs only on the sandboxed side, in the tests)"
    )
    return section


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    main()
