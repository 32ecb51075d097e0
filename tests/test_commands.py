"""Commands a user copies run as written (issue 30).

Every command printed in the README (the two set-up lines excluded: they install), in a recipe's
header (configs/*.yaml) and in launch/ is collected here, and the inventory is asserted, so a new
command cannot slip in untested. Commands that run on this CPU run to the end of step 1 with only
``trainer.total_training_steps=1`` and a temporary output dir added: the single-node script and a
torchrun as processes (``REAL``); those that differ from them only in their arguments (the
multi-node script's through ``--dry-run``, whose printed torchrun command is run) through the same
entry point in a pool worker of their world size. So do the ``verl-megatron train`` commands: the
default one runs as a process in tests/test_quickstart.py (its whole run, as written), and the
console script itself runs as a process below (check-hf, --version). GPU-scale templates (a real
checkpoint path, 8+ processes) get tiny stand-ins for their placeholders and pass every start-up
check at their own world size (tests/test_recipes.py runs each recipe a step at small sizes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
STEP1 = ["trainer.total_training_steps=1"]
# A program and at least one argument ("torchrun" or "launch/" alone in prose is a name, not a command).
_COMMAND = re.compile(
    r"^(?:[A-Z_]+=\S+ )*(?:verl-megatron|torchrun|python -m verl_megatron|launch/|sbatch)\S* \S"
)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _metrics(out_dir: str) -> list[dict]:
    return [json.loads(line) for line in _read(os.path.join(out_dir, "metrics.jsonl")).splitlines()]


def _joined(lines: list[str]) -> list[str]:
    """Lines with a trailing backslash continue on the next one."""
    out, pending = [], ""
    for line in lines:
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        out.append(line)
    return out


def readme_commands() -> list[str]:
    text = _read(os.path.join(ROOT, "README.md"))
    found = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        found += [line.split("  #")[0].strip() for line in _joined(block.splitlines())]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    setup = ("python3 -m venv",)  # the two set-up commands: they install
    return [c for c in found if _COMMAND.match(c) and not c.startswith(setup)]


def _comment_commands(path: str) -> list[str]:
    lines = [
        line[1:]
        for line in _read(path).splitlines()
        if line.startswith("#") and not line.startswith(("#!", "#SBATCH"))
    ]
    # A remark after the command is set off by two spaces: "verl-megatron train   (the default)".
    return [re.split(r"\s{2,}[(#]", c)[0] for c in _joined(lines) if _COMMAND.match(c)]


def header_commands() -> dict[str, list[str]]:
    configs = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml"))
    launch = sorted(os.listdir(os.path.join(ROOT, "launch")))
    return {
        **{f"configs/{f}": _comment_commands(os.path.join(ROOT, "configs", f)) for f in configs},
        **{f"launch/{f}": _comment_commands(os.path.join(ROOT, "launch", f)) for f in launch},
    }


# Routing replay's flags as the README gives them (checked on the recipe that builds an MoE model).
ROUTING_FLAGS = "rollout.enable_rollout_routing_replay=true actor.megatron.router_replay.mode=R3"

# Run to the end of step 1 on this CPU (the quickstart's two header lines are one run). The single-node
# script runs as a user starts it (its start-up check, then torchrun); the multi-node one through
# --dry-run, whose printed torchrun command is run (its check is the single-node script's).
RUN = [
    "verl-megatron train",
    "verl-megatron train --config configs/quickstart_moe.yaml",
    "torchrun --nproc_per_node=2 -m verl_megatron.train --config configs/quickstart_moe.yaml parallel.ep=2",
    "verl-megatron train --config configs/grpo_lora.yaml",
    "torchrun --nproc_per_node=2 -m verl_megatron.train --config configs/quickstart.yaml "
    "rollout.placement=separate rollout.world_size=1 async_training.max_staleness=1 "
    "algorithm.rollout_correction.rollout_is=token",
    "NPROC=2 launch/single_node.sh",
    "NNODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 NPROC_PER_NODE=2 launch/multi_node.sh",
]
SINGLE_NODE = RUN[5]
# GPU-scale: placeholders -> tiny stand-ins, every start-up check at the command's world size.
TEMPLATE_ASSETS = {
    "/path/to/hf/checkpoint": "dense",
    "/models/Qwen2.5-7B": "dense",
    "/models/Qwen2.5-3B-Instruct": "dense",
    "/models/Qwen2.5-0.5B-Instruct": "dense",
    "/models/qwen": "dense",
    "model.path=...": "model.path={dense}",
    "/models/Qwen3-30B-A3B": "moe",
    "/path/to/reward_model": "rm",
    "check-hf DIR": "check-hf {moe}",
    "dapo-math-17k.parquet": "data/gsm8k/train.parquet",
    "aime-2024.parquet": "data/gsm8k/test.parquet",
    "MASTER_ADDR=node0": "MASTER_ADDR=127.0.0.1",
}


def test_every_printed_command_is_known():
    """The inventory: each command printed is one of those this file runs or checks."""
    readme = readme_commands()
    assert readme == [
        "verl-megatron train --config configs/gpu_quickstart.yaml",
        "python -m verl_megatron.data.gsm8k_format --in gsm8k_train.jsonl --split train --out data/gsm8k",
        "verl-megatron train --config configs/grpo.yaml model.path=/path/to/hf/checkpoint",
        "torchrun --nproc_per_node=8 -m verl_megatron.train --config configs/ppo.yaml model.path=/path/to/hf/checkpoint"
        " parallel.tp=2 parallel.pp=2",
        "verl-megatron check-hf /path/to/hf/checkpoint --tp 2 --pp 1",
        # the agent recipe's two commands: run a step each by tests/test_recipes.py
        "verl-megatron sft --config configs/sft_agent.yaml",
        "verl-megatron train --config configs/quickstart_agent.yaml model.path=outputs/sft_agent/hf_export"
        " trainer.default_local_dir=outputs/agent_from_sft",
        "verl-megatron sft",  # run, and the template checked, in tests/test_sft_commands.py
        "verl-megatron sft --config configs/sft.yaml model.path=/path/to/hf data.train_files=[train.parquet]"
        " data.val_files=[val.parquet]",
        "verl-megatron train --config configs/distill_quickstart.yaml",
        # run by tests/test_plan_cli.py
        "verl-megatron plan --config configs/grpo.yaml model.path=verl_megatron/planner/configs/Qwen3-8B"
        " parallel.tp=2 actor.optim.use_distributed_optimizer=true --gpus 8 --gpu-memory 80GiB",
        "verl-megatron --version",
        RUN[4],
        "verl-megatron check-hf DIR --ep 2",
        "verl-megatron train --config configs/quickstart_vl.yaml",  # a step in tests/test_recipes.py
    ]
    headers = header_commands()
    assert headers["configs/quickstart.yaml"] == [
        "verl-megatron train",
        "verl-megatron train trainer.total_training_steps=20",
    ]
    assert headers["configs/quickstart_moe.yaml"] == RUN[1:3]
    assert headers["configs/grpo_lora.yaml"] == [RUN[3]]
    assert len(headers["configs/ppo.yaml"]) == 3 and len(headers["launch/multi_node.sh"]) == 2
    assert len(headers["configs/gpu_quickstart.yaml"]) == 2
    for name in ("dapo", "grpo", "grpo_moe", "grpo_rm"):
        assert len(headers[f"configs/{name}.yaml"]) == 1, name
    assert len(headers["launch/single_node.sh"]) == 1 and len(headers["launch/slurm.sbatch"]) == 1
    # SFT and distillation (tests/test_sft_commands.py): the quickstarts run, the templates checked.
    assert len(headers["configs/sft.yaml"]) == 2
    assert headers["configs/sft_quickstart.yaml"][0] == "verl-megatron sft"
    distill = ["verl-megatron sft", "verl-megatron train --config configs/distill_quickstart.yaml"]
    assert headers["configs/distill_quickstart.yaml"] == distill


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
    }
    env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port, without changing the command
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return {**env, **(extra or {})}


def _split(command: str) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 prog args`` -> ({A: 1, B: 2}, [prog, args]); ``python``/``torchrun`` are this venv's."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    return env, words


def _dry_run(env: dict[str, str], words: list[str]) -> list[str]:
    """A launch script's --dry-run: the torchrun command(s) it would start."""
    out = subprocess.run(
        ["bash", words[0], "--dry-run", *words[1:]],
        cwd=ROOT,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


# Launched as a user launches them: the single-node script (its start-up check, then torchrun
# --standalone) and a bare torchrun (rollout.placement=separate starts torch.distributed itself, so
# it cannot join a pool's group). The others differ from these, or from the plain `verl-megatron
# train` that tests/test_quickstart.py runs as a process, only in their config and overrides (the
# multi-node script in its printed torchrun command's arguments): their command line, split as
# written, goes to the same entry point in a pool worker of their world size (tests/helpers.py
# cli_train_job), which saves a fresh interpreter's imports per process (~6 CPU s each).
REAL = (RUN[4], SINGLE_NODE)


def _step1_args(words: list[str], out_dir: str) -> list[str]:
    return [*words, *STEP1, f"trainer.default_local_dir={out_dir}"]


def _run_real(command: str, out_dir: str) -> tuple[subprocess.CompletedProcess, float]:
    env, words = _split(command)
    if command == SINGLE_NODE:
        words = ["bash", *words]
    start = time.monotonic()
    args = _step1_args(words, out_dir)
    done = subprocess.run(args, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=600)
    return done, time.monotonic() - start


def _in_pool(pool, argv: list[str], entry: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """``entry``'s main on ``argv`` on every rank of ``pool``: the ranks' output joined in rank
    order (as torchrun prints it), the first failing rank's exit status."""
    ranks = pool.run("tests.helpers:cli_train_job", argv=argv, cwd=cwd, entry=entry)
    code = next((r.returncode for r in ranks if r.returncode), 0)
    out, err = "".join(r.stdout for r in ranks), "".join(r.stderr for r in ranks)
    return subprocess.CompletedProcess(argv, code, out, err)


def _run_in_pool(pools: dict, command: str, out_dir: str) -> tuple[subprocess.CompletedProcess, float]:
    """A ``verl-megatron train`` command (one process: a pool worker is a torchrun worker, so the
    console script's main runs train's), or a torchrun one, the launch scripts' as printed."""
    env, words = _split(command)
    if words[0].startswith("launch/"):
        (words,) = _dry_run(env, words)
        assert words[:3] == [sys.executable, "-m", "torch.distributed.run"], words
    start = time.monotonic()
    if words[0] == "verl-megatron":
        done = _in_pool(pools[1], _step1_args(words[1:], out_dir), "verl_megatron.cli")
    else:
        world, argv = _world_and_args(words)
        # The launcher's own flags (--nnodes, --node-rank, --master-addr ...) are not run here:
        # torchrun's parser must accept them and agree on the world size the pool provides.
        from torch.distributed.run import get_args_parser

        launcher = get_args_parser().parse_args(words[3:])
        nodes = int(launcher.nnodes.split(":")[-1])  # "N" or "MIN:MAX" (default "1:1")
        assert int(launcher.nproc_per_node) * nodes == world, (words, launcher)
        done = _in_pool(pools[world], _step1_args(argv, out_dir), "verl_megatron.train")
    return done, time.monotonic() - start


def test_cpu_commands_run_to_step_1(tmp_path, pool1, pool2):
    """Each runs as written to the end of step 1; at 2 processes the unset micro-batch is derived."""
    outs = dict(zip(RUN, (str(tmp_path / f"run{i}") for i in range(len(RUN))), strict=True))
    pooled = [c for c in RUN if c not in REAL]
    assert len(pooled) == 5
    # The real processes two at a time while the pools run the rest, one command at a time each.
    with ThreadPoolExecutor(2) as pool:
        real = pool.map(_run_real, REAL, [outs[c] for c in REAL])
        in_pool = [_run_in_pool({1: pool1, 2: pool2}, c, outs[c]) for c in pooled]
        by_command = {**dict(zip(REAL, real, strict=True)), **dict(zip(pooled, in_pool, strict=True))}
    results = [by_command[c] for c in RUN]
    for command, out_dir, (done, seconds) in zip(RUN, outs.values(), results, strict=True):
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        rows = _metrics(out_dir)
        step1 = [r for r in rows if r.get("step") == 1 or r.get("training/global_step") == 1]
        assert step1, f"{command}: no step 1 in {rows}"
        print(f"{seconds:6.1f} s  {command}")
    startup = {
        c: next(line for line in d.stdout.splitlines() if "verl-megatron train: model" in line)
        for c, (d, _) in zip(RUN, results, strict=True)
    }
    two_procs = [c for c in RUN if "nproc_per_node=2" in c or "NPROC=2" in c or "NPROC_PER_NODE=2" in c]
    for command in two_procs:
        dp = 1 if "placement=separate" in command else 2
        assert f"derived actor.ppo_micro_batch_size_per_gpu={256 // dp}" in startup[command], startup[command]
    assert "derived actor.ppo_micro_batch_size_per_gpu=256" in startup["verl-megatron train"]
    assert "model quickstart tiny qwen3_moe (2 layers" in startup[RUN[1]]
    _check_launch_script_run(by_command[SINGLE_NODE][0], outs[SINGLE_NODE])


def _check_launch_script_run(done: subprocess.CompletedProcess, out_dir: str) -> None:
    """launch/single_node.sh ran its start-up check, then the job at two processes, with the
    arguments after the script reaching the ranks."""
    assert "verl-megatron check: the start-up checks pass for 2 process(es)" in done.stdout, done.stdout
    step1 = {}
    for row in _metrics(out_dir):
        if row.get("step") == 1:
            step1.update(row)
    # Throughput is per device: the run had two processes.
    throughput = step1["perf/total_num_tokens"] / (step1["timing_s/step"] * 2)
    assert step1["perf/throughput"] == pytest.approx(throughput)
    config = json.loads(_read(os.path.join(out_dir, "config.json")))
    assert (
        config["trainer"]["total_training_steps"] == 1 and config["trainer"]["default_local_dir"] == out_dir
    )


def test_readme_routing_flags_pass_start_up_checks_on_the_moe_recipe():
    """The README's routing replay flags, on the recipe that builds an MoE model, pass every start-up
    check. The trainer with these two flags on the quickstart task's tiny Qwen3-MoE (replayed routes,
    hit rate 1.0) is run by tests/test_routing_replay.py::test_trainer_replays_and_reports_hit_rates."""
    from verl_megatron.trainer.preflight import prepare_run

    assert ROUTING_FLAGS in " ".join(_read(os.path.join(ROOT, "README.md")).split())
    config, layout, _ = prepare_run(
        os.path.join(ROOT, "configs/quickstart_moe.yaml"), ROUTING_FLAGS.split(), 1
    )
    assert config.rollout.enable_rollout_routing_replay and config.actor.megatron.router_replay.mode == "R3"
    assert config.quickstart.family == "qwen3_moe" and layout.dp == 1


def _gsm8k_rows(n: int, offset: int) -> str:
    rows = []
    for i in range(offset, offset + n):
        a, b = 3 + i, 4 + 2 * i
        rows.append({"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}.\n#### {a + b}"})
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints for the placeholders, and GSM8K parquet made by the printed convert commands
    (1600 rows: dapo.yaml generates 1536 prompts a round)."""
    from verl_megatron.utils.local_assets import (
        build_bpe_tokenizer,
        build_tiny_hf_model,
        build_tiny_reward_model,
    )

    root = tmp_path_factory.mktemp("commands")
    tok = build_bpe_tokenizer(root / "dense")
    sizes = {"hidden_size": 32, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 64, "tokenizer": tok}
    build_tiny_hf_model(root / "dense", "qwen2", num_layers=4, **sizes)
    build_tiny_hf_model(root / "moe", "qwen3_moe", num_layers=2, num_experts=8, **sizes)
    build_tiny_reward_model(root / "rm", "qwen2", num_layers=2, **sizes)
    work = root / "work"
    work.mkdir()
    (work / "gsm8k_train.jsonl").write_text(_gsm8k_rows(1600, 0))
    (work / "gsm8k_test.jsonl").write_text(_gsm8k_rows(8, 5000))
    converts = [c for c in readme_commands() + header_commands()["configs/ppo.yaml"] if "gsm8k_format" in c]
    assert len(converts) == 3 and converts[0] == converts[1]  # the README's is ppo.yaml's first
    # The train split's as a process; the test split's differs in its arguments only: its command
    # line, split as written, goes to the same main here (the module imports torch: ~4 CPU s a process).
    train, test = converts[1:]
    _, words = _split(train)
    done = subprocess.run(words, cwd=work, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    _, words = _split(test)
    assert words[:3] == [sys.executable, "-m", "verl_megatron.data.gsm8k_format"], words
    from verl_megatron.data.gsm8k_format import main as convert

    with contextlib.chdir(work):
        assert convert(words[3:]) == 0
    import pyarrow.parquet as pq

    assert pq.read_metadata(work / "data/gsm8k/train.parquet").num_rows == 1600
    assert pq.read_metadata(work / "data/gsm8k/test.parquet").num_rows == 8
    return {"dense": str(root / "dense"), "moe": str(root / "moe"), "rm": str(root / "rm"), "work": str(work)}


def _substitute(command: str, assets: dict[str, str]) -> str:
    for placeholder, stand_in in TEMPLATE_ASSETS.items():
        value = stand_in.format(**assets) if "{" in stand_in else assets.get(stand_in, stand_in)
        command = command.replace(placeholder, value)
    return command


def _world_and_args(words: list[str]) -> tuple[int, list[str]]:
    """(processes, verl_megatron.train's arguments) of a torchrun or ``verl-megatron train`` command."""
    if words[0] == "verl-megatron":
        from verl_megatron.train import parse_args
        from verl_megatron.trainer.config import load_config

        args = parse_args(words[2:])
        config = load_config(os.path.join(ROOT, args.config), args.overrides)
        return config.trainer.n_gpus_per_node, words[2:]
    sizes = dict(
        re.match(r"--(nproc[-_]per[-_]node|nnodes)=(\d+)", w).groups()
        for w in words
        if re.match(r"--(nproc|nnodes)", w)
    )
    nproc = int(next(v for k, v in sizes.items() if k.startswith("nproc")))
    return nproc * int(sizes.get("nnodes", 1)), words[words.index("verl_megatron.train") + 1 :]


TEMPLATES = [
    "verl-megatron train --config configs/gpu_quickstart.yaml",
    "verl-megatron train --config configs/grpo.yaml model.path=/path/to/hf/checkpoint",
    "torchrun --nproc_per_node=8 -m verl_megatron.train --config configs/ppo.yaml model.path=/path/to/hf/checkpoint"
    " parallel.tp=2 parallel.pp=2",
]


# Recipes whose header commands are run by their own tests (other model families, SFT, distillation,
# agents: test_sft_commands.py, test_distill.py, test_family_*_recipe.py, test_recipes.py).
OWN_COMMAND_TESTS = (
    "configs/sft.yaml",
    "configs/sft_quickstart.yaml",
    "configs/distill_quickstart.yaml",
    "configs/quickstart_agent.yaml",
    "configs/sft_agent.yaml",
    "configs/quickstart_deepseek.yaml",
    "configs/quickstart_vl.yaml",
    "configs/grpo_deepseek_v3.yaml",
    "configs/grpo_gpt_oss.yaml",
    "configs/grpo_qwen3_next.yaml",
)


def test_gpu_templates_pass_every_start_up_check_at_their_world_size(stand_ins, monkeypatch):
    from verl_megatron.train import parse_args
    from verl_megatron.trainer.preflight import prepare_run

    headers = header_commands()
    templates = [
        *TEMPLATES,
        *(c for f, cs in headers.items() for c in cs if f not in ("configs/quickstart.yaml", "configs/quickstart_moe.yaml",
          "configs/grpo_lora.yaml", *OWN_COMMAND_TESTS) and "gsm8k_format" not in c),
    ]  # fmt: skip
    assert len(templates) == 3 + 7 + 4
    monkeypatch.chdir(
        stand_ins["work"]
    )  # the recipes' data/gsm8k/*.parquet, as the convert commands wrote them
    checked = []
    for template in templates:
        env, words = _split(_substitute(template, stand_ins))
        if words[0].startswith(("launch/", "sbatch")):
            script = words[words.index(next(w for w in words if w.startswith("launch/")))]
            rest = words[words.index(script) + 1 :]
            nodes = re.search(r"--nodes=(\d+)", template)
            env = {
                **env,
                "MASTER_ADDR": "127.0.0.1",
                "NPROC_PER_NODE": "8",
                "NPROC": "8",
                **({"NNODES": nodes.group(1)} if nodes else {}),
            }
            commands = _dry_run(env, [script, *rest])
        else:
            commands = [words]
        for command in commands:
            world, argv = _world_and_args(command)
            args = parse_args(argv)
            config, layout, _ = prepare_run(os.path.join(ROOT, args.config), args.overrides, world)
            checked.append((template, world, layout.dp, config.actor.ppo_micro_batch_size_per_gpu))
    assert [w for _, w, _, _ in checked] == [1, 1, 8, 8, 1, 1, 8, 8, 8, 8, 16, 16, 8, 32, 32, 32, 32], checked


def test_help_lists_every_check_hf_option(capsys):
    from verl_megatron import cli
    from verl_megatron.tools.check_hf import _parser

    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    options = [
        o for a in _parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"
    ]
    assert options == ["--tp", "--pp", "--vpp", "--ep", "--etp", "--dtype", "--tolerance", "--seed"]
    check_hf = next(line for line in text.splitlines() if "check-hf PATH" in line)
    assert [o for o in options if f"{o} " not in check_hf] == []


def test_mini_batch_larger_than_the_batch_reads_the_right_way_round():
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import default_config_path, load_config, validate_config

    gae = ["algorithm.adv_estimator=gae", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(default_config_path(), [*gae, "critic.ppo_mini_batch_size=64"]), 1)
    assert str(err.value).startswith(
        "critic.ppo_mini_batch_size=64 is larger than data.train_batch_size=8: a mini-batch is a part of the "
        "step's batch; lower it to a divisor of 8"
    )
    # Derived micro-batches: a rank's share of a mini-batch, 8 prompts * 8 samples / dp.
    config = load_config(default_config_path(), [*gae, "critic.ppo_mini_batch_size=8"])
    validate_config(config, 2)
    assert (config.actor.ppo_micro_batch_size_per_gpu, config.critic.ppo_micro_batch_size_per_gpu) == (32, 32)


def test_readme_check_hf_and_version_commands_run(stand_ins, pool2):
    """The README's two check-hf lines on tiny stand-ins (dense at tp=2, MoE at ep=2), and --version.
    The dense check runs as a user runs it (it starts torchrun itself); the MoE one differs in its
    arguments only: its command line, split as written, goes to the console script's main in the
    two-process pool (a torchrun worker's environment: the check runs there)."""
    readme = readme_commands()
    commands = [c for c in readme if c.startswith(("verl-megatron check-hf", "verl-megatron --version"))]
    assert len(commands) == 3 and "--ep 2" in commands[2]
    for command in commands:
        env, words = _split(_substitute(command, stand_ins))
        if "--ep" in words:
            done = _in_pool(pool2, words[1:], "verl_megatron.cli")
        else:
            done = subprocess.run(words, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if "--version" in command:
            assert re.fullmatch(r"verl-megatron \S+\n", done.stdout), done.stdout
        else:
            # The verdict line: megatron's logits at this layout within float32's 1e-3 of transformers'.
            found = re.search(
                r"max \|logit diff\| = (\S+) over \d+ prompts \(tolerance 0.001\): OK", done.stdout
            )
            assert found and float(found.group(1)) <= 1e-3, done.stdout
