"""Bad input a user can fix gets one ``error:`` line on stderr and exit status 2, before any
process group or model exists; the same under torchrun (one line for the whole job)."""

from __future__ import annotations

import json

import pytest

from tests.inprocess_launch import run_cli, warm_ranks
from verl_megatron import cli


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """A tiny llama with a chat template, the same without one, and data files good and bad."""
    from verl_megatron.data.synthetic import write_synthetic_dataset
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    root = tmp_path_factory.mktemp("assets")
    paths = {}
    for name, template in (("model", "default"), ("no_template", None)):
        kwargs = {} if template == "default" else {"chat_template": None}
        tokenizer = build_char_tokenizer(root / f"{name}_tok", alphabet="0123456789", **kwargs)
        build_tiny_hf_model(root / name, "llama", hidden_size=16, num_heads=2, num_kv_heads=2,
                            num_layers=2, intermediate_size=32, tokenizer=tokenizer)  # fmt: skip
        paths[name] = str(root / name)
    write_synthetic_dataset(root / "data", task="reverse", num_digits=2, seed=0)
    import pyarrow.parquet as pq

    rows = pq.read_table(root / "data" / "train.parquet").to_pylist()
    lines = [json.dumps(r) for r in rows]

    def write(name: str, text: str) -> None:
        (root / name).write_text(text)
        paths[name] = str(root / name)

    write("good.jsonl", "\n".join(lines) + "\n")
    write("bad_json.jsonl", "\n".join([*lines[:3], "{not json", *lines[3:]]) + "\n")
    write(
        "missing_field.jsonl", "\n".join([*lines[:2], json.dumps({**rows[0], "reward_model": None})]) + "\n"
    )
    write("wrong_type.jsonl", "\n".join([*lines[:2], json.dumps({**rows[0], "prompt": "a string"})]) + "\n")
    write("empty.jsonl", "")
    write("data.csv", "a,b\n")
    write("not.parquet", "not a parquet file")
    write("bad.yaml", "data:\n  train_batch_size: [1, 2\n")
    write("list.yaml", "- a\n- b\n")
    paths["train"] = str(root / "data" / "train.parquet")
    paths["val"] = str(root / "data" / "val.parquet")
    paths["dir"] = str(root / "data")
    paths["out"] = str(root / "out")
    return paths


def _base(assets: dict[str, str]) -> list[str]:
    return [
        f"model.path={assets['model']}",
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['val']}",
        "data.train_batch_size=8",
        "data.max_response_length=3",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "trainer.total_training_steps=1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={assets['out']}",
    ]


def _one_error_line(rc: int, capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert rc == 2, captured.err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err[-2000:]
    return lines[0]


def _train_error(assets, overrides, capsys, config: str | None = None) -> str:
    argv = ["train", *(["--config", config] if config else []), *_base(assets), *overrides]
    return _one_error_line(cli.main(argv), capsys)


# (case, overrides or a callable of the asset paths, text the error line must contain)
TRAIN_CASES = [
    ("data file missing", lambda a: ["data.train_files=/no/such.parquet"], "'/no/such.parquet' does not exist"),
    ("invalid JSON line", lambda a: [f"data.train_files={a['bad_json.jsonl']}"], "bad_json.jsonl: line 4 is not valid JSON"),
    ("row missing a field", lambda a: [f"data.train_files={a['missing_field.jsonl']}"], "row 2: missing field 'reward_model'"),
    ("field of the wrong type", lambda a: [f"data.train_files={a['wrong_type.jsonl']}"], "row 2: field 'prompt' must be a non-empty list"),
    ("empty data file", lambda a: [f"data.train_files={a['empty.jsonl']}"], "empty.jsonl' has no rows"),
    ("unsupported extension", lambda a: [f"data.train_files={a['data.csv']}"], "unsupported extension"),
    ("directory as data file", lambda a: [f"data.train_files={a['dir']}"], "is a directory"),
    ("not a parquet file", lambda a: [f"data.train_files={a['not.parquet']}"], "is not a readable parquet file"),
    ("val file missing", lambda a: ["data.val_files=/no/val.jsonl"], "'/no/val.jsonl' does not exist"),
    ("batch larger than the data", lambda a: ["data.train_batch_size=200", "actor.ppo_mini_batch_size=200"],
     "data.train_batch_size=200 is larger than the 80 rows"),
    ("data.truncation unknown", lambda a: ["data.truncation=foo"], "data.truncation"),
    ("wandb not installed", lambda a: ["trainer.logger=[console,wandb]"], "'wandb' package is not installed"),
    ("vllm not installed", lambda a: ["rollout.name=vllm"], "rollout.name='vllm' needs the 'vllm' package"),
    ("sglang not installed", lambda a: ["rollout.name=sglang"], "rollout.name='sglang' needs the 'sglang' package"),
    ("unknown rollout engine", lambda a: ["rollout.name=foo"], "rollout.name must be one of"),
    ("model.dtype=fp8", lambda a: ["model.dtype=fp8"], "model.dtype must be one of"),
    ("lr=nan", lambda a: ["actor.optim.lr=nan"], "actor.optim.lr must be a finite number, got nan"),
    ("lr=inf on the critic", lambda a: ["critic.optim.lr=inf"], "critic.optim.lr must be a finite number"),
    ("lr not a number", lambda a: ["actor.optim.lr=abc"], "config key 'actor.optim.lr'"),
    ("malformed YAML override", lambda a: ["trainer.logger=[console"], "override 'trainer.logger=[console' is not valid YAML"),
    ("negative batch", lambda a: ["data.train_batch_size=-1"], "data.train_batch_size"),
    ("unknown estimator", lambda a: ["algorithm.adv_estimator=foo"], "algorithm.adv_estimator='foo' is not registered"),
    ("unknown loss mode", lambda a: ["actor.policy_loss.loss_mode=foo"], "loss_mode"),
    ("model.path missing", lambda a: ["model.path=/no/model"], "model.path='/no/model' does not exist"),
    ("model.path a file", lambda a: [f"model.path={a['good.jsonl']}"], "is not a directory"),
    ("resume path missing", lambda a: ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/no/ckpt"],
     "trainer.resume_from_path='/no/ckpt' does not exist"),
    ("deprecated rollout.log_prob_micro_batch_size", lambda a: ["rollout.log_prob_micro_batch_size=8"],
     "set rollout.log_prob_micro_batch_size_per_gpu"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "overrides", "expected"), TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_input_errors_are_one_line_before_the_runtime(
    case, overrides, expected, assets, capsys, no_runtime
):
    line = _train_error(assets, overrides(assets), capsys)
    assert expected in line, line


@pytest.mark.parametrize("value", ["two", "0", "-1", ""])
def test_a_bad_omp_num_threads_is_one_line_and_an_empty_one_means_one(
    value, assets, capsys, no_runtime, monkeypatch
):
    """A typo in OMP_NUM_THREADS was an int() traceback from every rank; empty (``OMP_NUM_THREADS=``
    on a command line) crashed the same way although it means "unset"."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    threads = torch.get_num_threads()
    try:
        if value:
            line = _one_error_line(cli.main(["train", *_base(assets)]), capsys)
            assert f"OMP_NUM_THREADS={value!r} in the environment is not a positive number" in line, line
        else:  # no error of its own: the run goes on to start the runtime, which the fixture refuses
            with pytest.raises(AssertionError, match="init_runtime reached"):
                cli.main(["train", *_base(assets)])
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bad.yaml", "is not valid YAML at line 3, column 1"),
        ("list.yaml", "the top level must be a mapping"),
        ("dir", "is not a file"),
        ("/no/such.yaml", "config file '/no/such.yaml' does not exist"),
    ],
)
def test_config_file_errors(name, expected, assets, capsys, no_runtime):
    line = _one_error_line(cli.main(["train", "--config", assets.get(name, name)]), capsys)
    assert expected in line, line


def test_tokenizer_without_chat_template_names_path_and_fix(assets):
    from verl_megatron.data import DataConfig, DataFormatError, RLHFDataset
    from verl_megatron.utils.tokenizer import hf_tokenizer

    tokenizer = hf_tokenizer(assets["no_template"])
    with pytest.raises(DataFormatError) as err:
        RLHFDataset(assets["train"], tokenizer, DataConfig(max_prompt_length=8))
    assert assets["no_template"] in str(err.value)
    assert "data.apply_chat_template_kwargs.chat_template" in str(err.value)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config = DataConfig(max_prompt_length=8, apply_chat_template_kwargs={"chat_template": template})
    assert len(RLHFDataset(assets["train"], tokenizer, config)) == 80


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: __import__("verl_megatron.checkpoint", fromlist=["x"]).CheckpointMismatchError(
            "checkpoint /c/global_step_1/actor does not fit this model: 3 tensor(s) differ in shape"
        ),
        lambda: __import__("verl_megatron.data.dataset", fromlist=["x"]).DataOrderMismatchError(
            "the checkpoint's data order was drawn with seed 0, this run uses 5"
        ),
    ],
    ids=["checkpoint of another model", "data seed changed on resume"],
)
def test_resume_errors_raised_while_training_are_one_line(make_error, monkeypatch, capsys):
    """Errors found once the checkpoint is read (after the model exists) still end as one line."""
    from verl_megatron import train

    error = make_error()

    def run(config_path, overrides):
        raise error

    monkeypatch.setattr(train, "run", run)
    for key in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    line = _one_error_line(cli.main(["train"]), capsys)
    assert line == f"error: {error}"
    # Under torchrun only rank 0 prints; every rank exits with 2.
    monkeypatch.setenv("RANK", "1")
    assert train.main([]) == 2 and capsys.readouterr().err == ""


def test_data_seed_mismatch_is_a_user_error():
    from verl_megatron.data.dataset import DataOrderMismatchError, PromptLoader
    from verl_megatron.errors import is_user_error

    loader = PromptLoader([0] * 8, 4, shuffle=True, seed=1, pad_token_id=0)
    with pytest.raises(DataOrderMismatchError, match="drawn with seed 0, this run uses 1") as err:
        loader.load_state_dict({"seed": 0, "epoch": 0, "batch_in_epoch": 1})
    assert is_user_error(err.value)


def test_bugs_keep_their_traceback(monkeypatch):
    from verl_megatron import train

    def run(config_path, overrides):
        raise KeyError("a bug")

    monkeypatch.setattr(train, "run", run)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(KeyError):
        cli.main(["train"])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["/no/model"], "checkpoint folder '/no/model' does not exist"),
        (["{model}", "--tp", "3"], "--tp 3 --pp 1: num_attention_heads=2 is not divisible by tp=3"),
        (["{model}", "--tp", "0"], "--tp, --pp, --ep and --etp must be positive"),
    ],
)
def test_check_hf_arguments_checked_before_launching(args, expected, assets, capsys, monkeypatch):
    import verl_megatron.tools.check_hf as check_hf

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(check_hf, "_launch", lambda *a: pytest.fail("torchrun launched"))
    monkeypatch.setattr(check_hf, "run_check", lambda *a: pytest.fail("model built"))
    argv = ["check-hf", *(a.format(model=assets["model"]) for a in args)]
    line = _one_error_line(cli.main(argv), capsys)
    assert expected in line, line


@pytest.mark.multiproc
def test_error_inside_torchrun_workers_is_one_line(assets, tmp_path, monkeypatch, capfd):
    """The tokenizer is loaded by the workers: each fails, the launcher prints one line. (The
    launcher's ranks are forked from a warm process: what they run is the CLI's command line.)"""
    overrides = [*_base(assets), f"model.path={assets['no_template']}", "trainer.n_gpus_per_node=2",
                 f"trainer.default_local_dir={tmp_path}"]  # fmt: skip
    with warm_ranks(str(tmp_path)) as env:
        result = run_cli(["train", *overrides], monkeypatch, capfd, env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and assets["no_template"] in errors[0], result.stderr[-3000:]
