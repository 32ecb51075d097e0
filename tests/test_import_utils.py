"""load_object: user objects by module path or file path, with errors naming the config key."""

from __future__ import annotations

import pytest

from verl_megatron.rollout.config import MultiTurnConfig, RolloutConfig, RolloutConfigError
from verl_megatron.utils.import_utils import load_object


def test_loads_from_module_and_from_file(tmp_path):
    assert load_object("os.path:join", "x") is __import__("os").path.join
    env = tmp_path / "env.py"
    env.write_text("def reply(conversation, text):\n    return text[::-1]\n")
    fn = load_object(f"{env}:reply", "rollout.multi_turn.environment")
    assert fn(None, "abc") == "cba"


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("no_colon", ValueError, "expected 'pkg.module:name'"),
        ("/nowhere/env.py:f", FileNotFoundError, "file not found: /nowhere/env.py"),
        ("no_such_module_xyz:f", ImportError, "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_name", AttributeError, "has no attribute 'no_such_name'"),
    ],
)
def test_bad_specs_name_the_key_and_the_problem(spec, error, message):
    with pytest.raises(error, match=r"rollout\.multi_turn\.environment") as info:
        load_object(spec, "rollout.multi_turn.environment")
    assert message in str(info.value)


def test_broken_file_names_the_path(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(RuntimeError, match=f"importing {bad} failed: SyntaxError"):
        load_object(f"{bad}:f", "k")


def test_multi_turn_needs_an_environment():
    with pytest.raises(RolloutConfigError, match=r"needs rollout\.multi_turn\.environment"):
        RolloutConfig(multi_turn=MultiTurnConfig(enable=True))
    RolloutConfig(multi_turn=MultiTurnConfig(enable=True, environment="pkg:env"))
