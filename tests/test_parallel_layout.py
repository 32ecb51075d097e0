"""ParallelLayout: dp derived from the world size, clear errors for layouts that cannot work."""

from __future__ import annotations

import pytest

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ParallelConfigError


def test_dp_is_derived_from_world_size():
    assert ParallelLayout(tp=2, pp=2).resolve(8).dp == 2
    assert ParallelLayout().resolve(2).dp == 2
    assert ParallelLayout(tp=2).resolve(2).dp == 1
    assert ParallelLayout(pp=2, vpp=2).resolve(4).virtual_stages == 2


@pytest.mark.parametrize(
    ("layout", "world", "message"),
    [
        (ParallelLayout(tp=3), 4, "tp*pp*cp = 3*1*1 = 3 does not divide the world size 4"),
        (ParallelLayout(tp=2, pp=2), 6, "does not divide the world size 6"),
        (ParallelLayout(tp=2, dp=2), 2, "parallel.dp=2 but world size 2"),
        (ParallelLayout(tp=0), 2, "parallel.tp must be a positive integer"),
        (ParallelLayout(vpp=2), 2, "vpp > 1 needs parallel.pp > 1"),
        (ParallelLayout(ep=4), 2, "parallel.ep=4 must divide dp*cp*tp = 2"),
    ],
)
def test_impossible_world_layouts_are_named(layout, world, message):
    with pytest.raises(ParallelConfigError, match=message.replace("*", r"\*").replace(".", r"\.")):
        layout.resolve(world)


@pytest.mark.parametrize(
    ("layout", "model", "message"),
    [
        (
            ParallelLayout(tp=4),
            dict(num_layers=4, num_attention_heads=6),
            "num_attention_heads=6 is not divisible by tp=4",
        ),
        (
            ParallelLayout(tp=4),
            dict(num_layers=4, num_attention_heads=8, num_query_groups=2),
            "num_key_value_heads=2 is not divisible by tp=4",
        ),
        (
            ParallelLayout(pp=2, vpp=2),
            dict(num_layers=6, num_attention_heads=4),
            "num_layers=6 is not divisible by pp\\*vpp = 2\\*2 = 4",
        ),
        (ParallelLayout(pp=4), dict(num_layers=6, num_attention_heads=4), "num_layers=6 is not divisible"),
        (
            ParallelLayout(ep=2),
            dict(num_layers=2, num_attention_heads=4),
            "ep=2 needs a mixture-of-experts model",
        ),
        (
            ParallelLayout(ep=2),
            dict(num_layers=2, num_attention_heads=4, num_experts=3),
            "num_experts=3 is not divisible by ep=2",
        ),
    ],
)
def test_model_that_does_not_split_is_named(layout, model, message):
    with pytest.raises(ParallelConfigError, match=message):
        layout.check_model(**model)


def test_valid_model_split_passes():
    ParallelLayout(tp=2, pp=2, vpp=2).check_model(num_layers=8, num_attention_heads=8, num_query_groups=2)
    ParallelLayout(ep=2).check_model(num_layers=2, num_attention_heads=4, num_experts=4)
