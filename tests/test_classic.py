"""Tests of the two classic scripts, ppo_classic.py and reinforce.py: GAE and reward-to-go against hand-computed
values, the functions they share, short end-to-end runs, bad input. A test that does the same for both scripts is
parametrized over `script`."""

import functools
import glob
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ppo_classic
import reinforce

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNKNOWN_ENV = "error: --env-id NoSuchEnv-v0 is not a registered Gymnasium environment"
BAD_MINIBATCHES = "error: --num-minibatches must divide --num-envs * --num-steps (got 3 and 512)"
SCRIPTS = {"ppo_classic": ppo_classic, "reinforce": reinforce}
SHORT_RUN = {"ppo_classic": "1024", "reinforce": "500"}  # --total-timesteps of a short run: 2 or 3 updates
METRICS = [
    "charts/learning_rate",
    "charts/SPS",
    "losses/value_loss",
    "losses/policy_loss",
    "losses/entropy",
    "losses/old_approx_kl",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/explained_variance",
]


class ConstantRewardEnv(gym.Env):
    """Reward 1 at every step, never terminates: only the 10-step time limit ends an episode."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 1.0, False, False, {}


class MultiBinaryActionEnv(ConstantRewardEnv):
    action_space = gym.spaces.MultiBinary(3)


class DictObservationEnv(ConstantRewardEnv):
    observation_space = gym.spaces.Dict({"x": gym.spaces.Box(-1.0, 1.0, (1,), np.float32)})


class ImageObservationEnv(ConstantRewardEnv):
    """A (2, 3) Box observation: the scripts must flatten it to 6 inputs."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros((2, 3), np.float32), {}

    def step(self, action):
        return np.full((2, 3), 0.5, np.float32), 1.0, False, False, {}


class StepCounterEnv(ConstantRewardEnv):
    """Observation = the number of steps taken in the episode (0 after reset), reward 1, never terminates:
    the time limit (10 steps) truncates every episode, whose final observation is 10, the reset one 0."""

    observation_space = gym.spaces.Box(0.0, 100.0, (1,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.count = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.count += 1
        return np.full(1, self.count, np.float32), 1.0, False, False, {}


gym.register("tests/ConstantReward-v0", entry_point=ConstantRewardEnv, max_episode_steps=10)
gym.register("tests/MultiBinaryAction-v0", entry_point=MultiBinaryActionEnv, max_episode_steps=10)
gym.register("tests/DictObservation-v0", entry_point=DictObservationEnv, max_episode_steps=10)
gym.register("tests/ImageObservation-v0", entry_point=ImageObservationEnv, max_episode_steps=10)
gym.register("tests/StepCounter-v0", entry_point=StepCounterEnv, max_episode_steps=10)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------
# compute_gae: (T, N) tensors, dones[t] = 1 when the episode ended at step t
# ---------------------------------------------------------------------------------------------------------
def test_gae_episode_ends_mid_rollout():
    rewards, values, dones = t([[1.0], [1.0], [1.0]]), t([[0.5], [0.4], [0.3]]), t([[0.0], [1.0], [0.0]])
    adv, ret = ppo_classic.compute_gae(rewards, values, dones, t([0.2]), gamma=0.9, gae_lambda=0.8)
    # t=2: delta = 1 + 0.9*0.2 - 0.3 = 0.88                       A2 = 0.88
    # t=1: episode ended, no V_2 and no A_2: delta = 1 - 0.4 = 0.6  A1 = 0.6
    # t=0: delta = 1 + 0.9*0.4 - 0.5 = 0.86                       A0 = 0.86 + 0.9*0.8*0.6 = 1.292
    torch.testing.assert_close(adv, t([[1.292], [0.6], [0.88]]))
    # returns = A + V: 1.292+0.5, 0.6+0.4, 0.88+0.3
    torch.testing.assert_close(ret, t([[1.792], [1.0], [1.18]]))


def test_gae_truncation_bootstrap():
    # Episode truncated after step 1 with V(final obs) = 2.0:
    # the caller adds gamma*2.0 to r_1 -> 1 + 1.8 = 2.8.
    # last_value is V of the reset obs of the next episode and must not leak in: try two values.
    rewards, values, dones = t([[1.0], [1.0 + 0.9 * 2.0]]), t([[0.5], [0.4]]), t([[0.0], [1.0]])
    for last_value in (7.0, -100.0):
        adv, ret = ppo_classic.compute_gae(rewards, values, dones, t([last_value]), gamma=0.9, gae_lambda=0.8)
        # t=1: delta = 2.8 - 0.4 = 2.4                      A1 = 2.4
        # t=0: delta = 1 + 0.9*0.4 - 0.5 = 0.86            A0 = 0.86 + 0.72*2.4 = 2.588
        torch.testing.assert_close(adv, t([[2.588], [2.4]]))
        torch.testing.assert_close(ret, t([[3.088], [2.8]]))  # 2.588+0.5, 2.4+0.4


def test_gae_lambda_one_gamma_one_is_monte_carlo_several_envs():
    # env 0 ends its episode at t=2; env 1 ends one at t=1 and its next episode runs past the rollout.
    rewards = t([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    values = t([[0.5, -1.0], [2.0, 0.0], [1.0, 3.0]])
    dones = t([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    adv, ret = ppo_classic.compute_gae(rewards, values, dones, t([9.0, 10.0]), gamma=1.0, gae_lambda=1.0)
    # env 0: G2 = 5, G1 = 3+5 = 8, G0 = 1+8 = 9 (last_value 9 ignored: the episode ended at t=2)
    # env 1: G2 = 6 + last_value 10 = 16 (unfinished episode bootstraps), G1 = 4 (ended), G0 = 2+4 = 6
    torch.testing.assert_close(ret, t([[9.0, 6.0], [8.0, 4.0], [5.0, 16.0]]))
    torch.testing.assert_close(adv, ret - values)  # [[8.5, 7], [6, 4], [4, 13]]


def test_gae_lambda_zero_is_one_step_td():
    rewards, values, dones = t([[1.0], [2.0], [3.0]]), t([[1.0], [2.0], [4.0]]), t([[0.0], [0.0], [0.0]])
    adv, ret = ppo_classic.compute_gae(rewards, values, dones, t([8.0]), gamma=0.5, gae_lambda=0.0)
    # A_t = r_t + 0.5*V_{t+1} - V_t: A0 = 1 + 1 - 1 = 1, A1 = 2 + 2 - 2 = 2, A2 = 3 + 4 - 4 = 3
    torch.testing.assert_close(adv, t([[1.0], [2.0], [3.0]]))
    torch.testing.assert_close(ret, t([[2.0], [4.0], [7.0]]))  # one-step targets r_t + 0.5*V_{t+1}


def test_gae_with_zero_values_and_lambda_one_equals_reward_to_go():
    rewards = t([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0], [1.0, 4.0]])
    dones = t([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    _, ret = ppo_classic.compute_gae(rewards, torch.zeros(4, 2), dones, torch.zeros(2), 0.9, 1.0)
    torch.testing.assert_close(ret, reinforce.reward_to_go(rewards, dones, 0.9))


# ---------------------------------------------------------------------------------------------------------
# reward_to_go: (T, N) tensors, dones[t] = 1 when the episode ended at step t, G after the last step = 0
# ---------------------------------------------------------------------------------------------------------
def test_reward_to_go_episode_ends_mid_batch_several_envs():
    rewards = t([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0], [1.0, 4.0]])
    dones = t([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    returns = reinforce.reward_to_go(rewards, dones, gamma=0.5)
    # env 0, two episodes (t=0..1 and t=2..3):
    #   G3 = 1, G2 = 1 + 0.5*1 = 1.5, G1 = 1 (ended), G0 = 1 + 0.5*1 = 1.5
    # env 1, one unfinished episode, G after the last step = 0:
    #   G3 = 4, G2 = 3 + 0.5*4 = 5, G1 = 2 + 0.5*5 = 4.5, G0 = 1 + 0.5*4.5 = 3.25
    torch.testing.assert_close(returns, t([[1.5, 3.25], [1.0, 4.5], [1.5, 5.0], [1.0, 4.0]]))


def test_reward_to_go_gamma_one_is_the_sum_of_the_rest_of_the_episode():
    rewards, dones = t([[2.0], [3.0], [5.0], [7.0]]), t([[0.0], [0.0], [1.0], [1.0]])
    returns = reinforce.reward_to_go(rewards, dones, gamma=1.0)
    # episode t=0..2: 2+3+5 = 10, 3+5 = 8, 5; episode t=3: 7
    torch.testing.assert_close(returns, t([[10.0], [8.0], [5.0], [7.0]]))


def test_reward_to_go_padding_after_the_end_adds_nothing():
    # reinforce.py pads an env that finished early with reward 0, done 1: the real steps must not change
    rewards, dones = t([[1.0], [1.0], [0.0], [0.0]]), t([[0.0], [1.0], [1.0], [1.0]])
    returns = reinforce.reward_to_go(rewards, dones, gamma=0.9)
    torch.testing.assert_close(returns, t([[1.9], [1.0], [0.0], [0.0]]))  # G0 = 1 + 0.9*1


# ---------------------------------------------------------------------------------------------------------
# compute_psi (reinforce.py): every column one episode from t = 0; update_mean_var (ppo_classic.py)
# ---------------------------------------------------------------------------------------------------------
def test_compute_psi_each_choice():
    # one episode of 3 steps, gamma 0.5, lambda 0.5, V = (1, 2, 4)
    rewards, dones, values = t([[1.0], [2.0], [4.0]]), t([[0.0], [0.0], [1.0]]), t([[1.0], [2.0], [4.0]])
    # G2 = 4, G1 = 2 + 0.5*4 = 4, G0 = 1 + 0.5*4 = 3
    psi, returns = reinforce.compute_psi("episode-return", rewards, dones, values, 0.5, 0.5)
    torch.testing.assert_close(returns, t([[3.0], [4.0], [4.0]]))
    torch.testing.assert_close(psi, t([[3.0], [3.0], [3.0]]))  # R(tau) = G0 at every step
    psi, _ = reinforce.compute_psi("reward-to-go", rewards, dones, values, 0.5, 0.5)
    torch.testing.assert_close(psi, t([[3.0], [4.0], [4.0]]))
    psi, _ = reinforce.compute_psi("reward-to-go-baseline", rewards, dones, values, 0.5, 0.5)
    torch.testing.assert_close(psi, t([[2.0], [2.0], [0.0]]))  # 3-1, 4-2, 4-4
    psi, returns = reinforce.compute_psi("advantage", rewards, dones, values, 0.5, 0.5)
    # delta2 = 4 - 4 = 0 (ended), delta1 = 2 + 0.5*4 - 2 = 2, delta0 = 1 + 0.5*2 - 1 = 1
    # A2 = 0, A1 = 2 + 0.25*0 = 2, A0 = 1 + 0.25*2 = 1.5
    torch.testing.assert_close(psi, t([[1.5], [2.0], [0.0]]))
    torch.testing.assert_close(returns, t([[3.0], [4.0], [4.0]]))  # V's target stays G_t


def test_compute_psi_advantage_with_lambda_one_is_reward_to_go_minus_baseline():
    rewards, dones = t([[1.0, 2.0], [3.0, 0.0]]), t([[0.0, 1.0], [1.0, 1.0]])  # env 1: one step, then padding
    values = t([[0.5, 1.0], [2.0, 7.0]])
    adv, _ = reinforce.compute_psi("advantage", rewards, dones, values, 0.9, 1.0)
    rtg_b, _ = reinforce.compute_psi("reward-to-go-baseline", rewards, dones, values, 0.9, 1.0)
    torch.testing.assert_close(adv, rtg_b)  # env 0: G0 = 1 + 0.9*3 = 3.7, 3.7-0.5 = 3.2; G1 - V1 = 1


def test_update_mean_var_matches_the_whole_data():
    # stats of [1, 3] (mean 2, population var 1, count 2), then the batch [5, 7, 9] (mean 7, var 8/3):
    # delta = 5, n = 5, mean = 2 + 5*3/5 = 5, var = (1*2 + 8/3*3 + 25*2*3/5) / 5 = (2 + 8 + 30)/5 = 8
    # = the population variance of [1, 3, 5, 7, 9] (mean 5): (16 + 4 + 0 + 4 + 16) / 5 = 8
    mean, var, count = ppo_classic.update_mean_var(t([2.0]), t([1.0]), 2, t([[5.0], [7.0], [9.0]]))
    torch.testing.assert_close((mean, var), (t([5.0]), t([8.0])))
    assert count == 5


def test_discrete_policy_gives_categoricals_numbers_bit_for_bit():
    # get_action_and_value does Categorical(logits=..., validate_args=False)'s operations without the object: from the
    # same generator state the same actions and log-probs; given actions, the same log-probs, entropies and gradients
    torch.manual_seed(0)
    agent, x, advantages = ppo_classic.Agent(4, gym.spaces.Discrete(3)), torch.randn(128, 4), torch.randn(128)
    torch.manual_seed(1)
    action, logprob, entropy, _ = agent.get_action_and_value(x)
    torch.manual_seed(1)
    dist = torch.distributions.Categorical(logits=agent.actor(x), validate_args=False)
    expected = dist.sample()
    assert torch.equal(action, expected) and torch.equal(logprob, dist.log_prob(expected)) and entropy is None

    def loss_and_grads(logprob, entropy):  # the policy's part of the PPO loss
        loss = -(advantages * logprob.exp()).mean() - 0.01 * entropy.mean()
        return [loss, *torch.autograd.grad(loss, list(agent.actor.parameters()))]

    _, logprob, entropy, _ = agent.get_action_and_value(x, action)
    ours = [logprob, entropy, *loss_and_grads(logprob, entropy)]
    # a new object: the order in which the graph's nodes are made decides the order in which gradients add up
    dist = torch.distributions.Categorical(logits=agent.actor(x), validate_args=False)
    logprob, entropy = dist.log_prob(action), dist.entropy()
    theirs = [logprob, entropy, *loss_and_grads(logprob, entropy)]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("name", ["layer_init", "mlp", "make_env", "check_env", "log", "compute_gae"])
def test_shared_functions_are_identical(name):
    assert inspect.getsource(getattr(ppo_classic, name)) == inspect.getsource(getattr(reinforce, name))


# ---------------------------------------------------------------------------------------------------------
# end to end, in-process (the scripts are importable) in a temporary directory
# ---------------------------------------------------------------------------------------------------------
def run(monkeypatch, tmp_path, script, *flags):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *flags])
    SCRIPTS[script].main()
    run_dirs = sorted(glob.glob(str(tmp_path / "runs" / "*")))
    with open(os.path.join(run_dirs[-1], "metrics.jsonl")) as f:
        return run_dirs[-1], [json.loads(line) for line in f]


# 2048 steps: 4 updates of 4 envs x 128 steps (Discrete defaults), 1 of 4 envs x 512 steps (Box defaults)
@pytest.mark.parametrize("env_id, num_updates", [("CartPole-v1", 4), ("Acrobot-v1", 4), ("Pendulum-v1", 1)])
def test_ppo_runs_on_each_env(monkeypatch, tmp_path, env_id, num_updates):
    run_dir, records = run(monkeypatch, tmp_path, "ppo_classic", "--env-id", env_id, "--total-timesteps", "2048")
    updates = [r for r in records if "losses/value_loss" in r]
    episodes = [r for r in records if "charts/episodic_return" in r]
    assert len(updates) == num_updates
    assert all(set(METRICS) <= set(r) for r in updates)
    assert all(np.isfinite(r[k]) for r in updates for k in METRICS)
    assert episodes and all("charts/episodic_length" in r for r in episodes)  # each env ends >= 1 episode
    assert os.path.basename(run_dir).startswith(f"ppo_classic__{env_id}__1__")


@pytest.mark.parametrize(
    "env_id, psi",
    [
        ("CartPole-v1", "episode-return"),
        ("CartPole-v1", "reward-to-go"),
        ("CartPole-v1", "reward-to-go-baseline"),
        ("CartPole-v1", "advantage"),
        ("Acrobot-v1", "reward-to-go-baseline"),
        ("Pendulum-v1", "reward-to-go-baseline"),
    ],
)
def test_reinforce_runs(monkeypatch, tmp_path, env_id, psi):
    _, records = run(monkeypatch, tmp_path, "reinforce", "--env-id", env_id, "--psi", psi, "--total-timesteps", "2000")
    updates = [r for r in records if "losses/policy_loss" in r]
    episodes = [r for r in records if "charts/episodic_return" in r]
    assert updates and len(episodes) == 8 * len(updates)  # 8 envs = 8 whole episodes per update
    assert records[-1]["global_step"] == sum(r["charts/episodic_length"] for r in episodes) >= 2000
    names = {"charts/learning_rate", "charts/SPS", "losses/policy_loss", "losses/entropy"}
    if psi in ("reward-to-go-baseline", "advantage"):
        names |= {"losses/value_loss", "losses/explained_variance"}
    assert all(names <= set(r) and np.isfinite(r["losses/policy_loss"]) for r in updates)
    assert ("losses/value_loss" in updates[0]) == (psi in ("reward-to-go-baseline", "advantage"))


def test_ppo_same_seed_same_run(monkeypatch, tmp_path):
    flags = ["--total-timesteps", "1024"]
    _, a = run(monkeypatch, tmp_path, "ppo_classic", "--exp-name", "a", *flags)
    _, b = run(monkeypatch, tmp_path, "ppo_classic", "--exp-name", "b", *flags)
    drop = ("charts/SPS",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b
    ]


@pytest.mark.parametrize("script, total_timesteps, window", [("ppo_classic", "16384", 20), ("reinforce", "20000", 24)])
def test_learns_cartpole_a_little(monkeypatch, tmp_path, script, total_timesteps, window):
    _, records = run(monkeypatch, tmp_path, script, "--total-timesteps", total_timesteps)
    returns = [r["charts/episodic_return"] for r in records if "charts/episodic_return" in r]
    # a uniform random policy averages about 22 on CartPole
    assert np.mean(returns[:window]) < 30 and np.mean(returns[-window:]) > 45
    if script == "reinforce":  # V fitted by 80 regression steps per batch explains much of the return
        explained = [r["losses/explained_variance"] for r in records if "losses/explained_variance" in r]
        assert np.median(explained[-10:]) > 0.3  # measured: 0.67 (0.41 to 0.81)


@pytest.mark.parametrize(
    "script, flags, bootstrap",
    [
        ("ppo_classic", ["--num-steps=20"], True),  # one update of 4 envs x 20 steps
        ("reinforce", ["--psi", "reward-to-go-baseline"], True),
        ("reinforce", ["--psi", "advantage"], True),
        ("reinforce", ["--psi", "reward-to-go"], False),  # no V, nothing to bootstrap from
    ],
)
def test_truncation_bootstraps_from_the_final_observation(monkeypatch, tmp_path, script, flags, bootstrap):
    # Observation = step counter, reward 1, every episode truncated after 10 steps: the final obs is 10, the
    # reset obs 0. V is replaced by V(s) = 100*s + 7, so the last reward of an episode must become
    # 1 + 0.9*V(10) = 1 + 0.9*1007 = 907.3 -- not 1 + 0.9*V(0) = 7.3 (reset obs), nor 1 (no bootstrap).
    module = SCRIPTS[script]
    # (+ 0 * critic: reinforce.py's regression of V still has a graph to differentiate)
    monkeypatch.setattr(module.Agent, "get_value", lambda self, x: 100.0 * x[..., :1] + 7.0 + 0.0 * self.critic(x))
    seen = []  # the rewards that reach the return computation, (T, N) per update
    if script == "ppo_classic":
        compute_gae = module.compute_gae
        monkeypatch.setattr(module, "compute_gae", lambda r, *a: seen.append(r.clone()) or compute_gae(r, *a))
    else:
        compute_psi = module.compute_psi
        monkeypatch.setattr(module, "compute_psi", lambda p, r, *a: seen.append(r.clone()) or compute_psi(p, r, *a))
    run(monkeypatch, tmp_path, script, "--env-id=tests/StepCounter-v0", "--gamma=0.9", "--total-timesteps=80", *flags)
    rewards = torch.cat([r.flatten() for r in seen])
    rewards = rewards[rewards != 0.0]  # reinforce.py pads finished episodes with 0
    ends = rewards[rewards != 1.0]
    assert len(rewards) >= 80 and len(ends) == (len(rewards) // 10 if bootstrap else 0)
    torch.testing.assert_close(ends, torch.full_like(ends, 907.3))


@pytest.mark.parametrize("script", SCRIPTS)
def test_multidimensional_box_observation_is_flattened(monkeypatch, tmp_path, script):
    _, records = run(monkeypatch, tmp_path, script, "--env-id=tests/ImageObservation-v0", "--total-timesteps=600")
    assert any("losses/policy_loss" in r for r in records)


@pytest.mark.parametrize("script", SCRIPTS)
def test_module_colon_env_id(monkeypatch, tmp_path, script):
    # gymnasium's "module:EnvId": gym.make imports the module, which registers the env
    (tmp_path / "my_classic_envs.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('MyCartPole-v0', 'gymnasium.envs.classic_control:CartPoleEnv', max_episode_steps=50)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir, records = run(
        monkeypatch, tmp_path, script, "--env-id=my_classic_envs:MyCartPole-v0", "--total-timesteps=600"
    )
    assert max(r["charts/episodic_length"] for r in records if "charts/episodic_length" in r) <= 50


@pytest.mark.parametrize("script", SCRIPTS)
def test_capture_video_hint_names_the_right_extras(monkeypatch, tmp_path, script):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda m, *a: None if m in ("pygame", "moviepy") else find_spec(m, *a)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--capture-video"])
    with pytest.raises(SystemExit) as e:
        SCRIPTS[script].main()
    assert str(e.value) == (
        "error: --capture-video needs pygame (pip install 'gymnasium[classic-control]') "
        "and moviepy (pip install 'gymnasium[other]')"
    )
    assert not os.path.exists(tmp_path / "runs")


def test_ppo_observation_statistics_are_saved_and_used_frozen_in_evaluation(monkeypatch, tmp_path, capsys):
    flags = ["--env-id=Pendulum-v1", "--total-timesteps=2048", "--save-model", "--eval-episodes=1"]
    run_dir, _ = run(monkeypatch, tmp_path, "ppo_classic", *flags)
    model = os.path.join(run_dir, "ppo_classic.cleanrl_model")
    checkpoint = torch.load(model)
    # Box actions: norm_obs on by default; 4 envs: 4 reset observations + 4 per step for 512 steps
    assert checkpoint["norm_obs"] is True
    assert checkpoint["state_dict"]["obs_count"].item() == pytest.approx(1e-4 + 4 + 2048)
    assert (checkpoint["state_dict"]["obs_var"] != 1.0).all()
    calls = []
    normalize = ppo_classic.Agent.normalize
    monkeypatch.setattr(
        ppo_classic.Agent,
        "normalize",
        lambda self, x, update=False: calls.append((update, self.obs_count.item())) or normalize(self, x, update),
    )
    monkeypatch.setattr(sys, "argv", ["ppo_classic.py", "--eval-checkpoint", model, "--eval-episodes", "1"])
    ppo_classic.main()
    assert len(calls) == 200  # one Pendulum episode, every observation normalised with the saved, frozen stats
    assert all(u is False and c == checkpoint["state_dict"]["obs_count"].item() for u, c in calls)


@pytest.mark.parametrize("script", SCRIPTS)
def test_save_and_eval(monkeypatch, tmp_path, capsys, script):
    flags = ["--total-timesteps", SHORT_RUN[script], "--save-model", "--eval-episodes", "2"]
    run_dir, records = run(monkeypatch, tmp_path, script, *flags)
    assert len([r for r in records if "eval/episodic_return" in r]) == 2
    model = os.path.join(run_dir, f"{script}.cleanrl_model")
    capsys.readouterr()
    # the same episodes as the evaluation at the end of the run (seed + 10000), so the same returns
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--eval-checkpoint", model, "--eval-episodes", "2"])
    SCRIPTS[script].main()
    mean = sum(r["eval/episodic_return"] for r in records if "eval/episodic_return" in r) / 2
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"eval/episodic_return={mean:.2f} +- ")


@pytest.mark.parametrize("script", SCRIPTS)
def test_tensorboard_device_and_eta(monkeypatch, tmp_path, capsys, script):
    run_dir, records = run(monkeypatch, tmp_path, script, "--total-timesteps", SHORT_RUN[script])
    events = EventAccumulator(run_dir)
    events.Reload()
    # TensorBoard beside metrics.jsonl: the same names, steps and values
    sps = [(r["global_step"], r["charts/SPS"]) for r in records if "charts/SPS" in r]
    assert [(e.step, e.value) for e in events.Scalars("charts/SPS")] == sps and len(sps) >= 2
    with open(os.path.join(run_dir, "args.json")) as f:
        assert json.load(f)["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "ETA=00:00:" in capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_track_wandb_offline(tmp_path, script):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("WANDB_SERVICE", None)  # left behind by an in-process wandb.init of another test: its service is gone
    cmd = [sys.executable, os.path.join(REPO, f"{script}.py"), "--track", "--total-timesteps", SHORT_RUN[script]]
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    offline_runs = glob.glob(str(tmp_path / "runs" / "*" / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(offline_runs) == 1 and os.path.getsize(offline_runs[0]) > 0


@pytest.mark.parametrize("script, signum", [("ppo_classic", signal.SIGINT), ("reinforce", signal.SIGTERM)])
def test_ctrl_c_and_sigterm_save_model_and_metrics(tmp_path, script, signum):
    cmd = [sys.executable, os.path.join(REPO, f"{script}.py"), "--save-model", "--total-timesteps=9999999"]
    # SIGINT back to its default in the child: a shell runs background jobs with it ignored, and Python then
    # installs no KeyboardInterrupt handler (CI launched with `&` would hang here)
    reset = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True, preexec_fn=reset)
    for line in proc.stdout:  # wait for the first finished update
        if line.startswith("iter="):
            break
    proc.send_signal(signum)  # SIGTERM, a scheduler's preemption, stops as Ctrl-C does
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "stopped at global_step=" in out and "(KeyboardInterrupt)" in out
    run_dir = glob.glob(str(tmp_path / "runs" / "*"))[0]
    assert os.path.getsize(os.path.join(run_dir, f"{script}.cleanrl_model")) > 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert any("losses/policy_loss" in json.loads(line) for line in f)


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_error_saves_first_then_shows_its_traceback(tmp_path, monkeypatch, script):
    # log() fails at its second call, in iteration 2: the agent is saved, then the error itself propagates
    module, calls, real_log = SCRIPTS[script], [], SCRIPTS[script].log

    def failing_log(*args):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a disk error, say")
        return real_log(*args)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module, "log", failing_log)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--save-model", "--total-timesteps", "4096"])
    with pytest.raises(ValueError, match="a disk error, say"):
        module.main()
    (model,) = glob.glob(str(tmp_path / "runs" / "*" / f"{script}.cleanrl_model"))
    assert os.path.getsize(model) > 0
    with open(model, "r+b") as f:  # a truncated agent file: one line, not an unpickling traceback
        f.truncate(100)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--eval-checkpoint", model])
    with pytest.raises(SystemExit, match=r"^error: --eval-checkpoint .* cannot be read \(\w+\)$"):
        module.main()


# ---------------------------------------------------------------------------------------------------------
# bad input: one line naming the flag
# ---------------------------------------------------------------------------------------------------------
BAD_INPUT = [
    (["--env-id", "NoSuchEnv-v0"], UNKNOWN_ENV),
    (["--env-id", "tests/MultiBinaryAction-v0"], "error: --env-id tests/MultiBinaryAction-v0 has action space "),
    (["--env-id", "FrozenLake-v1"], "error: --env-id FrozenLake-v1 has observation space Discrete(16)"),
    (["--env-id", "Blackjack-v1"], "error: --env-id Blackjack-v1 has observation space Tuple("),
    (["--env-id", "tests/DictObservation-v0"], "error: --env-id tests/DictObservation-v0 has observation space Dict("),
    (["--env-id", "no_such_module:Env-v0"], "error: --env-id no_such_module:Env-v0 is not a registered Gymnasium"),
    (["--eval-checkpoint", "missing.pt"], "error: --eval-checkpoint missing.pt cannot be read (FileNotFoundError)"),
]


@pytest.mark.parametrize(
    "script, flags, message",
    [(script, flags, message) for script in SCRIPTS for flags, message in BAD_INPUT]
    + [("ppo_classic", ["--num-minibatches", "3"], BAD_MINIBATCHES)]
    + [("ppo_classic", ["--total-timesteps", "100"], "error: --total-timesteps must be at least one batch")]
    + [("ppo_classic", ["--num-envs", "1", "--num-steps", "4", "--num-minibatches", "4"], "error: --norm-adv needs")]
    + [("reinforce", ["--vf-iters", "0"], "error: --vf-iters must be at least 1 (got 0)")],
)
def test_bad_input(monkeypatch, tmp_path, script, flags, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *flags])
    with pytest.raises(SystemExit) as e:
        SCRIPTS[script].main()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "runs")  # nothing is created before the input is checked


@pytest.mark.parametrize("script", SCRIPTS)
def test_cli_error_is_one_line_and_import_prints_nothing(tmp_path, script):
    cmd = [sys.executable, os.path.join(REPO, f"{script}.py"), "--env-id", "NoSuchEnv-v0"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr == UNKNOWN_ENV + "\n"
    p = subprocess.run([sys.executable, "-c", f"import {script}"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == ""
