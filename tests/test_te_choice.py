"""Transformer Engine or megatron's local spec on a GPU: an explicit, logged choice (issue 18 item 8).

The GPU is simulated (``torch.cuda.is_available``); what is checked is the decision, not TE itself.
"""

from __future__ import annotations

import logging
import sys
import types

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


def _fake_te(monkeypatch, pytorch: types.ModuleType | None) -> None:
    """A ``transformer_engine`` package in sys.modules, with ``pytorch`` as its PyTorch part (None: absent)."""
    for name in [m for m in sys.modules if m == "transformer_engine" or m.startswith("transformer_engine.")]:
        monkeypatch.delitem(sys.modules, name)
    package = types.ModuleType("transformer_engine")
    package.__path__ = []  # a package: its submodules are looked up in an empty path, so not found
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    if pytorch is not None:
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_te_without_its_pytorch_part_reads_as_unavailable(monkeypatch):
    # The metapackage alone (pip install transformer_engine, no [pytorch]): the top package imports.
    _fake_te(monkeypatch, pytorch=None)
    import transformer_engine  # noqa: F401

    assert model_config.transformer_engine_available() is False
    with pytest.raises(ModelConfigError, match=r"no transformer_engine\.pytorch.*model.use_te=false"):
        ModelConfig(use_te=None).resolve_use_te()
    with pytest.raises(ModelConfigError, match=r"transformer_engine\.pytorch does not import"):
        ModelConfig(use_te=True).resolve_use_te()
    # With its PyTorch part, the same machine has Transformer Engine.
    _fake_te(monkeypatch, pytorch=types.ModuleType("transformer_engine.pytorch"))
    assert model_config.transformer_engine_available() is True
    assert ModelConfig(use_te=None).resolve_use_te() is True


def test_te_whose_extension_library_is_missing_reads_as_unavailable(monkeypatch, tmp_path):
    """TE's ``transformer_engine.pytorch`` raises FileNotFoundError (not ImportError) when the
    extension's shared object is missing: a package on disk that does just that."""
    _fake_te(monkeypatch, pytorch=None)
    monkeypatch.delitem(sys.modules, "transformer_engine")
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(
        "raise FileNotFoundError('Could not find shared object file for transformer_engine_torch')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_config.transformer_engine_available() is False
    assert "transformer_engine" in sys.modules and "transformer_engine.pytorch" not in sys.modules
