"""REINFORCE (vanilla policy gradient) on Gymnasium classic control: CartPole-v1, Acrobot-v1, Pendulum-v1.

REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms for connectionist
reinforcement learning") climbs the policy gradient estimated from whole sampled episodes:

    grad J(theta) = E[ sum_t grad log pi_theta(a_t | s_t) * Psi_t ]

with a selectable weight Psi_t (--psi), in the order the variance drops (Spinning Up, "Intro to Policy
Optimization"; Schulman et al. 2016, https://arxiv.org/abs/1506.02438, section 2):
  episode-return         Psi_t = R(tau) = sum_k gamma^k r_k, the same weight for every step of an episode
  reward-to-go           Psi_t = G_t = sum_{k>=t} gamma^(k-t) r_k, an action cannot change past rewards
  reward-to-go-baseline  Psi_t = G_t - V(s_t), V a learned state-value baseline: same expectation, less noise
  advantage              Psi_t = GAE-lambda estimate of A(s_t, a_t) with the fitted V (Spinning Up's VPG;
                         Schulman et al. 2016, section 3): less variance still, some bias where V is wrong
Whether each choice really lowers the variance is measured in benchmarks/psi_variance.py (docs/reinforce.md).
Same flags, logging and metric names as ppo_classic.py, so the two compare directly (benchmarks/).

Usage: python reinforce.py --env-id CartPole-v1 --psi reward-to-go-baseline --total-timesteps 500000

Implementation details:
1. One update per batch of num-envs whole episodes, each env plays exactly one episode from a reset:
   Psi is a Monte-Carlo return, so it needs the episode's end; the batch averages out some noise. An env
   whose episode is over keeps stepping until the batch is complete; those steps are masked out and
   not counted in global_step.
2. An episode cut by the time limit (truncated, not terminated) bootstraps where a V exists (--psi
   reward-to-go-baseline, advantage): its last reward gets + gamma * V(final obs), as in ppo_classic.py.
   With episode-return and reward-to-go there is no V, so it counts as ended (Psi biased low near the limit).
3. Loss = mean over all valid steps of the batch of -log pi(a_t|s_t) * Psi_t (Spinning Up's estimator).
4. Log-probs are recomputed in one batched forward pass after the rollout (same policy, same values):
   the rollout runs without autograd and the backward pass sees a single (T, N) graph.
5. Psi normalised to mean 0, std 1 over the batch (--norm-adv): the step size stops depending on the
   reward scale and the episode length; it also acts as a constant baseline.
6. V(s) is a separate 64-64 tanh network with its own Adam (--vf-learning-rate), fitted to G_t after the
   policy step by --vf-iters full-batch MSE steps, as Spinning Up's VPG (80 at 1e-3): one shared step per
   batch left its explained variance near 0 on CartPole. Psi uses V before it is fitted to the batch,
   so the baseline does not depend on the batch's own actions.
7. Optional entropy bonus (--ent-coef, off by default): slows the collapse onto one action.
8. Orthogonal init with a 0.01 policy head and a Gaussian with state-independent log-std for Box
   actions, exactly as ppo_classic.py, but no observation or reward normalisation (its detail 17).
9. Plain Adam at a constant learning rate, no gradient clipping: REINFORCE as written; PPO's extra
   machinery stays in ppo_classic.py.
10. One torch thread: with 64-unit layers, thread hand-off costs more than it saves (benchmarks/).
11. Box observations of any shape are flattened (FlattenObservation); Dict/Tuple spaces are refused.
"""

import importlib.util
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from torch.distributions import Categorical, Normal
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    # Experiment
    exp_name: str = "reinforce"
    """the name of this experiment (first part of the run directory name)"""
    seed: int = 1
    """seed of the experiment (env i is seeded with seed + i)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda is used when available"""
    track: bool = False
    """if toggled, the run is tracked with Weights and Biases (WANDB_MODE=offline works)"""
    wandb_project_name: str = "cleanRL"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    capture_video: bool = False
    """whether to record videos of env 0 into the run directory (needs pygame and moviepy)"""
    save_model: bool = False
    """whether to save the agent to the run directory, then evaluate it for eval-episodes"""
    eval_checkpoint: str | None = None
    """path of a saved agent to evaluate for eval-episodes instead of training (episodes seeded as at the end of a run
    of the same --seed: seed + 10000)"""
    eval_episodes: int = 10
    """the number of episodes of an evaluation (actions: argmax for discrete, mean for continuous)"""

    # Algorithm
    env_id: str = "CartPole-v1"
    """the id of the environment"""
    total_timesteps: int = 500000
    """total timesteps of the experiment"""
    learning_rate: float = 3e-3
    """the learning rate of the optimizer"""
    num_envs: int = 8
    """the number of parallel game environments = the number of whole episodes per update"""
    gamma: float = 0.99
    """the discount factor gamma"""
    psi: Literal["episode-return", "reward-to-go", "reward-to-go-baseline", "advantage"] = "reward-to-go-baseline"
    """the policy-gradient weight Psi_t: R(tau), G_t, G_t - V(s_t), or the GAE advantage estimate with V"""
    gae_lambda: float = 0.97
    """the lambda of the advantage estimate (--psi advantage), Spinning Up's VPG default"""
    norm_adv: bool = True
    """toggles normalisation of Psi_t to mean 0 and std 1 over the batch"""
    ent_coef: float = 0.0
    """coefficient of the entropy bonus"""
    vf_learning_rate: float = 1e-3
    """the learning rate of V's own Adam optimizer (--psi reward-to-go-baseline or advantage)"""
    vf_iters: int = 80
    """full-batch regression steps of V on the returns, per batch (Spinning Up's VPG: 80)"""


# ALGO LOGIC: numerics
def reward_to_go(rewards, dones, gamma):
    """Discounted reward-to-go over a (T, N) batch of episodes.

    G_t = r_t + gamma * (1 - dones[t]) * G_{t+1}        (G_T = 0 after the last step)

    dones[t] = 1 when the episode ended at step t, so no reward of a later episode leaks into G_t.
    """
    returns = torch.zeros_like(rewards)  # (T, N)
    next_return = torch.zeros_like(rewards[0])  # (N,)
    for t in reversed(range(rewards.shape[0])):
        next_return = rewards[t] + gamma * (1.0 - dones[t]) * next_return
        returns[t] = next_return
    return returns


def compute_gae(rewards, values, dones, last_value, gamma, gae_lambda):
    """Generalized Advantage Estimation over a (T, N) rollout.

    delta_t = r_t + gamma * V_{t+1} * (1 - dones[t]) - V_t
    A_t     = delta_t + gamma * lambda * (1 - dones[t]) * A_{t+1}        (A_T = 0)
    returns = A + V                                                       (the value targets)

    dones[t] = 1 when the episode ended at step t; for a truncated episode the caller has already added
    gamma * V(final obs) to rewards[t]. V_T = last_value, the value of the observation after step T-1.
    """
    advantages = torch.zeros_like(rewards)  # (T, N)
    lastgaelam = torch.zeros_like(last_value)  # (N,)
    next_values = last_value  # (N,)
    for t in reversed(range(rewards.shape[0])):
        nonterminal = 1.0 - dones[t]  # (N,)
        delta = rewards[t] + gamma * next_values * nonterminal - values[t]
        lastgaelam = delta + gamma * gae_lambda * nonterminal * lastgaelam
        advantages[t] = lastgaelam
        next_values = values[t]
    return advantages, advantages + values


def compute_psi(psi, rewards, dones, values, gamma, gae_lambda):
    """Psi_t of each choice over a (T, N) batch in which every column is one episode starting at t = 0.

    episode-return         Psi_t = R(tau) = G_0
    reward-to-go           Psi_t = G_t
    reward-to-go-baseline  Psi_t = G_t - V(s_t)
    advantage              Psi_t = GAE(gamma, lambda) with V: sum_l (gamma*lambda)^l delta_{t+l}

    Returns (psi, G): G = reward_to_go(...) is the regression target of V. values: V(s_t), detached.
    """
    returns = reward_to_go(rewards, dones, gamma)  # (T, N)
    if psi == "episode-return":
        return returns[0].expand_as(returns), returns
    if psi == "reward-to-go":
        return returns, returns
    if psi == "reward-to-go-baseline":
        return returns - values, returns
    # every column ends inside the batch (dones = 1 at its last step), so no value after it is needed
    advantages, _ = compute_gae(rewards, values, dones, torch.zeros_like(values[0]), gamma, gae_lambda)
    return advantages, returns


# ALGO LOGIC: agent
def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(in_dim, out_dim, out_std):
    return nn.Sequential(
        layer_init(nn.Linear(in_dim, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, out_dim), std=out_std),
    )


class Agent(nn.Module):
    def __init__(self, obs_dim, action_space, baseline):
        super().__init__()
        self.continuous = isinstance(action_space, gym.spaces.Box)
        act_dim = action_space.shape[0] if self.continuous else action_space.n
        self.actor = mlp(obs_dim, act_dim, out_std=0.01)  # logits, or the Gaussian mean
        if self.continuous:
            self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))
        self.critic = mlp(obs_dim, 1, out_std=1.0) if baseline else None

    def get_value(self, x):
        return self.critic(x)

    def get_action(self, x, action=None):
        out = self.actor(x)
        if self.continuous:
            dist = Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
        else:
            dist = Categorical(logits=out, validate_args=False)
        if action is None:
            action = dist.sample()
        logprob, entropy = dist.log_prob(action), dist.entropy()
        if self.continuous:  # independent action dims: joint log-prob and entropy are sums
            logprob, entropy = logprob.sum(-1), entropy.sum(-1)
        return action, logprob, entropy

    def get_greedy_action(self, x):
        out = self.actor(x)
        return out if self.continuous else out.argmax(-1)


# TRY NOT TO MODIFY: environments, logging, evaluation
def make_env(env_id, idx, capture_video, run_dir):
    def thunk():
        if capture_video and idx == 0:
            env = gym.wrappers.RecordVideo(gym.make(env_id, render_mode="rgb_array"), f"{run_dir}/videos")
        else:
            env = gym.make(env_id)
        return gym.wrappers.FlattenObservation(env)  # a Box of any shape becomes 1-D, the MLP's input

    return thunk


def check_env(env_id, capture_video):
    """Refuses with one line, before anything is written, what the script cannot run; returns the action space."""
    try:
        env = gym.make(env_id)  # "module:EnvId" imports module first
    except gym.error.DependencyNotInstalled as e:
        raise SystemExit(f"error: --env-id {env_id} needs a package that is not installed: {e}")
    except (gym.error.UnregisteredEnv, ModuleNotFoundError):
        raise SystemExit(f"error: --env-id {env_id} is not a registered Gymnasium environment")
    observation_space, action_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(observation_space, gym.spaces.Box):
        raise SystemExit(f"error: --env-id {env_id} has observation space {observation_space}; need a Box")
    ok_box = isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1
    if not (ok_box or isinstance(action_space, gym.spaces.Discrete)):
        raise SystemExit(f"error: --env-id {env_id} has action space {action_space}; supported: Discrete and 1-D Box")
    extras = {"pygame": "classic-control", "moviepy": "other"}  # the gymnasium extra that brings each
    missing = [f"{m} (pip install 'gymnasium[{x}]')" for m, x in extras.items() if importlib.util.find_spec(m) is None]
    if capture_video and missing:
        raise SystemExit(f"error: --capture-video needs {' and '.join(missing)}")
    return action_space


TENSORBOARD = {}  # run directory -> its TensorBoard writer, made by log() on first use


def log(metrics, step, metrics_file, wandb_run):
    """A line of metrics.jsonl; the same scalars to TensorBoard beside it (`tensorboard --logdir runs`, as with
    CleanRL) and to wandb with --track."""
    metrics_file.write(json.dumps({"global_step": step, **metrics}) + "\n")
    run_dir = os.path.abspath(os.path.dirname(metrics_file.name))
    if run_dir not in TENSORBOARD:
        TENSORBOARD[run_dir] = SummaryWriter(run_dir)
    for key, value in metrics.items():
        TENSORBOARD[run_dir].add_scalar(key, value, step)
    TENSORBOARD[run_dir].flush()  # nothing closes the writer: each call's scalars reach the file at once
    if wandb_run is not None:
        wandb_run.log(metrics, step=step)


def evaluate(checkpoint_path, eval_episodes, seed, device):
    """Runs the saved agent for eval_episodes episodes with greedy actions; returns the episode returns."""
    try:
        checkpoint = torch.load(checkpoint_path, map_location=device)
    except Exception as e:  # no such file, a truncated one, or no agent
        raise SystemExit(f"error: --eval-checkpoint {checkpoint_path} cannot be read ({type(e).__name__})") from None
    env = gym.wrappers.FlattenObservation(gym.make(checkpoint["env_id"]))
    if isinstance(env.action_space, gym.spaces.Box):
        env = gym.wrappers.ClipAction(env)
    agent = Agent(env.observation_space.shape[0], env.action_space, checkpoint["baseline"])
    agent.load_state_dict(checkpoint["state_dict"])
    agent.to(device)
    episodic_returns = []
    for episode in range(eval_episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, episodic_return = False, 0.0
        while not done:
            with torch.no_grad():
                action = agent.get_greedy_action(torch.as_tensor(obs, dtype=torch.float32, device=device))
            obs, reward, terminated, truncated, _ = env.step(action.cpu().numpy())
            episodic_return, done = episodic_return + float(reward), terminated or truncated
        episodic_returns.append(episodic_return)
    env.close()
    return episodic_returns


def rollout(envs, agent, gamma, device):
    """Plays one whole episode in each env (detail 1); returns (T, N) tensors: obs, actions, rewards (raw),
    bootstraps (gamma * V(final obs) at the last step of a truncated episode when V exists, detail 2),
    dones (1 at and after an episode's last step) and masks (1 on the episode's own steps)."""
    next_obs, _ = envs.reset()
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
    active = np.ones(envs.num_envs, dtype=bool)  # (N,) env still in this iteration's episode
    obs, actions, rewards, bootstraps, dones, masks = [], [], [], [], [], []
    while active.any():
        with torch.inference_mode():
            action, _, _ = agent.get_action(next_obs)
        obs.append(next_obs)
        actions.append(action)
        next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
        bootstrap = np.zeros(envs.num_envs, dtype=np.float32)
        truncated = active & truncations & ~terminations
        if agent.critic is not None and truncated.any():
            final_obs = torch.as_tensor(np.stack(infos["final_obs"][truncated]), dtype=torch.float32, device=device)
            with torch.inference_mode():
                bootstrap[truncated] = gamma * agent.get_value(final_obs).flatten().cpu().numpy()
        rewards.append(torch.as_tensor(reward * active, dtype=torch.float32))
        bootstraps.append(torch.as_tensor(bootstrap))
        dones.append(torch.as_tensor(terminations | truncations | ~active, dtype=torch.float32))
        masks.append(torch.as_tensor(active, dtype=torch.float32))
        active = active & ~(terminations | truncations)
        next_obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
    obs, actions = torch.stack(obs), torch.stack(actions)  # (T, N, obs_dim), (T, N[, act_dim])
    rest = [torch.stack(x).to(device) for x in (rewards, bootstraps, dones, masks)]  # (T, N) each
    return obs, actions, *rest


def main():
    args = tyro.cli(Args)
    # 1 thread is the fastest for these tiny networks on CPU (measured in benchmarks/classic.py)
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.eval_checkpoint is not None:
        returns = evaluate(args.eval_checkpoint, args.eval_episodes, args.seed + 10_000, device)
        print(f"eval/episodic_return={np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)}")
        return
    check_env(args.env_id, args.capture_video)
    if args.vf_iters < 1:
        raise SystemExit(f"error: --vf-iters must be at least 1 (got {args.vf_iters})")

    run_name = f"{args.exp_name}__{args.env_id.replace('/', '-').replace(':', '-')}__{args.seed}__{int(time.time())}"
    run_dir = f"runs/{run_name}"
    os.makedirs(run_dir, exist_ok=True)
    with open(f"{run_dir}/args.json", "w") as f:
        json.dump(asdict(args) | {"device": str(device)}, f, indent=1)
    metrics_file = open(f"{run_dir}/metrics.jsonl", "w", buffering=1)  # line-buffered: each line on disk at once
    print(f"run directory: {run_dir}")
    wandb_run = None
    if args.track:
        import wandb

        wandb_run = wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            config=asdict(args),
            name=run_name,
            dir=run_dir,
            save_code=True,
        )

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    # env setup: every iteration resets all envs; an env whose episode has ended is ignored until then
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, i, args.capture_video, run_dir) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    if isinstance(envs.single_action_space, gym.spaces.Box):
        envs = gym.wrappers.vector.ClipAction(envs)
    baseline = args.psi in ("reward-to-go-baseline", "advantage")
    agent = Agent(envs.single_observation_space.shape[0], envs.single_action_space, baseline).to(device)
    # detail 6: the policy and V have their own optimizers; fused: one kernel for all parameters
    policy_params = [p for name, p in agent.named_parameters() if not name.startswith("critic.")]
    optimizer = torch.optim.Adam(policy_params, lr=args.learning_rate, fused=True)
    if baseline:
        vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=args.vf_learning_rate, fused=True)

    # TRY NOT TO MODIFY: start the game
    global_step, iteration = 0, 0
    start_time = time.time()
    envs.reset(seed=args.seed)
    stopped = None  # Ctrl-C, SIGTERM (a preemption stops as Ctrl-C does) or an error: saves what there is first
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while global_step < args.total_timesteps:
            iteration += 1
            obs, actions, rewards, bootstraps, dones, masks = rollout(envs, agent, args.gamma, device)
            global_step += int(masks.sum())
            episodic_returns, episodic_lengths = rewards.sum(0).tolist(), masks.sum(0).long().tolist()
            for r, length in zip(episodic_returns, episodic_lengths):
                episode = {
                    "charts/episodic_return": r,
                    "charts/episodic_length": length,
                }
                log(episode, global_step, metrics_file, wandb_run)

            # ALGO LOGIC: Psi_t for every step with the V that the batch has not been fitted on (detail 6)
            with torch.no_grad():
                values = agent.get_value(obs).squeeze(-1) if baseline else torch.zeros_like(rewards)  # (T, N)
            psi, returns = compute_psi(args.psi, rewards + bootstraps, dones, values, args.gamma, args.gae_lambda)
            num_valid = masks.sum()
            if args.norm_adv:
                mean = (psi * masks).sum() / num_valid
                std = (((psi - mean) ** 2 * masks).sum() / (num_valid - 1).clamp(min=1)).sqrt()
                psi = (psi - mean) / (std + 1e-8)

            # one policy-gradient step on the whole batch
            _, logprobs, entropy = agent.get_action(obs, actions)  # (T, N)
            pg_loss = -(logprobs * psi * masks).sum() / num_valid
            entropy_loss = (entropy * masks).sum() / num_valid
            optimizer.zero_grad()
            (pg_loss - args.ent_coef * entropy_loss).backward()
            optimizer.step()

            metrics = {"charts/learning_rate": args.learning_rate}
            if baseline:
                # explained variance of the V that weighted this batch, then vf-iters regression steps on it
                valid = masks.bool()
                y_pred, y_true = values[valid].cpu().numpy(), returns[valid].cpu().numpy()
                var_y = np.var(y_true)
                explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
                for _ in range(args.vf_iters):
                    v_loss = 0.5 * (((agent.get_value(obs).squeeze(-1) - returns) ** 2) * masks).sum() / num_valid
                    vf_optimizer.zero_grad()
                    v_loss.backward()
                    vf_optimizer.step()
                metrics["losses/value_loss"] = v_loss.item()
                metrics["losses/explained_variance"] = float(explained_var)

            # TRY NOT TO MODIFY: record losses and speed
            sps = int(global_step / (time.time() - start_time))
            metrics |= {"charts/SPS": sps, "losses/policy_loss": pg_loss.item(), "losses/entropy": entropy_loss.item()}
            log(metrics, global_step, metrics_file, wandb_run)
            eta = max(args.total_timesteps - global_step, 0) / max(sps, 1)  # seconds left at this pace
            print(
                f"iter={iteration} global_step={global_step} episodic_return={np.mean(episodic_returns):.1f} "
                f"policy_loss={pg_loss.item():.4f} entropy={entropy_loss.item():.3f} SPS={sps} "
                f"ETA={time.strftime('%H:%M:%S', time.gmtime(eta))}"
            )
    except BaseException as e:
        stopped = e
        print(f"stopped at global_step={global_step} ({type(e).__name__}); saving what we have")

    envs.close()
    if args.save_model:
        model_path = f"{run_dir}/{args.exp_name}.cleanrl_model"
        torch.save({"env_id": args.env_id, "baseline": baseline, "state_dict": agent.state_dict()}, model_path)
        print(f"model saved to {model_path}")
        if stopped is None:
            returns = evaluate(model_path, args.eval_episodes, args.seed + 10_000, device)
            for r in returns:
                log({"eval/episodic_return": r}, global_step, metrics_file, wandb_run)
            print(f"eval/episodic_return={np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)}")
    metrics_file.close()
    if wandb_run is not None:
        wandb_run.finish()
    if stopped is not None:  # an error's own traceback, after the save
        raise SystemExit(130) if isinstance(stopped, KeyboardInterrupt) else stopped


if __name__ == "__main__":
    main()
