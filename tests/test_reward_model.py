"""The discriminative reward model: transformers' scores, the same scores under every layout.

A tiny random-init LlamaForSequenceClassification (char tokenizer, pad id 0) scores a batch of
five prompt + response rows, some of them ending in pad-id tokens (transformers reads the
score at the last token that is not the pad token). The single-process run is compared with
``AutoModelForSequenceClassification``; runs with the reward model at tp=2 and pp=2 (its own
parallel state beside an actor at dp=2) and at dp=2 (the actor's own state) are compared with
the single-process run.
"""

from __future__ import annotations

import pytest
import torch

from tests.closeness import assert_close_report
from tests.helpers import SMALL_MODEL

# Measured max abs diff against one process, float32, scores up to 10: tp=2 1.4e-6, dp=2 9.5e-7, pp=2 0.
LAYOUT_ATOL = 1e-5
HF_ATOL = 1e-4


def make_batch() -> dict:
    """input_ids [5, 6+5]: left-padded prompts, right-padded responses; rows 1 and 3 end in pad ids."""
    g = torch.Generator().manual_seed(0)
    prompt_lengths, response_lengths = [6, 3, 4, 1, 5], [5, 2, 4, 3, 1]
    ids = torch.zeros((5, 11), dtype=torch.long)
    mask = torch.zeros((5, 11), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        ids[i, 6 - p : 6] = torch.randint(5, 60, (p,), generator=g)
        ids[i, 6 : 6 + r] = torch.randint(5, 60, (r,), generator=g)
        mask[i, 6 - p : 6 + r] = 1
    ids[1, 6 + 1] = 0  # the response's last token is the pad id: the score is read before it
    ids[3, 6 + 1 : 6 + 3] = 0
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 6:]}


VARIANTS = {
    "packed": {"use_remove_padding": True, "micro_batch_size_per_gpu": 2},
    "padded": {"use_remove_padding": False, "micro_batch_size_per_gpu": 3},
    "dynamic": {"use_remove_padding": True, "use_dynamic_bsz": True, "forward_max_token_len_per_gpu": 12},
}


def rm_job(path: str, tp: int, pp: int, actor_tp: int = 1) -> dict:
    from megatron.core import parallel_state as ps

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.protocol import DataProto
    from verl_megatron.reward.model import MegatronRewardModel
    from verl_megatron.reward.model_config import ModelRewardSettings, RewardModelModelConfig

    runtime = init_runtime(ParallelLayout(tp=actor_tp), seed=3)
    actor_state = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())
    out: dict = {}
    for name, settings in VARIANTS.items():
        cfg = ModelRewardSettings(
            enable=True,
            model=RewardModelModelConfig(path=path, dtype="float32"),
            parallel=ParallelLayout(tp=tp, pp=pp),
            **settings,
        )
        rm = MegatronRewardModel(runtime, cfg)
        try:
            out[name] = rm.compute_rm_score(DataProto.from_dict(make_batch()))
            out[f"{name}/slot"] = rm.slot is not None
        finally:
            rm.close()
    # The actor's parallel state is back in place, groups intact.
    out["actor_state_after"] = (ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size())
    out["actor_state_before"] = actor_state
    return out


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_reward_model

    path = str(tmp_path_factory.mktemp("tiny_rm"))
    tokenizer = build_char_tokenizer(path)
    build_tiny_reward_model(path, "llama", tokenizer=tokenizer, **SMALL_MODEL, seed=1)
    return path


@pytest.fixture(scope="module")
def reference(pool1, rm_path) -> dict:
    (result,) = pool1.run(f"{__name__}:rm_job", path=rm_path, tp=1, pp=1)
    return result


def test_scores_match_transformers_sequence_classification(reference, rm_path):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    batch = make_batch()
    expected = []
    with torch.no_grad():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            expected.append(float(model(input_ids=ids[mask.bool()].unsqueeze(0)).logits[0, 0]))
    expected = torch.tensor(expected)
    assert expected.std() > 0.1  # scores that differ: a wrong row or position shows
    for name in VARIANTS:
        assert_close_report(reference[name], expected, rtol=0, atol=HF_ATOL, what=f"rm scores ({name}) vs HF")
    # Reading at the last token instead of the last non-pad token would give other numbers.
    with torch.no_grad():
        ids = batch["input_ids"][1][batch["attention_mask"][1].bool()]
        at_pad = float(
            model.model(input_ids=ids.unsqueeze(0)).last_hidden_state[0, -1] @ model.score.weight[0]
        )
    assert abs(at_pad - float(reference["packed"][1])) > 1e-3


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_layouts_match_single_process(pool2, reference, rm_path, tp, pp):
    ranks = pool2.run(f"{__name__}:rm_job", path=rm_path, tp=tp, pp=pp)
    for rank, result in enumerate(ranks):
        assert result["actor_state_after"] == result["actor_state_before"] == (1, 2), rank
        for name in VARIANTS:
            assert result[f"{name}/slot"] == ((tp, pp) != (1, 1))
            assert_close_report(
                result[name],
                reference[name],
                rtol=0,
                atol=LAYOUT_ATOL,
                what=f"rank {rank} tp={tp} pp={pp} {name}",
            )


# ------------------------------------------------------------------ check-hf on reward models


def check_hf_job(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from verl_megatron.tools import check_hf

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = check_hf.main(argv)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def qwen2_rm_path(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_bpe_tokenizer, build_tiny_reward_model

    path = str(tmp_path_factory.mktemp("tiny_qwen2_rm"))
    tokenizer = build_bpe_tokenizer(path, vocab_size=300)
    build_tiny_reward_model(path, "qwen2", tokenizer=tokenizer, **SMALL_MODEL, seed=2)
    return path


def _reported_diff(line: str) -> float:
    return float(line.split("max |score diff| = ")[1].split()[0])


@pytest.mark.parametrize(("family", "tp", "pp"), [("qwen2", 1, 1), ("qwen2", 2, 1), ("llama", 1, 2)])
def test_check_hf_compares_reward_scores(pool1, pool2, rm_path, qwen2_rm_path, family, tp, pp):
    path = qwen2_rm_path if family == "qwen2" else rm_path
    pool = pool1 if tp * pp == 1 else pool2
    results = pool.run(f"{__name__}:check_hf_job", argv=[path, "--tp", str(tp), "--pp", str(pp)])
    assert [status for status, _ in results] == [0] * len(results), results
    (line,) = [text.strip() for _, text in results if text.strip()]
    assert "(reward model)" in line and line.endswith("(tolerance 0.0001): OK"), line
    assert _reported_diff(line) < 1e-4


def nan_check_hf_job(argv: list[str]) -> tuple[int, str]:
    """check_hf_job with one NaN in the transformers scores that rank 0 compares against."""
    from verl_megatron.tools import check_reward_head

    original = check_reward_head.hf_scores

    def with_nan(*args, **kwargs):
        scores = original(*args, **kwargs).clone()
        scores[1] = float("nan")
        return scores

    check_reward_head.hf_scores = with_nan  # this worker process only, restored below
    try:
        return check_hf_job(argv)
    finally:
        check_reward_head.hf_scores = original


def test_check_hf_fails_on_a_nan_reward_score(pool2, qwen2_rm_path):
    """A NaN on rank 0 must not vanish in the MAX all-reduce against the other rank's 0."""
    results = pool2.run(f"{__name__}:nan_check_hf_job", argv=[qwen2_rm_path, "--tp", "2"])
    assert [status for status, _ in results] == [1, 1], results


# ------------------------------------------------------------------ inputs


def test_conversation_ids_retemplate_with_the_reward_models_tokenizer(tmp_path):
    import numpy as np

    from verl_megatron.protocol import DataProto
    from verl_megatron.reward.model import conversation_ids, score_positions
    from verl_megatron.utils.local_assets import build_bpe_tokenizer, build_char_tokenizer

    actor_tok = build_char_tokenizer(tmp_path / "actor")
    rm_tok = build_bpe_tokenizer(tmp_path / "rm", vocab_size=300)
    chats = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Hi"}]]
    answers = ["5", "Hello there"]
    tr = max(len(a) for a in answers) + 1
    responses = torch.zeros((2, tr), dtype=torch.long)
    mask = torch.zeros((2, 4 + tr), dtype=torch.long)
    for i, a in enumerate(answers):
        ids = actor_tok(a)["input_ids"] + [actor_tok.eos_token_id]
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, 4 - 1 : 4 + len(ids)] = 1
    batch = DataProto.from_dict(
        {
            "input_ids": torch.cat([torch.full((2, 4), 7), responses], 1),
            "attention_mask": mask,
            "responses": responses,
        },
        non_tensors={"raw_prompt": np.array(chats, dtype=object)},
    )
    got = conversation_ids(batch, rm_tok, actor_tok)
    for i in range(2):
        text = rm_tok.apply_chat_template(
            [*chats[i], {"role": "assistant", "content": answers[i]}],
            tokenize=False,
            add_generation_prompt=False,
        )
        assert got[i] == rm_tok(text, add_special_tokens=False)["input_ids"]
        assert rm_tok.decode(got[i]).endswith(f"{answers[i]}<|im_end|>\n")
    # max_length keeps the end (left) or the start (right) of a long conversation.
    full = got[1]
    assert conversation_ids(batch, rm_tok, actor_tok, max_length=5, truncation="left")[1] == full[-5:]
    assert conversation_ids(batch, rm_tok, actor_tok, max_length=5, truncation="right")[1] == full[:5]
    with pytest.raises(ValueError, match=r"reward_model\.max_length=5"):
        conversation_ids(batch, rm_tok, actor_tok, max_length=5, truncation="error")
    # Without raw_prompt there is no chat to re-template.
    with pytest.raises(KeyError, match=r"data\.return_raw_chat=true"):
        conversation_ids(DataProto.from_dict(dict(batch.batch)), rm_tok, actor_tok)
    # transformers' reading position: the last token that is not the pad id.
    assert score_positions([5, 0, 6, 0, 0], 0) == 3
    assert score_positions([0, 0], 0) == 1 and score_positions([5, 0], None) == 2
