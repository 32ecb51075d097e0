"""A model's generation_config.json eos list stops the rollout, not only the tokenizer's eos.

Chat checkpoints list every end-of-turn token there (Qwen2.5-Instruct [151645, 151643],
Llama-3.1-Instruct [128001, 128008, 128009]) while their tokenizer names one. The end-to-end
case decodes greedily with the tiny peaked Llama of ``test_rollout_native``; a copy of that
checkpoint whose generation_config.json lists [EOS, X], X the third token of row 0's greedy
answer, must end row 0 right after X.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from tests.test_rollout_native import EOS, PAD, prompt_batch, save_peaked_llama

RESPONSE_LENGTH = 12


def _write_generation_config(path, eos_token_id) -> None:
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=eos_token_id, pad_token_id=PAD).save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("eos_llama") / "model"
    save_peaked_llama(path)
    return str(path)


def greedy_job(model_dir: str) -> dict:
    """Greedy responses of the native engine on the checkpoint in ``model_dir``."""
    from transformers import AutoConfig

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.rollout import RolloutConfig, build_rollout

    runtime = init_runtime(ParallelLayout(tp=1, pp=1), seed=11)
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model_cfg = ModelConfig(path=model_dir, dtype="float32", use_te=False)
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, model_dir, runtime, model_cfg)
    config = RolloutConfig(prompt_length=8, response_length=RESPONSE_LENGTH)
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    engine = build_rollout(config, runtime, chunks, tokenizer, hf_config)
    out = engine.generate_sequences(prompt_batch(meta={"do_sample": False}))
    return {"responses": out.batch["responses"].clone(), "response_mask": out.batch["response_mask"].clone()}


def test_generation_config_eos_list_stops_the_rollout(pool1, model_dir, tmp_path):
    (plain,) = pool1.run(f"{__name__}:greedy_job", model_dir=model_dir)
    row = plain["responses"][0].tolist()
    # Without the list, row 0 runs past its third token.
    assert int(plain["response_mask"][0].sum()) > 3, row
    stop = row[2]
    assert stop not in (EOS, PAD) and stop not in row[:2], row

    listed = tmp_path / "model_with_eos_list"
    shutil.copytree(model_dir, listed)
    _write_generation_config(listed, [EOS, stop])
    (got,) = pool1.run(f"{__name__}:greedy_job", model_dir=str(listed))
    assert got["responses"][0, :3].tolist() == row[:3]
    assert got["response_mask"][0].tolist() == [1, 1, 1] + [0] * (RESPONSE_LENGTH - 3)
    assert got["responses"][0, 3:].tolist() == [PAD] * (RESPONSE_LENGTH - 3)
    # Every row ends at its first EOS or X, and equals the unstopped row up to there.
    for i in range(got["responses"].shape[0]):
        full = plain["responses"][i].tolist()
        ends = [j for j, t in enumerate(full[: int(plain["response_mask"][i].sum())]) if t in (EOS, stop)]
        length = ends[0] + 1 if ends else int(plain["response_mask"][i].sum())
        assert int(got["response_mask"][i].sum()) == length, (i, full)
        assert got["responses"][i, :length].tolist() == full[:length]


def test_stop_ids_join_tokenizer_config_and_generation_config(tmp_path):
    from verl_megatron.rollout import RolloutConfig
    from verl_megatron.rollout.base import stop_token_ids

    _write_generation_config(tmp_path, [151645, 151643])
    hf_config = SimpleNamespace(_name_or_path=str(tmp_path), eos_token_id=151645)
    tokenizer = SimpleNamespace(eos_token_id=151645)
    config = RolloutConfig(stop_token_ids=[7])
    assert stop_token_ids(config, {}, tokenizer, hf_config) == [7, 151643, 151645]
    # The batch's own eos still overrides; ignore_eos drops every eos.
    assert stop_token_ids(config, {"eos_token_id": 3}, tokenizer, hf_config) == [3, 7]
    assert stop_token_ids(RolloutConfig(ignore_eos=True), {}, tokenizer, hf_config) == []
    # No generation_config.json (or no folder): the tokenizer's and config's eos only.
    bare = SimpleNamespace(_name_or_path=str(tmp_path / "none"), eos_token_id=[128001, 128009])
    assert stop_token_ids(RolloutConfig(), {}, SimpleNamespace(eos_token_id=128009), bare) == [128001, 128009]


def test_the_trainers_generate_meta_keeps_the_generation_config_eos_list(tmp_path):
    """The meta the trainer, the async rollout ranks and the judge pass (``generation_meta``) names
    no eos, so the model's whole list stops generation (they passed the tokenizer's one eos, which
    overrode it: Llama-3.1-Instruct ran on past 128001 and 128008)."""
    from verl_megatron.rollout import RolloutConfig
    from verl_megatron.rollout.base import generation_meta, stop_token_ids

    _write_generation_config(tmp_path, [128001, 128008, 128009])
    hf_config = SimpleNamespace(_name_or_path=str(tmp_path), eos_token_id=128001)
    tokenizer = SimpleNamespace(eos_token_id=128009, pad_token_id=128004)
    meta = generation_meta(tokenizer)
    assert meta == {"pad_token_id": 128004}
    assert stop_token_ids(RolloutConfig(), meta, tokenizer, hf_config) == [128001, 128008, 128009]


def test_unreadable_generation_config_is_named(tmp_path):
    from verl_megatron.rollout.base import generation_eos_ids

    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json cannot be read"):
        generation_eos_ids(str(tmp_path))
