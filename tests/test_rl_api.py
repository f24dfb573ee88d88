"""The Python path of an RL run, in this process: describing the run, its warm start, and the
policy fetched back from the stages (the swarm itself: tests/test_rl_swarm.py and the example's
test in tests/test_demo.py)."""

import dataclasses

import pytest
import torch

import swarmtrain as st
from swarmtrain.errors import ConfigError, SwarmError
from swarmtrain.model import build_model
from swarmtrain.model.param_names import model_from_states, stage_param_names
from swarmtrain.peers.coordinator import make_manifest
from swarmtrain.peers.launcher import rl_flags
from swarmtrain.rl import DEFAULT_MODEL, LocalConfig, warm_up

RL = st.RLConfig(task="add", samples_per_prompt=8)


def test_the_rl_api_is_at_the_top_level_and_documented():
    for name in (
        "RLConfig",
        "RolloutFeed",
        "RolloutPeer",
        "RolloutConfig",
        "Task",
        "register_task",
        "save_model",
    ):
        assert name in st.__all__
        assert (getattr(st, name).__doc__ or "").strip(), f"swarmtrain.{name} has no docstring"


def test_a_local_swarm_takes_rollout_peers_only_for_an_rl_run():
    with pytest.raises(ConfigError, match=r"2 rollout peer\(s\) but no RL task"):
        st.LocalSwarmConfig(rollout_peers=2)
    with pytest.raises(ConfigError, match="rollout_peers must be >= 0, got -1"):
        st.LocalSwarmConfig(rl=RL, rollout_peers=-1)
    st.LocalSwarmConfig(
        rl=RL, rollout_peers=2, batch=st.BatchConfig(microbatch_size=16, microbatches_per_step=4)
    )


def test_a_local_rl_swarm_refuses_a_step_of_partial_groups_before_starting_anything():
    with pytest.raises(ConfigError, match="6 completions, not a multiple of samples_per_prompt=8"):
        st.LocalSwarmConfig(rl=RL, batch=st.BatchConfig(microbatch_size=3, microbatches_per_step=2))


def test_every_rl_setting_reaches_the_coordinator_as_a_flag():
    rl = st.RLConfig(
        task="add",
        task_options={"digits": 3},
        samples_per_prompt=4,
        max_staleness=1,
        weights_codec="bf16",
        verify_fraction=0.5,
        logprob_tolerance=0.2,
    )
    flags = rl_flags(rl)
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    for f in dataclasses.fields(st.RLConfig):
        assert f"--{f.name.replace('_', '-')}" in given, f"RLConfig.{f.name} has no coordinator flag"
    assert given["--task-options"] == '{"digits": 3}' and given["--weights-codec"] == "bf16"
    assert rl_flags(None) == []


def test_an_rl_run_trains_grpo_unless_it_names_another_grpo_loss():
    manifest = make_manifest(st.CoordinatorConfig(model_config=DEFAULT_MODEL, num_stages=2, rl=RL))
    assert manifest.loss == "grpo" and manifest.rl == RL
    kl = make_manifest(st.CoordinatorConfig(model_config=DEFAULT_MODEL, num_stages=2, rl=RL, loss="grpo_kl"))
    assert kl.loss == "grpo_kl"
    with pytest.raises(ConfigError, match="'cross_entropy' is not a GRPO loss"):
        make_manifest(
            st.CoordinatorConfig(model_config=DEFAULT_MODEL, num_stages=2, rl=RL, loss="cross_entropy")
        )
    assert st.CoordinatorConfig(model_config=DEFAULT_MODEL).loss is None  # not an RL run: the model's own


def test_warm_up_starts_from_the_stages_seed_init_and_its_saved_policy_loads_back(tmp_path):
    seeded = build_model("tiny-gpt", DEFAULT_MODEL, device="meta")
    seeded.materialise(0)  # as a run's stages initialise it from run seed 0
    cold, steps = warm_up(LocalConfig(model=DEFAULT_MODEL, warmup_steps=0))
    assert steps == 0
    for (name, a), b in zip(seeded.state_dict().items(), cold.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    warm, steps = warm_up(LocalConfig(model=DEFAULT_MODEL, warmup_steps=3, warmup_batch_size=8))
    assert steps == 3
    assert not torch.equal(warm.head.lm_head.weight, seeded.head.lm_head.weight)  # it trained
    loaded = st.load_exported(
        st.save_model(warm, tmp_path / "warm", builder="tiny-gpt", config=DEFAULT_MODEL)
    )
    for (name, a), b in zip(warm.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_whole_model_is_rebuilt_from_its_stages_states_and_a_short_state_is_refused():
    manifest = make_manifest(st.CoordinatorConfig(model_config=DEFAULT_MODEL, num_stages=2, rl=RL))
    policy, _ = warm_up(LocalConfig(model=DEFAULT_MODEL, warmup_steps=2, warmup_batch_size=8))
    params = {
        f"{key}.{name}": p.detach() for key, part in policy.parts() for name, p in part.named_parameters()
    }
    states = [{n: params[n] for n in stage_param_names(manifest, k)} for k in range(2)]  # swarm names

    rebuilt = model_from_states(manifest, states)
    for (name, a), b in zip(policy.state_dict().items(), rebuilt.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    states[1].pop(next(iter(states[1])))
    with pytest.raises(SwarmError, match="lack 1 of the model's .* trained parameters"):
        model_from_states(manifest, states)
