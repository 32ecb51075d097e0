"""reward_model.combine (a checked arithmetic expression) and the start-up errors of model rewards."""

from __future__ import annotations

import pytest
import torch

from verl_megatron.errors import UserInputError
from verl_megatron.reward.combine import FormulaError, compile_formula, place_at_last_token


def test_formula_values():
    rule, rm, judge = (
        torch.tensor([1.0, 0.0, -2.0]),
        torch.tensor([0.5, 3.0, 1.0]),
        torch.tensor([0.0, 1.0, 2.0]),
    )
    f = compile_formula("rule + 0.5 * rm - judge / 2")
    assert f.names == {"rule", "rm", "judge"}
    torch.testing.assert_close(f(rule=rule, rm=rm, judge=judge), (rule + 0.5 * rm - judge / 2).double())
    g = compile_formula("clip(rm, -1, 1) + max(rule, 0) * sigmoid(judge) - abs(-tanh(rm))")
    expected = rm.clamp(-1, 1) + rule.clamp(min=0) * torch.sigmoid(judge) - torch.tanh(rm).abs()
    torch.testing.assert_close(g(rule=rule, rm=rm, judge=judge), expected.double())
    assert compile_formula("rm").names == {"rm"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("rule + rn", "unknown name 'rn' (known: rule, rm, judge)"),
        ("__import__('os').system('x')", "unknown function"),
        ("rm.real", "'rm.real' is not allowed"),
        ("rm if rule else 0", "is not allowed"),
        ("rm ** 2", "is not allowed"),
        ("clip(rm, 0)", "clip() takes 3 positional argument(s)"),
        ("'a' + rm", "is not a number"),
        ("rm +", "does not parse"),
    ],
)
def test_formula_rejects(text, needle):
    with pytest.raises(FormulaError) as err:
        compile_formula(text)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_place_at_last_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = place_at_last_token(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [5.0, 0.0, 0.0]]


def test_place_at_last_token_skips_masked_environment_tokens():
    # A multi-turn row: environment tokens (mask 0) inside the response; the reward goes on
    # the last token the policy wrote (column 5), not at mask.sum() - 1 = 3 (a masked token).
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0, 0, 1]])
    out = place_at_last_token(torch.tensor([3.0, 4.0]), mask)
    assert out.nonzero().tolist() == [[0, 5], [1, 7]]
    assert out[0, 5].item() == 3.0 and out[1, 7].item() == 4.0


# ------------------------------------------------------------------ start-up errors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from verl_megatron.utils.local_assets import (
        build_char_tokenizer,
        build_tiny_hf_model,
        build_tiny_reward_model,
    )

    root = tmp_path_factory.mktemp("rm_ckpts")
    tok = build_char_tokenizer(root / "tok")
    shape = dict(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    build_tiny_reward_model(root / "rm", "llama", tokenizer=tok, **shape)
    build_tiny_hf_model(root / "lm", "llama", tokenizer=tok, **shape)
    build_tiny_reward_model(root / "rm3", "llama", tokenizer=tok, num_labels=3, **shape)
    return {name: str(root / name) for name in ("rm", "lm", "rm3")}


@pytest.fixture(scope="module")
def base_config():
    from verl_megatron.trainer.config import default_config_path, load_config

    return load_config(default_config_path(), [])


def _with(config, overrides: list[str]):
    """A copy of ``config`` with dotted ``key=value`` overrides set on the dataclasses (no reload)."""
    import copy
    import dataclasses

    import yaml

    config = copy.deepcopy(config)
    for item in overrides:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        nodes = [config]
        for name in parents:
            nodes.append(getattr(nodes[-1], name))
        parsed = yaml.safe_load(value) if value[:1] not in "({" else value
        if type(nodes[-1]).__dataclass_params__.frozen:  # ParallelLayout: replace the node
            setattr(nodes[-2], parents[-1], dataclasses.replace(nodes[-1], **{leaf: parsed}))
        else:
            setattr(nodes[-1], leaf, parsed)
    return config


def test_start_up_check_runs_in_validate_config(checkpoints):
    from verl_megatron.trainer.config import default_config_path, load_config, validate_config

    good = [
        "reward_model.enable=true",
        f"reward_model.model.path={checkpoints['rm']}",
        "reward_model.combine=rule+rm",
    ]
    validate_config(load_config(default_config_path(), good), world_size=1)
    with pytest.raises(UserInputError, match="unknown name 'rmm'"):
        validate_config(
            load_config(default_config_path(), [*good, "reward_model.combine=rule + rmm"]), world_size=1
        )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["reward_model.enable=true", "reward_model.model.path=/nowhere/rm"], "reward_model.model.path='/nowhere/rm' does not exist"),
        (["reward_model.enable=true", "reward_model.model.path={lm}"], "is not a sequence-classification checkpoint (architectures ['LlamaForCausalLM'])"),
        (["reward_model.enable=true", "reward_model.model.path={rm3}"], "has 3 labels"),
        (["reward_model.enable=true", "reward_model.model.path={rm}", "reward_model.combine=rule + rmm"], "unknown name 'rmm' (known: rule, rm, judge); did you mean 'rm'?"),
        (["reward_model.combine=rule + rm"], "uses 'rm' but reward_model.enable is false"),
        (["reward_model.enable=true", "reward_model.model.path={rm}", "reward_model.parallel.tp=3"], "reward_model.parallel:"),
        (["reward_model.enable=true", "reward_model.model.path={rm}", "reward_model.parallel.cp=2"], "reward_model.parallel.cp > 1 needs"),
        (["reward_model.enable=true", "reward_model.model.path={rm}", "reward_model.truncation=middle"], "reward_model.truncation='middle'"),
        (["reward_model.enable=true", "reward_model.model.path={rm}", "reward_model.model.input_tokenizer={rm}"], "data.return_raw_chat=true"),
        (["reward_model.judge.enable=true", "reward_model.judge.backend=openai", "reward_model.judge.url=localhost:8000"], "reward_model.judge.url: 'localhost:8000' is not an http(s)://host[:port] URL"),
        (["reward_model.judge.enable=true", "reward_model.judge.backend=openai"], "needs reward_model.judge.url"),
        (["reward_model.judge.enable=true", "reward_model.judge.model_path=/nowhere/judge"], "reward_model.judge.model_path='/nowhere/judge' does not exist"),
        (["reward_model.judge.enable=true", "reward_model.judge.backend=vllm"], "reward_model.judge.backend='vllm'"),
        (["reward_model.judge.enable=true", "reward_model.judge.prompt_template=Rate {answer}"], "uses {answer}"),
        (["reward_model.judge.enable=true", "reward_model.judge.verdict_pattern=(unclosed"], "verdict_pattern does not compile"),
    ],
)  # fmt: skip
def test_bad_model_reward_config_is_one_named_line(base_config, checkpoints, overrides, needle):
    from verl_megatron.reward.model_rewards_check import check_model_rewards

    for name, path in checkpoints.items():
        overrides = [o.replace("{" + name + "}", path) for o in overrides]
    with pytest.raises(UserInputError) as err:
        check_model_rewards(_with(base_config, overrides), world_size=1)
    message = str(err.value)
    assert needle in message and "\n" not in message, message
