"""Trainer config: YAML + overrides into the typed schema, and every start-up check naming its key."""

from __future__ import annotations

import os

import pytest

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ConfigError
from verl_megatron.trainer.config import PPOConfig, default_config_path, load_config, to_dict, validate_config
from verl_megatron.workers.config import ActorConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
QUICKSTART = os.path.join(CONFIGS, "quickstart.yaml")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """config.json of a 2-layer llama with 4 heads and 2 kv heads (weights are not read here)."""
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_hf_model(
        path, "llama", vocab_size=32, hidden_size=16, num_heads=4, num_kv_heads=2, num_layers=2
    )
    return str(path)


def _error(overrides: list[str], world_size: int = 1, path: str = QUICKSTART) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(path, overrides), world_size)
    return str(err.value)


def test_quickstart_is_the_default_and_merges_yaml_overrides_and_interpolations():
    assert default_config_path() == QUICKSTART
    config = load_config(
        QUICKSTART, ["actor.optim.lr=1e-6", "trainer.total_training_steps=5", "data.max_response_length=10"]
    )
    assert isinstance(config, PPOConfig) and isinstance(config.actor, ActorConfig)
    assert config.actor.optim.lr == 1e-6 and isinstance(config.actor.optim.lr, float)
    assert config.trainer.total_training_steps == 5
    # rollout.response_length: ${data.max_response_length} follows the override.
    assert (config.data.max_response_length, config.rollout.response_length) == (10, 10)
    # YAML values over schema defaults; untouched fields keep the schema's (verl's) defaults.
    assert (config.rollout.n, config.data.train_batch_size, config.actor.clip_ratio_c) == (8, 64, 3.0)
    assert config.actor.optim.betas == (0.9, 0.999)
    assert config.trainer.default_local_dir == "outputs/quickstart"
    assert validate_config(config, 1) == ParallelLayout(tp=1, pp=1, vpp=None, cp=1, ep=1, dp=1)
    assert to_dict(config)["actor"]["optim"]["lr"] == 1e-6


def test_scalar_for_a_list_field_and_defaults_interpolation():
    config = load_config(
        None,
        [
            "data.train_files=train.parquet",
            "trainer.logger=[console,tensorboard]",
            "actor.ppo_micro_batch_size_per_gpu=2",
            "ref.log_prob_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "trainer.project_name=p",
        ],
    )
    assert config.data.train_files == ["train.parquet"]
    assert config.trainer.logger == ["console", "tensorboard"]
    assert config.trainer.default_local_dir == "checkpoints/p/run"


def test_shipped_configs_validate_for_their_world_sizes(tiny_model):
    for name, world, extra, dp in [
        ("ppo.yaml", 8, [], 8),
        ("grpo.yaml", 8, ["parallel.tp=2"], 4),
        ("dapo.yaml", 8, ["parallel.pp=2"], 4),
        ("quickstart.yaml", 2, ["parallel.tp=2"], 1),
    ]:
        config = load_config(os.path.join(CONFIGS, name), [f"model.path={tiny_model}", *extra])
        assert validate_config(config, world).dp == dp, name
    dapo = load_config(os.path.join(CONFIGS, "dapo.yaml"), [f"model.path={tiny_model}"])
    assert dapo.algorithm.filter_groups.enable and dapo.algorithm.filter_groups.metric == "acc"
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high) == (0.2, 0.28)
    assert dapo.reward_model.overlong_buffer.len == 4096


def test_unknown_keys_name_source_and_closest_key(tmp_path):
    message = _error(["trainer.total_steps=5"])
    assert "unknown config key 'trainer.total_steps' (from override 'trainer.total_steps=5')" in message
    assert "'trainer.total_training_steps'" in message
    assert "did you mean 'trainer'" in _error(["trainr.seed=1"])
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("actor:\n  optim:\n    lr_warmup_step: 3\n")
    message = _error([], path=str(yaml_path))
    assert f"unknown config key 'actor.optim.lr_warmup_step' (in {yaml_path})" in message
    assert "did you mean 'actor.optim.lr_warmup_steps'" in message
    # Free-form mappings accept any key.
    config = load_config(QUICKSTART, ["reward_model.reward_kwargs.anything=1"])
    assert config.reward_model.reward_kwargs == {"anything": 1}


def test_wrong_types_and_malformed_overrides():
    assert _error(["actor.optim.lr=fast"]) == (
        "config key 'actor.optim.lr' (from override 'actor.optim.lr=fast'): "
        "Value 'fast' of type 'str' could not be converted to Float"
    )
    assert "config key 'trainer.total_training_steps'" in _error(["trainer.total_training_steps=2.5"])
    assert "must look like key=value" in _error(["trainer.seed"])
    # A section's own check (the worker config's __post_init__) becomes a ConfigError too.
    assert "actor.loss_agg_mode must be one of" in _error(["actor.loss_agg_mode=bad"])


def test_scalar_for_a_section_names_the_section(tmp_path):
    assert _error(["actor.optim=3"]) == (
        "'actor.optim' is a section; expected a mapping, got 3 (from override 'actor.optim=3')"
    )
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("actor:\n  optim: 0.001\n")
    assert _error([], path=str(yaml_path)) == (
        f"'actor.optim' is a section; expected a mapping, got 0.001 (in {yaml_path})"
    )


def test_batch_arithmetic():
    # quickstart: train_batch_size 64 prompts, rollout.n 8, actor mini-batch 32 prompts, micro 256.
    assert _error(["actor.ppo_mini_batch_size=48"]).startswith(
        "actor.ppo_mini_batch_size=48 must divide data.train_batch_size=64"
    )
    assert "32*8 = 256 samples per mini-batch are not divisible by the data-parallel size dp=3" in _error(
        [], 3
    )
    assert _error(["actor.ppo_micro_batch_size_per_gpu=48"]).startswith(
        "actor.ppo_micro_batch_size_per_gpu=48 does not divide the 256 samples each dp rank gets"
    )
    # dp=2: 128 samples per rank; 48 does not divide them, 64 does.
    assert "128 samples each dp rank" in _error(["actor.ppo_micro_batch_size_per_gpu=48"], 2)
    validate_config(load_config(QUICKSTART, ["actor.ppo_micro_batch_size_per_gpu=64"]), 2)
    # The critic is checked only when it runs (GAE).
    validate_config(load_config(QUICKSTART, ["critic.ppo_mini_batch_size=48"]), 1)
    gae = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=48"]
    assert _error(gae).startswith("critic.ppo_mini_batch_size=48 must divide data.train_batch_size=64")


def test_parallel_sizes_against_world_and_model(tiny_model):
    assert _error(["parallel.tp=3"], 2) == "parallel: tp*pp*cp = 3*1*1 = 3 does not divide the world size 2"
    assert "needs parallel.pp > 1" in _error(["parallel.vpp=2"])
    model = f"model.path={tiny_model}"
    # 2 kv heads cannot be split over 4 tensor-parallel ranks; 2 layers not over 4 stages.
    assert "num_key_value_heads=2 is not divisible by tp=4" in _error([model, "parallel.tp=4"], 4)
    assert "num_layers=2 is not divisible by pp*vpp = 4*1 = 4" in _error([model, "parallel.pp=4"], 4)
    assert f"(model.path='{tiny_model}')" in _error([model, "parallel.pp=4"], 4)
    assert _error(["model.path=/nowhere"]) == "model.path='/nowhere' does not exist"


def test_section_checks_name_their_key():
    assert "rollout.response_length=5 differs from data.max_response_length=4" in _error(
        ["rollout.response_length=5"]
    )
    assert "did you mean 'grpo' or 'gpg'?" in _error(["algorithm.adv_estimator=grp"])
    assert "rollout.n must be >= 2, got 1" in _error(["rollout.n=1"])
    assert "did you mean 'tensorboard'" in _error(["trainer.logger=[console,tensorbord]"])
    assert (
        _error(["trainer.resume_mode=resume_path"])
        == "trainer.resume_mode=resume_path needs trainer.resume_from_path"
    )
    assert "expected one of ['auto', 'disable', 'resume_path']" in _error(["trainer.resume_mode=sometimes"])
    assert "algorithm.filter_groups.enable needs algorithm.filter_groups.metric" in _error(
        ["algorithm.filter_groups.enable=true"]
    )
    assert "needs reward_model.reward_manager=dapo" in _error(["reward_model.overlong_buffer.enable=true"])
    overlong = ["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true"]
    assert "reward_model.overlong_buffer.len=0 must be in 1..data.max_response_length=4" in _error(overlong)
    assert _error(["reward_model.reward_manager=naiv"]).startswith(
        "reward_model.reward_manager: Unknown reward manager: naiv"
    )
    assert "custom_reward_function.path='/nope.py' does not exist" in _error(
        ["custom_reward_function.path=/nope.py"]
    )
    assert _error(["quickstart.enable=false"]).startswith("model.path is not set")
    assert "algorithm.kl_penalty='k9'" in _error(
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k9"]
    )
    # one trailing '+' (the straight-through variant) and no more: 'k3++' failed at step 1
    assert "algorithm.kl_penalty='k3++'" in _error(
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3++"]
    )
    validate_config(
        load_config(QUICKSTART, ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3+"]), 1
    )


def test_only_the_roles_a_run_uses_must_be_complete():
    # GRPO runs no critic: its section may leave the micro-batch size unset.
    sparse = load_config(QUICKSTART, ["critic.ppo_micro_batch_size_per_gpu=null"])
    validate_config(sparse, 1)
    assert sparse.critic.ppo_micro_batch_size_per_gpu is None  # nothing derived for an unused role
    # With GAE the critic trains: an unset micro-batch is derived (issue 30), a rank's share of a
    # mini-batch, 32 prompts * 8 samples / dp.
    gae = load_config(
        QUICKSTART,
        [
            "critic.ppo_micro_batch_size_per_gpu=null",
            "critic.ppo_mini_batch_size=32",
            "algorithm.adv_estimator=gae",
        ],
    )
    validate_config(gae, 2)
    assert gae.critic.ppo_micro_batch_size_per_gpu == 128
    kl = load_config(QUICKSTART, ["ref.log_prob_micro_batch_size_per_gpu=null", "actor.use_kl_loss=true"])
    with pytest.raises(ConfigError, match=r"ref\.log_prob_micro_batch_size_per_gpu must be set"):
        validate_config(kl, 1)


def test_greedy_training_rollouts_with_several_samples_a_prompt_are_refused():
    """Greedy decoding gives one response a prompt whatever rollout.n says: the trainer (and partial
    rollout, the async link) expected n rows a prompt and failed later with a shape error."""
    for greedy in ("rollout.do_sample=false", "rollout.temperature=0"):
        message = _error([greedy])
        assert message.startswith("rollout.n=8 with greedy training rollouts (rollout.do_sample="), message
        assert message.endswith(
            "gives one response a prompt, not 8: set rollout.n=1, or sample (do_sample=true and a temperature > 0)"
        )
    validate_config(
        load_config(
            QUICKSTART,
            ["rollout.do_sample=false", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"],
        ),
        1,
    )


def test_loads_share_no_state():
    """The schema is built once per process: a load with overrides, or a change to a loaded config,
    must not reach the next load."""
    from verl_megatron.trainer.config import default_config_path, load_config, to_dict

    before = to_dict(load_config(None, []))
    changed = load_config(default_config_path(), ["actor.optim.lr=0.5", "trainer.logger=[jsonl]"])
    changed.actor.optim.lr = 7.0
    changed.trainer.logger.append("tensorboard")
    assert to_dict(load_config(None, [])) == before
    assert load_config(default_config_path(), []).actor.optim.lr != 7.0


def test_load_config_copies_the_config_once_whatever_the_overrides(monkeypatch):
    """``load_config`` merges the YAML file and every override into one copy of the schema: a copy
    of the whole config per override cost ~20 ms, 0.26 s for a call with 12 overrides (0.06 s now)."""
    from omegaconf import DictConfig, OmegaConf

    from verl_megatron.trainer.config import PPOConfig, default_config_path, load_config

    whole_copies = []
    original = DictConfig.__deepcopy__

    def counting(self, memo):
        if OmegaConf.get_type(self) is PPOConfig:  # the root: a copy of the whole config
            whole_copies.append(1)
        return original(self, memo)

    monkeypatch.setattr(DictConfig, "__deepcopy__", counting)
    overrides = ["rollout.n=4", "data.train_batch_size=8", "actor.optim.lr=0.01", "rollout.n=6"]
    config = load_config(default_config_path(), overrides)
    # Later overrides still win, and the YAML's values under them stay.
    assert (config.rollout.n, config.data.train_batch_size, config.actor.optim.lr) == (6, 8, 0.01)
    assert config.actor.ppo_mini_batch_size == 32  # configs/quickstart.yaml
    assert len(whole_copies) == 1
    # The cached schema was not written to: a second call sees the file's values again.
    again = load_config(default_config_path(), [])
    assert (again.rollout.n, again.data.train_batch_size, again.actor.optim.lr) == (8, 64, 1e-3)
