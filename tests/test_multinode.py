"""Several nodes, simulated on one machine (issue 30).

Two torchrun agents (``--nnodes=2``, c10d rendezvous on localhost, one process each) are two
"nodes" (that they train like one 2-process node: tests/test_restart.py). Killing one (its agent and its worker, as a lost machine) ends the other with a failure
within the deadline instead of leaving it waiting in a collective. The Slurm script's dry run
prints the torchrun command of every node of the allocation, from Slurm's variables.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

from tests import restart_job as job

# A survivor must be gone this long after its peer node died: the watchdog's default deadline
# (trainer.stall_timeout_s = 60 s) plus torchrun's shutdown. Gloo reports the closed connection of
# the dead peer at once, so the measured time is far below it.
DEADLINE_S = 90.0


def test_a_killed_node_ends_the_other_within_the_deadline(tmp_path):
    scorer = tmp_path / "slow_scorer.py"
    scorer.write_text(job.SLOW_SCORER)
    out, port = tmp_path / "run", job.free_port()
    # Both nodes are training once the first step's checkpoint is out (no validation before it).
    overrides = [*job.job_overrides(out, scorer, 0.05, steps=6), "trainer.save_freq=1"]
    nodes = [job.two_nodes(port, overrides, node) for node in (0, 1)]
    try:
        job.wait_for_checkpoint(out, 1, nodes)
        job.kill_tree(nodes[1])  # node 1 is lost: its agent and its worker
        killed = time.monotonic()
        output, _ = nodes[0].communicate(timeout=DEADLINE_S)
        took = time.monotonic() - killed
    finally:
        job.stop(nodes)
    assert nodes[0].returncode not in (0, None), output[-3000:]
    assert took < DEADLINE_S
    print(f"node 1 killed -> node 0's torchrun exited with {nodes[0].returncode} after {took:.1f} s")


def _fake_slurm(tmp_path) -> dict[str, str]:
    """Slurm's variables for a 2-node allocation, and an ``scontrol`` that expands its node list."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"\n')
    scontrol.chmod(0o755)
    env = {k: v for k, v in job.env().items() if k not in ("NNODES", "NPROC_PER_NODE", "MAX_RESTARTS")}
    return {
        **env,
        "PATH": f"{bin_dir}:{env['PATH']}",
        "PYTHON": sys.executable,
        "SLURM_SUBMIT_DIR": job.ROOT,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu-a[17-18]",
        "SLURM_GPUS_ON_NODE": "4",
    }


def test_slurm_dry_run_prints_each_nodes_torchrun_command(tmp_path):
    env = _fake_slurm(tmp_path)
    args = ["--config", "configs/ppo.yaml", "model.path=/models/qwen", "parallel.tp=4"]
    printed = {}
    for restarts in (None, "1"):
        run_env = env if restarts is None else {**env, "MAX_RESTARTS": restarts}
        done = subprocess.run(
            ["bash", os.path.join(job.ROOT, "launch", "slurm.sbatch"), "--dry-run", *args], cwd=tmp_path, env=run_env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        printed[restarts] = [shlex.split(line) for line in done.stdout.splitlines() if line.strip()]
    launcher = [
        "--nproc-per-node=4",
        "--master-addr=gpu-a17",
        f"--master-port={20000 + 4242}",
        "--max-restarts=3",
    ]
    tail = ["-m", "verl_megatron.train", *args, "trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
    expected = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", *launcher, *tail]
        for node in (0, 1)
    ]
    assert printed[None] == expected, printed[None]
    # MAX_RESTARTS reaches every node's torchrun.
    assert [[w for w in c if w.startswith("--max-restarts")] for c in printed["1"]] == [
        ["--max-restarts=1"]
    ] * 2
