"""``async_training.old_log_probs_on_rollout``: old log-probs split between the trainer and a rollout
rank's model copy are the actor's own.

The job runs tests/test_actor_update.py's batch (8 rows of 4..11 tokens) through the actor's
``compute_log_prob`` whole (token-budget micro-batches grouped by length, as the benchmark runs
it), then split as an async run splits it: the first rows on the actor, the last ones
(``old_log_prob_split``) through ``ActorLogProbs`` on a second model whose weights were zeroed and
then loaded from the actor's Hugging Face-named weights with the rollout rank's loader
(``ChunkWeights``). Both are held to a float64 transformers forward: the split's error may not
exceed twice the whole pass's (both are float32 evaluations of the same sums, grouped into other
micro-batches; a wrong row, weight or temperature gives errors of order 1e-2 and more).
The end-to-end path (the rollout rank computing its share between weight versions, the trainer's
inbox, partial rollout, resume) runs in tests/async_job.py, whose runs set the option.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_actor_update import TEMPERATURE, TP_LEN, _hf_log_probs, build_actor, build_model, make_batch

SETTINGS = {
    "use_remove_padding": False, "use_dynamic_bsz": True, "group_by_length": True,
    "ppo_max_token_len_per_gpu": 16, "ppo_infer_max_token_len_per_gpu": 16,
}  # fmt: skip


def split_job(path: str, share: float = 0.5) -> dict:
    from tests.test_actor_update import kl_actor_config
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.convert import iter_hf_weights
    from verl_megatron.protocol import DataProto
    from verl_megatron.rollout.async_worker import ChunkWeights, last_rows_log_probs
    from verl_megatron.workers.actor import ActorLogProbs

    runtime = init_runtime(ParallelLayout(), seed=5)
    config = kl_actor_config(**SETTINGS)
    chunks, actor = build_actor(runtime, path, config)
    batch = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
    whole, _ = actor.compute_log_prob(batch)

    copy = build_model(runtime, path, ddp=False)
    with torch.no_grad():
        for p in (p for c in copy for p in c.parameters()):
            p.zero_()
    loader = ChunkWeights(copy)
    loader.load(list(iter_hf_weights(chunks, runtime)))
    loader.finish_version()
    rollout_pass = ActorLogProbs(runtime, config, copy)
    first, theirs = last_rows_log_probs(batch, share, lambda data: rollout_pass.compute_log_prob(data)[0])
    own = [actor.compute_log_prob(batch.slice(0, first))[0]] if first > 0 else []
    return {"whole": whole, "split": torch.cat([*own, theirs]), "first": first}


@pytest.mark.parametrize(("share", "first"), [(0.5, 4), (0.75, 2), (1.0, 0)])
def test_split_old_log_probs_are_the_actors_own(pool1, model_path, share, first):
    # async_training.old_log_probs_rollout_share: half by default, any fraction, or every row
    run = pool1.run(f"{__name__}:split_job", path=model_path, share=share)[0]
    assert run["first"] == first  # rows 0..first-1 on the actor, the others on the copy
    valid = make_batch()["attention_mask"][:, TP_LEN:].bool()
    exact = _hf_log_probs(model_path, torch.float64)[0][valid]
    floor = float((run["whole"][valid].double() - exact).abs().max())
    assert 0 < floor < 1e-5, f"float32 log-probs vs float64: {floor:.3g}"
    err = (run["split"][valid].double() - exact).abs()
    assert float(err.max()) <= 2 * floor, (
        f"split log-probs vs float64 max diff {float(err.max()):.3g} at valid token {int(err.argmax())}, "
        f"whole pass {floor:.3g}"
    )
    assert torch.all(run["split"][~valid] == 0)
