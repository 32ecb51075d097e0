"""Run every benchmark in one go, on one machine, and write the results.

    python benchmarks/run.py                      # full run (about 42 minutes on 2 CPU cores)
    python benchmarks/run.py --quick              # smoke run: tiny sizes, one repeat (about a minute)
    python benchmarks/run.py --out DIR            # results folder (default benchmarks/results)
    python benchmarks/run.py --only update,memory # a subset of sections

Sections: the ``RUNNERS`` registry below (each compares ours with the tool a user would pick
instead; see benchmarks/README.md). Each is printed as a markdown table and saved as
``<section>.json`` and ``<section>.md`` under the results folder; ``summary.md`` and
``results.json`` hold all of them with the machine description. A section that fails records
its error text instead of stopping the run. A full run then regenerates the results block of
benchmarks/README.md (``report.py``). ``--quick`` writes to a fresh temporary folder unless
``--out`` names one, and never into benchmarks/results/ (the committed full run).

Headline numbers use 2 torch threads (``--threads``), whatever the machine has.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from common import (
    HEADLINE_THREADS,
    REPO_ROOT,
    Section,
    child_env,
    error_text,
    machine_info,
    machine_line,
    markdown_table,
    ratio,
    write_section,
)

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def run_generation(quick: bool, workdir: Path) -> Section:
    """Native engine vs HF generate, delegated to bench_generate (owned by the rollout engine)."""
    import bench_generate

    return bench_generate.run_section(quick=quick, workdir=workdir)


def run_reward(quick: bool, workdir: Path) -> Section:
    """bench_reward.py in its own process (its worker pools), read back from its JSON.

    Skipped in quick mode: starting its scorer pools costs more than the rest of a quick run, and
    tests/test_reward_bench.py already runs it.
    """
    if quick:
        return Section(
            name="reward",
            title="Reward scoring throughput (skipped in --quick)",
            columns=[],
            notes=[
                "skipped in --quick mode; run `python benchmarks/bench_reward.py --quick` for its smoke test"
            ],
        )
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "reward_raw.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "bench_reward.py"), "--out", str(out)]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"bench_reward.py exited with {proc.returncode}: {proc.stderr.strip()[-400:]}")
    raw = json.loads(out.read_text())
    rows = [dict(r) for r in raw["results"]]
    section = Section(
        name="reward",
        title="Reward scoring throughput: sequential vs process-pool reward managers",
        columns=["workload", "manager", "seconds", "samples_per_s"],
        rows=rows,
        config={"samples per workload": raw.get("samples"), "repeats": raw.get("repeats")},
        extra={"raw": raw},
    )
    # Per workload: the fastest process pool against the first (sequential, in-process) manager.
    for workload in dict.fromkeys(r.get("workload", "") for r in rows):
        group = [r for r in rows if r.get("workload", "") == workload]
        pools = [r for r in group[1:] if r["manager"].startswith("parallel")]
        if pools:
            best = max(pools, key=lambda r: r["samples_per_s"])
            section.ratios[f"samples/s {workload}: {best['manager']} / {group[0]['manager']}"] = ratio(
                best["samples_per_s"], group[0]["samples_per_s"]
            )
    return section


def _module_section(name: str) -> Callable[[bool, Path], Section]:
    def run_section(quick: bool, workdir: Path) -> Section:
        module = __import__(f"bench_{name}")
        return module.run(module.QUICK if quick else module.FULL, workdir)

    return run_section


# The sections, in run order. A new one is a module benchmarks/bench_<name>.py with
# ``run(cfg, workdir) -> Section`` and ``FULL`` / ``QUICK`` configs, added here in one line.
RUNNERS: dict[str, Callable[[bool, Path], Section]] = {
    "generation": run_generation,
    "reward": run_reward,
    "update": _module_section("update"),
    "profile": _module_section("profile"),
    "grpo_step": _module_section("grpo_step"),
    "dp_scaling": _module_section("dp_scaling"),
    "scaling": _module_section("scaling"),
    "memory": _module_section("memory"),
    "bypass": _module_section("bypass"),  # bitwise parity's cost and bypass's saving
    "async": lambda quick, workdir: __import__("bench_async").run_section(quick, workdir),
    "sandbox": _module_section("sandbox"),  # code-execution rewards, sandboxed vs plain subprocess
    "lora": _module_section("lora"),
    "real_shape": _module_section("real_shape"),  # the comparisons at Qwen2.5-0.5B's shape
}
SECTIONS = tuple(RUNNERS)


def run_one(name: str, quick: bool, workdir: Path, out_dir: Path, threads: int) -> Section:
    """One section, timed; a failure becomes a section holding the error text."""
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    try:
        section = RUNNERS[name](quick, workdir)
    except Exception as exc:
        section = Section(
            name=name, title=f"{name} (failed)", columns=[], errors={"harness": error_text(exc)}
        )
    # Later sections must see the headline thread count, whatever a library did to it.
    torch.set_num_threads(threads)
    section.seconds = time.perf_counter() - start
    # Other processes' load during the section: read its numbers with this in mind.
    section.extra["load_average_1m"] = {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)}
    if "plot_png" in section.extra:
        section.extra["plot_png"] = _move_plot(Path(section.extra["plot_png"]), out_dir)
    return section


def _move_plot(png: Path, out_dir: Path) -> str:
    target = out_dir / png.name
    out_dir.mkdir(parents=True, exist_ok=True)
    target.write_bytes(png.read_bytes())
    return str(target)


def headline_table(sections: list[Section]) -> str:
    """Every ratio of every section in one table."""
    rows = [
        {"section": s.name, "ratio": key, "value": value} for s in sections for key, value in s.ratios.items()
    ]
    return markdown_table(["section", "ratio", "value"], rows) if rows else "(no ratios)"


def _load_text(section: Section) -> str:
    load = section.extra.get("load_average_1m", {})
    return f"1-min load average {load.get('start')} at start, {load.get('end')} at end"


def write_summary(
    out_dir: Path, sections: list[Section], machine: dict[str, Any], args, seconds: float
) -> Path:
    parts = [
        "# verl-megatron benchmarks",
        "",
        f"Machine: {machine_line(machine)}",
        "",
        f"Mode: {'quick (smoke sizes, not for reading)' if args.quick else 'full'}; "
        f"torch threads {args.threads}; total {seconds:.0f} s. Ratios are ours / peer.",
        "",
        "## Ratios",
        "",
        headline_table(sections),
        "",
    ]
    parts += [s.to_markdown() + f"\n_section time {s.seconds:.0f} s, {_load_text(s)}_\n" for s in sections]
    path = out_dir / "summary.md"
    path.write_text("\n".join(parts))
    results = {
        "machine": machine,
        "quick": args.quick,
        "threads": args.threads,
        "total_seconds": seconds,
        "sections": {s.name: s.to_json(machine) for s in sections},
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one repeat: checks the harness runs"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results folder (default: benchmarks/results for a full run, a new temporary folder with --quick)",
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--threads", type=int, default=HEADLINE_THREADS, help="torch threads (headline: 2)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"--only: unknown sections {unknown}; choose from {list(SECTIONS)}")
    if args.quick and args.out is not None and Path(args.out).resolve() == RESULTS_DIR.resolve():
        parser.error(
            "--quick never writes into benchmarks/results/ (the committed full run); pick another --out"
        )
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="verl_megatron_bench_quick_") if args.quick else str(RESULTS_DIR)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for the subprocesses some sections start
    _quiet_libraries()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    print(f"Machine: {machine_line(machine)}\n", flush=True)
    start = time.perf_counter()
    sections = []
    with tempfile.TemporaryDirectory(prefix="verl_megatron_bench_") as tmp:
        for name in args.sections:
            print(f"== {name} ...", flush=True)
            section = run_one(name, args.quick, Path(tmp) / name, out_dir, args.threads)
            write_section(out_dir, section, machine)
            print(section.to_markdown(), flush=True)
            sections.append(section)
    summary = write_summary(out_dir, sections, machine, args, time.perf_counter() - start)
    print("## Ratios (ours / peer)\n\n" + headline_table(sections))
    print(f"\nwrote {summary} and {out_dir / 'results.json'}")
    if not args.quick and out_dir.resolve() == RESULTS_DIR.resolve() and set(args.sections) == set(SECTIONS):
        import report

        for readme in report.update_readmes(out_dir / "results.json"):
            print(f"regenerated the results block of {readme}")
    return 0


def _quiet_libraries() -> None:
    """Progress bars and start-up warnings would bury the tables."""
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


if __name__ == "__main__":
    sys.exit(main())
