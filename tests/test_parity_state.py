"""Bitwise parity keeps no state between model calls (issue 29).

Under ``rollout.bitwise_parity`` a packed training row gets rotary positions that restart at 0
in every sequence. Those positions must be an input of that one forward: a decoder built after
a training step still needs the rotary table of positions 0..L-1. Here a training forward (with
backward) of one packed row of two 8-token sequences runs between two decoder constructions;
both decoders must hold the same rotary table and give the same prefill logits. (Positions kept
on the rotary module by the last forward would give the second decoder the table of
[0..7, 0..7] instead.)
"""

from __future__ import annotations

import pytest
import torch

from tests.test_actor_update import VOCAB, build_hf_model, build_model

KEY_LENGTH = 16  # a multiple of 16: the decoder's cache is exactly this wide
PROMPT_LENGTHS = [12, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("parity_state_llama")
    build_hf_model(str(path))
    return str(path)


def _prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts: ids [B, 12], positions [B, 12], key_valid [B, KEY_LENGTH]."""
    g = torch.Generator().manual_seed(0)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), width, dtype=torch.long)
    key_valid = torch.ones(len(PROMPT_LENGTHS), KEY_LENGTH, dtype=torch.bool)
    for row, n in enumerate(PROMPT_LENGTHS):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        key_valid[row, : width - n] = False
    positions = (key_valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
    return ids, positions, key_valid


def _packed_training_step(chunk: torch.nn.Module) -> None:
    """Forward + backward of one packed row [1, 16]: two sequences of 8 tokens, positions
    [0..7, 0..7], block-causal mask (True = hidden), as the model runner lays out packed rows."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (1, KEY_LENGTH), generator=g)
    positions = torch.arange(8).repeat(2).unsqueeze(0)
    segment = torch.arange(2).repeat_interleave(8)
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(
        KEY_LENGTH, KEY_LENGTH, dtype=torch.bool
    ).tril()
    chunk.train()
    output = chunk(ids, positions, (~allowed).view(1, 1, KEY_LENGTH, KEY_LENGTH))
    output.float().sum().backward()


def state_job(path: str) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models import batch_invariant
    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.rollout.decode import ChunkDecoder, inference_mode_for

    runtime = init_runtime(ParallelLayout(), seed=3)
    chunks = build_model(runtime, path, route=MatmulRoute())  # parity's kernels run through the route
    invariance = batch_invariant.enable(chunks, KEY_LENGTH)
    ids, positions, key_valid = _prompts()

    def decode() -> dict:
        with inference_mode_for(chunks) as bare:
            decoder = ChunkDecoder(bare, runtime, len(PROMPT_LENGTHS), KEY_LENGTH, VOCAB, invariance)
            logits = decoder.step(ids, positions, key_valid, start=0)[:, :VOCAB]
        return {"cos": decoder.cos.clone(), "sin": decoder.sin.clone(), "logits": logits.clone()}

    before = decode()
    _packed_training_step(chunks[0])
    after = decode()
    return {"before": before, "after": after}


def test_training_forward_leaves_the_decoders_rotary_table_alone(pool1, model_dir):
    out = pool1.run(f"{__name__}:state_job", path=model_dir)[0]
    before, after = out["before"], out["after"]
    assert before["cos"].shape[0] == KEY_LENGTH
    for name in ("cos", "sin"):
        assert torch.equal(before[name], after[name]), (
            f"decoder rotary {name} changed after a packed training forward: rows differ at "
            f"{torch.nonzero((before[name] != after[name]).any(-1)).flatten().tolist()}"
        )
    assert torch.equal(before["logits"], after["logits"])
