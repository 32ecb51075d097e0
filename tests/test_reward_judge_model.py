"""The native judge on a separate judge model (``reward_model.judge.model_path``).

A tiny random-init llama judges three messages greedily on megatron, in one process and split
over two data-parallel ranks; its answers must be transformers' greedy answers of the same
checkpoint, and its verdicts the first digit of each answer (none: the failure score, counted
as unparsable).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import SMALL_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESSAGES = ["12", "345", "6", "7890"]
MAX_TOKENS = 3


def judge_model_job(judge_path: str) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.reward.judge import RewardJudge
    from verl_megatron.reward.judge_model import build_judge_model
    from verl_megatron.trainer.config import load_config

    config = load_config(
        os.path.join(ROOT, "configs", "quickstart.yaml"),
        [
            "reward_model.judge.enable=true",
            f"reward_model.judge.model_path={judge_path}",
            "reward_model.judge.verdict_pattern=\\d",
            f"reward_model.judge.max_tokens={MAX_TOKENS}",
            "reward_model.judge.failure_score=-1",
        ],
    )
    runtime = init_runtime(ParallelLayout(), seed=1)
    generate, tokenizer = build_judge_model(config, runtime)
    judge = RewardJudge(config.reward_model.judge, tokenizer, generate)
    return {
        "answers": judge._generate_native(MESSAGES),
        "verdicts": [(v.score, v.cause) for v in judge.judge(MESSAGES)],
    }


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory) -> str:
    from verl_megatron.trainer.quickstart import DIGITS
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    path = str(tmp_path_factory.mktemp("judge_model"))
    tokenizer = build_char_tokenizer(path, alphabet=DIGITS)
    build_tiny_hf_model(path, "llama", tokenizer=tokenizer, **SMALL_MODEL, seed=1)
    return path


@pytest.fixture(scope="module")
def hf_answers(judge_path) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(judge_path)
    model = AutoModelForCausalLM.from_pretrained(judge_path, dtype=torch.float32).eval()
    answers = []
    for message in MESSAGES:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


@pytest.mark.parametrize("ranks", [1, 2])
def test_separate_judge_model_answers_like_transformers(pool1, pool2, judge_path, hf_answers, ranks):
    results = (pool1 if ranks == 1 else pool2).run(f"{__name__}:judge_model_job", judge_path=judge_path)
    assert len(set(hf_answers)) > 1 and "" in hf_answers  # seed 1: different answers, one without a digit
    for result in results:  # every rank holds the whole batch's answers
        assert result["answers"] == hf_answers
        expected = [(float(a[0]), None) if a[:1].isdigit() else (-1.0, "unparsable") for a in hf_answers]
        assert result["verdicts"] == expected
