"""On-policy distillation end to end: the teacher's log-probs under its own tp/pp equal one
process's, a different vocabulary stops at start-up with a named error, and
configs/distill_quickstart.yaml trains a step whose policy loss is the reverse KL it logs."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.test_actor_update import TEMPERATURE, VOCAB, make_batch
from tests.test_recipes import ROOT, recipe_job  # noqa: F401  (the pool runs it by this module's name)


def teacher_job(path: str, layouts: list[tuple[int, int]]) -> dict:
    """Teacher log-probs and logits [B, Tr, V] of make_batch() for each teacher (tp, pp), the
    student's runtime at tp=pp=1."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.config import ModelConfig
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.teacher import MegatronTeacher
    from verl_megatron.workers.teacher_config import TeacherConfig

    runtime = init_runtime(ParallelLayout(), seed=5)
    out = {}
    for tp, pp in layouts:
        config = TeacherConfig(
            model=ModelConfig(path=path, dtype="float32", use_te=False),
            parallel=ParallelLayout(tp=tp, pp=pp),
            micro_batch_size_per_gpu=3,
            offload=True,  # a no-op on CPU, but the load/park calls run
        )
        teacher = MegatronTeacher(runtime, config)
        data = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
        out[f"{tp}x{pp}"] = teacher.compute_log_prob(data)
        out[f"{tp}x{pp}:logits"] = teacher.compute_logits(data)
        frozen = all(not p.requires_grad for c in teacher.chunks for p in c.parameters())
        teacher.close()
        assert frozen
    return out


def test_teacher_log_probs_under_its_own_layout(pool1, pool2, model_path):
    (single,) = pool1.run(f"{__name__}:teacher_job", path=model_path, layouts=[(1, 1)])
    both = pool2.run(f"{__name__}:teacher_job", path=model_path, layouts=[(2, 1), (1, 2)])
    valid = make_batch()["attention_mask"][:, -5:].bool()
    reference, logits = single["1x1"], single["1x1:logits"]
    assert torch.all(reference[~valid] == 0) and torch.all(reference[valid] < 0)
    assert logits.shape == (*reference.shape, VOCAB) and torch.all(logits[~valid] == 0)
    # The logits the GKD loss gets give the log-probs the reverse-KL path gets.
    labels = make_batch()["responses"]
    from_logits = torch.log_softmax(logits.double() / TEMPERATURE, -1).gather(-1, labels[..., None])[..., 0]
    diff = float((from_logits[valid] - reference[valid].double()).abs().max())
    assert diff <= 1e-5, f"log-probs of the teacher's logits differ from its log-probs by {diff:.3g}"
    for rank in both:
        for name, value in rank.items():
            expected = logits if name.endswith(":logits") else reference
            diff = (value - expected).abs()
            where = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
            assert float(diff.max()) <= 2e-5, (
                f"teacher {name}: differs from one process by {float(diff.max()):.3g} at {where}"
            )


def test_a_teacher_with_another_vocabulary_stops_at_start_up(tmp_path, no_runtime):
    from verl_megatron.train import run
    from verl_megatron.utils.local_assets import (
        build_bpe_tokenizer,
        build_char_tokenizer,
        build_tiny_hf_model,
    )
    from verl_megatron.workers.teacher_config import TeacherConfigError

    small = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    build_tiny_hf_model(
        student, "llama", tokenizer=build_char_tokenizer(student, alphabet="0123456789"), **small
    )
    build_tiny_hf_model(teacher, "llama", tokenizer=build_bpe_tokenizer(teacher), **small)
    overrides = [f"model.path={student}", f"algorithm.distill.teacher.model.path={teacher}",
                 f"trainer.default_local_dir={tmp_path / 'out'}"]  # fmt: skip
    with pytest.raises(
        TeacherConfigError, match=r"algorithm.distill.teacher.model.path=.*differs from the student's"
    ):
        run(os.path.join(ROOT, "configs", "distill_quickstart.yaml"), overrides)
    with pytest.raises(TeacherConfigError, match=r"is not a Hugging Face checkpoint folder"):
        run(
            os.path.join(ROOT, "configs", "distill_quickstart.yaml"),
            [*overrides, "algorithm.distill.teacher.model.path=/nope"],
        )


def test_gkd_jsd_with_a_teacher_of_another_logit_width_stops_at_start_up(tmp_path, no_runtime):
    """One tokenizer, two padded vocabularies (Qwen2.5-7B 152064, 0.5B 151936): gkd_jsd compares
    logits column for column and failed at the first update; reverse_kl needs only log-probs."""
    from verl_megatron.train import run
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model
    from verl_megatron.workers.teacher_config import TeacherConfigError

    small = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    tokenizer = build_char_tokenizer(student, alphabet="0123456789")
    build_tiny_hf_model(student, "llama", tokenizer=tokenizer, **small)
    build_tiny_hf_model(
        teacher, "llama", tokenizer=build_char_tokenizer(teacher, alphabet="0123456789"),
        vocab_size=len(tokenizer) + 8, **small,
    )  # fmt: skip
    overrides = [f"model.path={student}", f"algorithm.distill.teacher.model.path={teacher}",
                 f"trainer.default_local_dir={tmp_path / 'out'}"]  # fmt: skip
    recipe = os.path.join(ROOT, "configs", "distill_quickstart.yaml")
    with pytest.raises(TeacherConfigError) as err:
        run(recipe, [*overrides, "algorithm.distill.loss=gkd_jsd"])
    assert f"has vocab_size {len(tokenizer) + 8} and the student ({student}) {len(tokenizer)}" in str(
        err.value
    )
    with pytest.raises(AssertionError, match="init_runtime reached"):  # every start-up check passed
        run(recipe, [*overrides, "algorithm.distill.loss=reverse_kl"])


def test_a_bad_teacher_layout_stops_at_start_up_before_any_model(tmp_path, no_runtime, monkeypatch):
    """The teacher's own tp/pp (``algorithm.distill.teacher.parallel``) and model settings are
    part of the config check: before, tp=2 on one process passed it and failed in the teacher's
    build, after the student and the rollout were built."""
    import verl_megatron.models.builder as builder
    from verl_megatron.train import run
    from verl_megatron.trainer.preflight import prepare_run
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model
    from verl_megatron.workers.teacher_config import TeacherConfigError

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built before the teacher's layout was checked")

    monkeypatch.setattr(builder, "build_gpt_chunks", no_build)
    small = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for path in (student, teacher):
        build_tiny_hf_model(
            path, "llama", tokenizer=build_char_tokenizer(path, alphabet="0123456789"), **small
        )
    recipe = os.path.join(ROOT, "configs", "distill_quickstart.yaml")
    overrides = [f"model.path={student}", f"algorithm.distill.teacher.model.path={teacher}",
                 f"trainer.default_local_dir={tmp_path / 'out'}"]  # fmt: skip
    key = "algorithm.distill.teacher"
    with pytest.raises(
        TeacherConfigError,
        match=rf"^{key}.parallel: tp\*pp\*cp = 2\*1\*1 = 2 does not divide the world size 1",
    ):
        prepare_run(recipe, [*overrides, f"{key}.parallel.tp=2"], 1)
    with pytest.raises(
        TeacherConfigError, match=rf"^{key}.parallel: tp\*pp\*cp = 2\*1\*1 = 2 does not divide"
    ):
        run(recipe, [*overrides, f"{key}.parallel.tp=2"])
    # Its heads on 4 ranks (2 kv heads cannot split 4 ways), and its model settings.
    with pytest.raises(
        TeacherConfigError, match=rf"^{key}.parallel: num_key_value_heads=2 is not divisible by tp=4"
    ):
        prepare_run(recipe, [*overrides, f"{key}.parallel.tp=4"], 4)
    with pytest.raises(TeacherConfigError, match=rf"^{key}.model.sequence_parallel=True needs tp > 1"):
        prepare_run(recipe, [*overrides, f"{key}.model.sequence_parallel=true"], 1)
    # The quickstart's student (no model.path) is built later: the teacher is checked all the same.
    with pytest.raises(TeacherConfigError, match=rf"^{key}.parallel: tp\*pp\*cp = 2\*1\*1 = 2"):
        prepare_run(recipe, [f"algorithm.distill.teacher.model.path={teacher}", f"{key}.parallel.tp=2"], 1)


@pytest.mark.parametrize("loss", ["reverse_kl", "gkd_jsd"])
def test_distill_recipe_runs_a_step(pool1, tmp_path, loss):
    """The recipe with a small teacher that shares the quickstart's tokenizer. reverse_kl: on the
    first, exactly on-policy mini-batch the clipped policy loss is -mean(advantage), which without
    whitening is the logged reverse KL. gkd_jsd: the advantages are 0 (coef 0), the loss is the
    generalized JSD, and the teacher's logits are in the batch."""
    from verl_megatron.trainer.quickstart import DIGITS
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    teacher = tmp_path / "teacher"
    build_tiny_hf_model(teacher, "llama", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, tokenizer=build_char_tokenizer(teacher, alphabet=DIGITS), seed=4)  # fmt: skip
    out = str(tmp_path / "distill")
    overrides = [f"algorithm.distill.teacher.model.path={teacher}", "quickstart.num_digits=2",
                 "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "trainer.total_training_steps=1",
                 "trainer.val_before_train=false", "algorithm.distill.whiten=false",
                 f"algorithm.distill.loss={loss}"]  # fmt: skip
    (result,) = pool1.run(
        f"{__name__}:recipe_job", recipe="distill_quickstart", out_dir=out, overrides=overrides
    )
    step = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert (
        result["config"]["algorithm"]["distill"]["enable"]
        and result["config"]["algorithm"]["distill"]["coef"] == 0.0
    )
    for key in (
        "distill/reverse_kl",
        "distill/teacher_log_prob",
        "timing_s/teacher",
        "distill/teacher_param_gb",
    ):
        assert math.isfinite(step[key]), key
    assert step["timing_s/teacher"] > 0 and step["distill/teacher_log_prob"] < 0
    if loss == "reverse_kl":
        assert step["actor/pg_loss"] == pytest.approx(step["distill/reverse_kl"], rel=1e-5, abs=1e-6)
    else:  # a generalized JSD lies in [0, H(beta)], H(beta) <= log 2
        assert step["actor/pg_loss"] == 0.0 and 0.0 < step["actor/gkd_jsd"] < math.log(2)
        assert step["distill/teacher_logits_gb"] > 0
    assert "val/test_score/synthetic/reverse" in step and "hf_export" in result["files"]
