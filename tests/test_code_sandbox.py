"""Code-execution rewards: verl prime_code's scores for correct programs, and hostile
programs (fork/memory bombs, loops, writes outside, secrets, sockets, killing the parent)
scoring 0, counted by cause, with the trainer untouched."""

import json
import os
import signal
import string
import sys
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from tests.test_reward_managers import make_batch
from verl_megatron.reward import sandbox
from verl_megatron.trainer.ppo.reward import compute_reward
from verl_megatron.trainer.ppo_trainer import PPOTrainer
from verl_megatron.utils.local_assets import build_char_tokenizer
from verl_megatron.utils.reward_score import (
    batch_default_compute_score,
    default_compute_score,
    known_data_sources,
)
from verl_megatron.utils.reward_score import code_exec as ce
from verl_megatron.workers.reward_manager import NaiveRewardManager

# Small limits: every hostile program is cut off within about two seconds.
CFG = ce.CodeSandboxConfig(
    case_timeout_s=0.5, case_wall_factor=4.0, memory_mb=256, startup_s=1.0, max_workers=4
)
SECRET_NAME, SECRET = "VERL_TEST_TRAINER_SECRET", "hunter2-trainer-credential"
ADD = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})


def py(code):
    return f"Here you go:\n```python\n{code}\n```\n"


# ---------------------------------------------------------------- pure rules


@pytest.mark.parametrize(
    "output, expected, same",
    [
        ("3\n", "3\n", True),
        ("  3  \n\n", "3", True),  # trimmed text
        ("1 2 \n3\n", "1 2\n3", True),  # stripped lines
        ("1\n\n2\n", "1\n2\n", True),  # blank lines dropped
        ("0.3333333\n", "0.33333333", True),  # within rtol 1e-5
        ("0.3334\n", "0.3333", False),
        ("1 2\n", "1 2 3", False),
        ("10\n", "010", False),  # integers: compared as text
        ("", "0", False),
        ("3\n", ["3"], True),  # a list of lines is joined
    ],
)
def test_stdio_match_follows_prime_code(output, expected, same):
    assert ce.stdio_match(output, expected) is same


@pytest.mark.parametrize(
    "result, expected, same",
    [
        ("3", "3", True),
        ("(1, 2)", "[1, 2]", True),  # a tuple is a list
        ("[1, 2]", "[[1, 2]]", True),  # a list output also matches its first element
        ("[(1, 2), (3, 4)]", "[[[1, 2], [3, 4]]]", True),  # tuples inside, against the first element
        ("{1: 'a'}", '{"1": "a"}', True),  # JSON keys back to ints
        ("3", "4", False),
        ("<object at 0x1>", "3", False),
        (None, "3", False),
    ],
)
def test_call_match_follows_prime_code(result, expected, same):
    assert ce.call_match(result, expected) is same


def test_extraction_and_test_parsing():
    assert ce.extract_code("a\n```python\nx=1\n```\nb\n```python\ny=2\n```") == "\ny=2\n"
    assert ce.extract_code("print(1)") == "print(1)"  # no fence: the whole response
    tests = ce.parse_tests(json.dumps({"assert_case": ["assert f()"]}))
    assert tests["inputs"] == [""] and tests["outputs"] == [None]
    for bad in (
        "not json",
        "[]",
        '{"inputs": [1]}',
        '{"inputs": [1], "outputs": []}',
        '{"inputs": [], "outputs": []}',
    ):
        with pytest.raises(ValueError):
            ce.parse_tests(bad)


def test_code_sources_are_in_the_default_dispatch():
    assert set(ce.CODE_SOURCES) <= set(known_data_sources())
    assert default_compute_score("taco", "no code fence and no program", ADD)["score"] == 0.0


# ---------------------------------------------------------------- correct programs

TWELVE = json.dumps({"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{2 * i}\n" for i in range(12)]})
BIG = json.dumps({"inputs": ["x" * (1 << 20) + "\n", "ab\n"], "outputs": [str(1 << 20), "2"]})
CORRECT = [  # (response, ground truth, verl prime_code's score)
    (py("import os\nos.chdir('/')\nprint(len(input()))"), BIG, 1.0),  # 1 MiB through the pipe; cwd moved
    (py("a, b = map(int, input().split())\nprint(a + b)"), ADD, 1.0),
    (py("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)"), ADD, 1.0),
    (py("a, b = map(int, open(0).read().split())\nprint(a + b)"), ADD, 1.0),
    (py("print(sqrt(9) == 3 and 3 or 0)"), json.dumps({"inputs": [""], "outputs": ["3"]}), 1.0),  # preamble
    (py("a, b = map(int, input().split())\nprint(3)"), ADD, 0.5),
    (py("if __name__ == '__main__':\n    print(2 * int(input()))"), TWELVE, 1.0),
    (py("n = int(input())\nprint(2 * n if n != 11 else -1)"), TWELVE, 1.0),  # only 10 cases count
    (py("n = int(input())\nprint(2 * n if n != 0 else -1)"), TWELVE, 0.9),
    (py("print(1 / 3)"), json.dumps({"inputs": [""], "outputs": ["0.333333"]}), 1.0),
    (
        py("def add(a, b):\n    return a + b"),
        json.dumps({"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]}),
        1.0,
    ),
    (
        py("class Solution:\n    def pair(self, a):\n        return (a, a)"),
        json.dumps({"fn_name": "pair", "inputs": ["1", "2"], "outputs": ["[1, 1]", "[2, 3]"]}),
        0.5,
    ),
    (
        py("def f(x):\n    return x + 1"),
        json.dumps({"assert_case": ["assert f(1) == 2", "assert f(1) == 3"]}),
        0.5,
    ),
    (
        py("import threading\nthreading.Thread(target=lambda: print(7)).start()"),
        json.dumps({"inputs": [""], "outputs": ["7"]}),
        1.0,
    ),
]


def test_correct_programs_score_as_verl_prime_code():
    results = ce.compute_score_batch([r for r, _, _ in CORRECT], [g for _, g, _ in CORRECT], CFG)
    got = [round(r["score"], 6) for r in results]
    assert got == [s for _, _, s in CORRECT], [(i, r) for i, r in enumerate(results)]


# ---------------------------------------------------------------- hostile programs

HOSTILE = {  # name: (program, cause counted)
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "process"),
    "subprocess": ("import subprocess\nprint(subprocess.check_output(['echo', '3']).decode())", "process"),
    # bytes(n) is calloc'ed: the address space runs out at once, without touching pages
    "memory_bomb": ("hog = []\nwhile True:\n    hog.append(bytes(10**8))", "memory"),
    "cpu_loop": ("while True:\n    pass", "timeout"),
    "sleep": ("import time\ntime.sleep(60)", "timeout"),
    # ignores the per-case timer: the sandbox's wall limit ends it
    "deaf_sleep": (
        "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ntime.sleep(60)",
        "timeout",
    ),
    "network": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "network"),
    "kill_parent": ("import os\nos.kill(os.getppid(), 9)", "signal"),
    "secret": (f"import os\nprint(os.environ.get({SECRET_NAME!r}))", "wrong_answer"),
}


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory):
    """Every hostile program scored in one batch (runs side by side), with a secret in the
    trainer's environment and a file of the project's in reach."""
    project = tmp_path_factory.mktemp("project")
    victim = project / "train.py"
    victim.write_text("original")
    programs = dict(HOSTILE)
    programs["write_outside"] = (f"open({str(victim)!r}, 'w').write('pwned')", "filesystem")
    programs["create_outside"] = (f"open({str(project / 'new.txt')!r}, 'w').write('x')", "filesystem")
    truth = json.dumps({"inputs": ["1 2\n"], "outputs": [SECRET]})  # a leaked secret would pass
    os.environ[SECRET_NAME] = SECRET
    start = time.monotonic()
    try:
        results = ce.compute_score_batch([py(p) for p, _ in programs.values()], [truth] * len(programs), CFG)
    finally:
        del os.environ[SECRET_NAME]
    return {
        "results": dict(zip(programs, results)),
        "causes": {name: cause for name, (_, cause) in programs.items()},
        "seconds": time.monotonic() - start,
        "project": project,
    }


@pytest.mark.parametrize("name", [*HOSTILE, "write_outside", "create_outside"])
def test_hostile_program_scores_zero_counted_by_cause(hostile_results, name):
    result = hostile_results["results"][name]
    cause = hostile_results["causes"][name]
    assert result == {"score": 0.0, f"reward/sandbox/{cause}_count": 1}, result


def test_hostile_programs_leave_the_trainer_and_project_untouched(hostile_results):
    project = hostile_results["project"]
    assert (project / "train.py").read_text() == "original"
    assert sorted(p.name for p in project.iterdir()) == ["train.py"]
    # side by side: a batch costs about one run's limits, not one per hostile program
    assert hostile_results["seconds"] < 30, hostile_results["seconds"]


def test_program_sees_no_trainer_environment_and_no_other_process(monkeypatch):
    monkeypatch.setenv(SECRET_NAME, SECRET)
    monkeypatch.setenv("PYTHONPATH", "/should/not/reach")
    code = "import os, sys\nprint(dict(os.environ), sys.path, os.getpid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))"
    run = sandbox.run_sandboxed([sys.executable, "-I", "-c", code], limits=sandbox.SandboxLimits(wall_s=20))
    out = run.stdout.decode()
    assert run.cause == sandbox.EXITED and run.returncode == 0, run
    assert SECRET not in out and "/should/not/reach" not in out
    if run.mode == sandbox.NAMESPACES:  # pid 1 of its own namespace: no other process is visible
        assert out.rstrip().endswith("1 ['1']"), out


def test_credential_files_are_covered(tmp_path):
    (tmp_path / ".netrc").write_text(SECRET)
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "id_rsa").write_text(SECRET)
    code = f"import os\nprint(repr(open({str(tmp_path / '.netrc')!r}).read()), os.listdir({str(tmp_path / '.ssh')!r}))"
    hide = [str(tmp_path / ".netrc"), str(tmp_path / ".ssh")]
    run = sandbox.run_sandboxed(  # hidden inside a folder the sandbox is given; outside one, absent
        [sys.executable, "-I", "-S", "-c", code], isolation="namespaces", hide=hide, expose=[str(tmp_path)]
    )
    assert run.stdout.decode().strip() == "'' []", run
    assert (tmp_path / ".netrc").read_text() == SECRET  # covered in the sandbox only


def test_cpu_limit_ends_a_spinning_program_that_ignores_signals():
    code = "import signal\nfor s in (signal.SIGALRM, signal.SIGXCPU, signal.SIGTERM):\n    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass"
    run = sandbox.run_sandboxed(
        [sys.executable, "-I", "-S", "-c", code], limits=sandbox.SandboxLimits(cpu_s=1, wall_s=60)
    )
    assert run.cause == sandbox.CPU_LIMIT and run.returncode == -9, run
    assert 0.9 <= run.cpu_s < 3.0 and run.wall_s < 60, run  # rusage and the limit's clock differ by ticks


def test_basic_mode_is_named_logged_and_still_blocks_sockets_and_signals(monkeypatch, caplog):
    failed = sandbox.SandboxResult(
        sandbox.SANDBOX_ERROR, None, b"", b"unshare: Operation not permitted", 0, 0, ""
    )
    monkeypatch.setattr(sandbox, "_run", lambda *args: failed)
    sandbox.detect_isolation.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="'basic' mode.*not enforced: files writable"):
            assert sandbox.detect_isolation() == sandbox.BASIC
    finally:
        sandbox.detect_isolation.cache_clear()
    monkeypatch.undo()
    basic = ce.CodeSandboxConfig(case_timeout_s=1.0, memory_mb=256, startup_s=1.0, isolation="basic")
    truth = json.dumps({"inputs": [""], "outputs": ["survived"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a forced mode runs no probe and warns nothing
        network = ce.compute_score(py(HOSTILE["network"][0]), truth, config=basic)
        kill = ce.compute_score(
            py("import os\nos.kill(os.getppid(), 9)\nprint('survived')"), truth, config=basic
        )
    basic_count = {ce.BASIC_ISOLATION_METRIC: 1}  # the fallback is counted in every sample's metrics
    assert network == {"score": 0.0, "reward/sandbox/network_count": 1, **basic_count}
    assert kill == {"score": 0.0, "reward/sandbox/signal_count": 1, **basic_count}  # kill() itself is refused


# ---------------------------------------------------------------- through the reward manager and trainer


def test_counts_reach_the_trainers_reward_metrics(tmp_path, monkeypatch):
    tok = build_char_tokenizer(tmp_path / "tok", alphabet=string.printable)
    ok = "```python\nprint(sum(map(int, input().split())))\n```"
    loop = "```python\nwhile True: pass\n```"
    bomb = "```python\nimport os\nwhile True: os.fork()\n```"
    rows = [("q", ok, "apps", ADD), ("q", loop, "codecontests", ADD), ("q", bomb, "taco", ADD)]
    batch = make_batch(tok, rows, prompt_len=2, response_len=64)
    monkeypatch.setattr(ce, "DEFAULT_CONFIG", CFG)  # the default dispatch's limits
    manager = NaiveRewardManager(tok, num_examine=0)
    assert not manager.isolated  # the sandbox is the isolation; the scorer itself is trusted
    counts = PPOTrainer._score(SimpleNamespace(_reward=compute_reward), batch, manager)
    batched = batch_default_compute_score(["apps", "apps"], [ok, bomb], [ADD, ADD])
    scores = batch.batch["token_level_scores"].sum(-1)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 0.0]), rtol=0, atol=0)
    assert counts["reward/sandbox/timeout_count"] == 1.0
    assert counts["reward/sandbox/process_count"] == 1.0
    assert counts["reward/error_count"] == counts["reward/timeout_count"] == 0.0
    assert [b["score"] for b in batched] == [1.0, 0.0]


# ---------------------------------------------------------------- configuration


def test_reward_model_sandbox_keys_reach_the_scorer(tmp_path):
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.ppo.reward import load_reward_manager

    config = load_config(
        overrides=["reward_model.sandbox.case_timeout_s=0.5", "reward_model.sandbox.memory_mb=300"]
    )
    assert config.reward_model.sandbox == ce.CodeSandboxConfig(case_timeout_s=0.5, memory_mb=300)
    manager = load_reward_manager(config, build_char_tokenizer(tmp_path / "tok"))
    assert manager.compute_score.keywords["code_sandbox"]["memory_mb"] == 300
    assert not manager.isolated  # still the built-in scorer, run in-process
    assert ce.as_config(manager.compute_score.keywords["code_sandbox"], memory_limit_mb=64).memory_mb == 64
    for bad, key in (
        ("memory_mb=0", "memory_mb"),
        ("isolation=none", "isolation"),
        ("max_casess=3", "max_cases"),
    ):
        with pytest.raises(ConfigError, match=f"reward_model.sandbox.{key}"):
            load_config(overrides=[f"reward_model.sandbox.{bad}"])


def test_code_samples_are_scored_side_by_side_and_math_on_the_main_thread():
    import functools
    import threading

    seen = []

    def call(fn, kwargs):
        seen.append((kwargs["data_source"], threading.current_thread() is threading.main_thread()))
        return kwargs["data_source"]

    sources = ["apps", "openai/gsm8k", "taco", "codeforces", "lighteval/MATH"]
    fn = functools.partial(default_compute_score, code_sandbox={"max_workers": 2})
    assert ce.map_side_by_side(fn, [{"data_source": s} for s in sources], call) == sources  # in order
    assert sorted(seen) == sorted((s, s not in ce.CODE_SOURCES) for s in sources)
    seen.clear()  # a scorer that is not the default one: everything here, in order
    assert ce.map_side_by_side(len, [{"data_source": s} for s in sources], call) == sources
    assert seen == [(s, True) for s in sources]


def test_a_second_expired_timer_does_not_raise_again():
    """CPU and wall timers can both expire in one case; only the first raises, so the timeout is
    handled as a timeout (a second raise escaped run_case: a cpu_loop read as a harness error)."""
    from verl_megatron.utils.reward_score import code_harness

    code_harness._timer_fired = False
    with pytest.raises(code_harness._CaseTimeout):
        code_harness._on_timer(signal.SIGPROF, None)
    code_harness._on_timer(signal.SIGALRM, None)  # must not raise
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
