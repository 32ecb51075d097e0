"""Multi-turn rollouts seed each conversation from its row in the global batch (prompt p's sample
j: p * n + j), so two replicas' shares of the prompts draw what one replica drawing the whole batch
does, turn after turn, however many conversations are still live. An engine that draws as the
native one does (rollout/sampling.py's per-row seeds) stands in for the model."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout import RolloutConfig
from verl_megatron.rollout.base import RolloutEngine, assemble_output
from verl_megatron.rollout.multiturn import EnvironmentReply, MultiTurnRollout
from verl_megatron.rollout.sampling import prompt_indices, prompt_seed, prompt_uniforms, resolve_sampling

PAD, REPLY = 0, 1
BUDGET = 16


class SeededEngine(RolloutEngine):
    """Token 2 + floor(8u) for each row's uniforms u (native's seeds: the call and the row's global
    index); 8 and 9 end a turn. Log-probs are log u."""

    def __init__(self, config: RolloutConfig) -> None:
        self.config, self.calls = config, 0

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta, rows = prompts.meta_info, prompts.batch["input_ids"].shape[0]
        params = resolve_sampling(self.config, meta)
        call, self.calls = self.calls, self.calls + 1
        seeds = [prompt_seed(self.config.seed, call, i) for i in prompt_indices(meta, rows)]
        u = prompt_uniforms(seeds, params.n, int(meta["response_length"]))
        tokens = 2 + (u * 8).long()
        stopped = (tokens >= 8).long().cumsum(-1)
        mask = ((stopped - (tokens >= 8).long()) == 0).long()  # up to and including the first stop
        return assemble_output(prompts, tokens * mask, mask, u.log() * mask, params.n)


def _environment(conversation, text: str) -> EnvironmentReply:
    return (
        EnvironmentReply(done=True) if conversation.policy_turns >= 3 else EnvironmentReply(token_ids=[REPLY])
    )


def _rollout(prompt_ids: list[list[int]], offset: int) -> dict:
    config = RolloutConfig(n=2, response_length=BUDGET, seed=3)
    tokenizer = SimpleNamespace(pad_token_id=PAD, decode=lambda ids, skip_special_tokens=True: str(ids))
    rollout = MultiTurnRollout(SeededEngine(config), config, tokenizer, _environment)
    ids = torch.tensor(prompt_ids)
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info={"prompt_offset": offset}
    )
    out = rollout.generate_sequences(prompts)
    return {
        **{k: out.batch[k] for k in ("responses", "response_mask", "rollout_log_probs")},
        "turns": list(out.non_tensor_batch["multi_turn_turns"]),
    }


def test_multi_turn_shares_draw_as_the_whole_batch():
    prompts = [[3, 4], [3, 5], [3, 6], [3, 7]]
    whole = _rollout(prompts, 0)
    parts = [_rollout(prompts[:2], 0), _rollout(prompts[2:], 2)]
    shares = {
        k: torch.cat([p[k] for p in parts]) for k in ("responses", "response_mask", "rollout_log_probs")
    }
    # conversations end at different turns, so the live rows change between turns
    assert len(set(whole["turns"])) > 1 and max(whole["turns"]) > 1, whole["turns"]
    differ = (shares["responses"] != whole["responses"]).nonzero().tolist()
    assert not differ, f"two shares drew other tokens than the whole batch at (row, t) {differ[:5]}"
    assert torch.equal(shares["response_mask"], whole["response_mask"])
    assert [t for p in parts for t in p["turns"]] == whole["turns"]
    torch.testing.assert_close(shares["rollout_log_probs"], whole["rollout_log_probs"], rtol=0, atol=0)
    # the n samples of a prompt are drawn apart (distinct rows, distinct seeds)
    assert not torch.equal(whole["responses"][0], whole["responses"][1])
