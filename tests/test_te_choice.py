"""Transformer Engine or megatron's local spec on a GPU: an explicit, logged choice (issue 18 item 8).

The GPU is simulated (``torch.cuda.is_available``); what is checked is the decision, not TE itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

from verl_megatron.errors import ModelConfigError
from verl_megatron.models import config as model_config
from verl_megatron.models.config import ModelConfig


def _machine(monkeypatch, cuda: bool, te: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(model_config, "transformer_engine_available", lambda: cuda and te)


def test_gpu_without_te_is_an_error_in_auto_mode(monkeypatch):
    _machine(monkeypatch, cuda=True, te=False)
    with pytest.raises(ModelConfigError, match=r"no transformer_engine.*model.use_te=false"):
        ModelConfig(use_te=None).resolve_use_te()
    with pytest.raises(ModelConfigError, match="use_te=True needs Transformer Engine"):
        ModelConfig(use_te=True).resolve_use_te()


def test_local_spec_on_a_gpu_is_an_opt_in_that_is_logged(monkeypatch, caplog):
    _machine(monkeypatch, cuda=True, te=False)
    with caplog.at_level(logging.WARNING, logger="verl_megatron.models.config"):
        assert ModelConfig(use_te=False).resolve_use_te() is False
    assert "use_te=false on a GPU" in caplog.text


@pytest.mark.parametrize(("cuda", "te", "use_te", "expected"), [
    (True, True, None, True), (True, True, False, False), (False, False, None, False), (False, False, False, False),
])  # fmt: skip
def test_other_machines_resolve_quietly(monkeypatch, caplog, cuda, te, use_te, expected):
    _machine(monkeypatch, cuda=cuda, te=te)
    with caplog.at_level(logging.WARNING, logger="verl_megatron.models.config"):
        assert ModelConfig(use_te=use_te).resolve_use_te() is expected
    assert ("on a GPU" in caplog.text) == (cuda and use_te is False)
