"""PPO-Clip on Gymnasium classic control: CartPole-v1, Acrobot-v1 (discrete), Pendulum-v1 (continuous).

Proximal Policy Optimization (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) with Generalized Advantage
Estimation (Schulman et al. 2016, https://arxiv.org/abs/1506.02438), written like CleanRL's ppo.py (Huang et al. 2022,
"The 37 Implementation Details of PPO", https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/):
the same flags and metric names. With Discrete actions the defaults are ppo.py's, so runs compare with CleanRL's; with
Box actions they differ from ppo_continuous_action.py's where detail 17 says. Details 6, 7, 18-22 differ from CleanRL.

Usage: python ppo_classic.py --env-id CartPole-v1 --total-timesteps 500000 --seed 1
       python ppo_classic.py --env-id Pendulum-v1          # Box defaults: learns with no other flag

Implementation details ([n] = number in the 37-details post):
1. N envs x T steps per rollout in one SyncVectorEnv [1]: a fixed-size batch from cheap CPU parallelism.
2. Orthogonal init, gain sqrt(2) hidden, 0.01 policy head, 1.0 value head, zero biases [2]: near-uniform at first.
3. Adam with eps=1e-5 [3]: the value OpenAI baselines uses; steadier than the 1e-8 default.
4. Learning rate annealed linearly towards 0 [4]: smaller steps as the policy converges.
5. GAE(lambda) over the (T, N) rollout, cut at episode ends [5]: trades TD bias against MC variance.
6. Truncation bootstraps: r_t += gamma * V(final obs) when the time limit ends an episode, not when it terminates:
   reaching CartPole's 500-step limit is not a failure (CleanRL counts it as one: vwxyzjn/cleanrl#198).
7. Autoreset mode set explicitly to SAME_STEP: the final obs arrives in infos["final_obs"] in the step that ends the
   episode, so no bogus reset transition enters the batch (gymnasium >= 1.0).
8. update-epochs passes over the batch in shuffled minibatches [6]: each sample is used several times.
9. Advantages normalised per minibatch [7]: the policy step does not depend on the reward scale.
10. Clipped surrogate objective [8]: the pessimistic bound that keeps the policy near the rollout one.
11. Clipped value loss [9]: no gradient moves a prediction more than clip-coef past its rollout value.
12. Entropy bonus [10]: slows the collapse of the policy onto one action.
13. Global gradient-norm clipping at max-grad-norm [11]: bounds the size of any single step.
14. approx_kl with the k3 estimator and clipfrac logged [12], early stop at --target-kl if set.
15. Separate 64-64 tanh actor and critic [13]: no interference between policy and value gradients.
16. Box actions: Gaussian with a state-independent log-std, log-probs summed over action dims [23-25]; the unclipped
    sample is stored and only the env sees the action clipped to bounds [27].
17. Defaults per action space (DEFAULTS; a flag given wins). Discrete: ppo.py's. Box: observations and rewards
    normalised and clipped at +-10 [28-31], ent-coef 0 and 10 epochs, as ppo_continuous_action.py, but 4 envs x 512
    steps, lr 1e-3, 16 minibatches and gamma 0.9 (it has 1 x 2048, 3e-4, 32 and 0.99): why, and the 5 seeds x 200k
    steps that measured it, in docs/ppo_classic.md.
18. Observation statistics live in the agent (buffers obs_mean, obs_var, obs_count; one set for all envs): saved with
    --save-model, restored by --eval-checkpoint, applied frozen in evaluation (CleanRL's env wrapper loses them).
19. Box observations of any shape are flattened (FlattenObservation); Dict/Tuple spaces are refused.
20. Episode statistics from gymnasium 1.x's vector RecordEpisodeStatistics inside the reward scaling: raw returns.
21. Every loss logged is the mean over all minibatches of the update (CleanRL logs the last one only).
22. Speed, same numbers: one torch thread (64-unit layers); Categorical's operations without its object (benchmarks/).
"""

import importlib.util
import json
import os
import random
import signal
import time
from dataclasses import asdict, dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import tyro
from torch.distributions import Normal
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    # Experiment
    exp_name: str = "ppo_classic"
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
    """path of a saved agent to evaluate instead of training (episodes seeded seed + 10000, as at a run's end)"""
    eval_episodes: int = 10
    """the number of episodes of an evaluation (actions: argmax for discrete, mean for continuous)"""

    # Algorithm (None: the default of the action space, DEFAULTS below)
    env_id: str = "CartPole-v1"
    """the id of the environment (`module:EnvId` imports `module` first, which may register it)"""
    total_timesteps: int = 500000
    """total timesteps of the experiment"""
    learning_rate: float | None = None
    """the learning rate of the optimizer (default: 2.5e-4 Discrete, 1e-3 Box)"""
    num_envs: int | None = None
    """the number of parallel game environments (default: 4 Discrete and Box)"""
    num_steps: int | None = None
    """the number of steps to run in each environment per policy rollout (default: 128 Discrete, 512 Box)"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float | None = None
    """the discount factor gamma (default: 0.99 Discrete, 0.9 Box)"""
    gae_lambda: float = 0.95
    """the lambda for the generalized advantage estimation"""
    num_minibatches: int | None = None
    """the number of mini-batches (default: 4 Discrete, 16 Box)"""
    update_epochs: int | None = None
    """the K epochs to update the policy (default: 4 Discrete, 10 Box)"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function, as per the paper"""
    ent_coef: float | None = None
    """coefficient of the entropy (default: 0.01 Discrete, 0.0 Box)"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""
    target_kl: float | None = None
    """the target KL divergence threshold: stop the update epochs when the last minibatch's approx_kl (k3) exceeds it"""
    norm_obs: bool | None = None
    """normalise observations by running stats saved with the agent, clip at +-10 (default: off Discrete, on Box)"""
    norm_reward: bool | None = None
    """scale rewards by a running std of the discounted return, clip to +-10 (default: off Discrete, on Box)"""


# detail 17: (Discrete, Box): CleanRL ppo.py's defaults for Discrete actions; for Box, ones measured to learn Pendulum
DEFAULTS = {
    "learning_rate": (2.5e-4, 1e-3),
    "num_envs": (4, 4),
    "num_steps": (128, 512),
    "num_minibatches": (4, 16),
    "update_epochs": (4, 10),
    "ent_coef": (0.01, 0.0),
    "gamma": (0.99, 0.9),
    "norm_obs": (False, True),
    "norm_reward": (False, True),
}


# ALGO LOGIC: numerics
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


def update_mean_var(mean, var, count, x):
    """Folds a batch x (B, D) into running per-dimension statistics (Chan et al.'s parallel algorithm).

    delta = mean(x) - mean,  n = count + B
    mean' = mean + delta * B / n
    var'  = (var * count + var(x) * B + delta^2 * count * B / n) / n          (population variances)
    """
    batch_mean, batch_var, batch_count = x.mean(0), x.var(0, unbiased=False), x.shape[0]
    delta, total = batch_mean - mean, count + batch_count
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return mean + delta * batch_count / total, m2 / total, total


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
    def __init__(self, obs_dim, action_space, norm_obs=False):
        super().__init__()
        self.continuous, self.norm_obs = isinstance(action_space, gym.spaces.Box), norm_obs
        # detail 18: buffers, so the statistics are saved and restored with the weights
        self.register_buffer("obs_mean", torch.zeros(obs_dim))
        self.register_buffer("obs_var", torch.ones(obs_dim))
        self.register_buffer("obs_count", torch.tensor(1e-4))
        act_dim = action_space.shape[0] if self.continuous else action_space.n
        self.critic = mlp(obs_dim, 1, out_std=1.0)
        self.actor = mlp(obs_dim, act_dim, out_std=0.01)  # logits, or the Gaussian mean
        if self.continuous:
            self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def normalize(self, x, update=False):
        """(x - mean) / std clipped to +-10 if norm_obs; update=True (rollouts only) first folds x into the stats."""
        if not self.norm_obs:
            return x
        if update:
            self.obs_mean, self.obs_var, self.obs_count = update_mean_var(
                self.obs_mean, self.obs_var, self.obs_count, x
            )
        return ((x - self.obs_mean) / (self.obs_var + 1e-8).sqrt()).clamp(-10.0, 10.0)

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        """action (sampled if None: the rollout), its log-prob, the entropy (None in a Discrete rollout), V(x)."""
        out = self.actor(x)
        if self.continuous:  # independent action dims: joint log-prob and entropy are sums
            dist = Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)
            if action is None:
                action = dist.sample()
            return action, dist.log_prob(action).sum(1), dist.entropy().sum(1), self.critic(x)
        # detail 22: Categorical(logits=out)'s operations in its order, without the object: the same numbers
        logits = out - out.logsumexp(-1, keepdim=True)  # log p
        if action is None:  # the rollout: the entropy only serves the update
            action = torch.multinomial(logits.softmax(-1), 1, True).squeeze(-1)
            return action, logits.gather(-1, action.unsqueeze(-1)).squeeze(-1), None, self.critic(x)
        logprob = logits.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        entropy = -(logits.clamp(min=torch.finfo(logits.dtype).min) * logits.softmax(-1)).sum(-1)
        return action, logprob, entropy, self.critic(x)

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
    agent = Agent(env.observation_space.shape[0], env.action_space, checkpoint["norm_obs"]).to(device)
    agent.load_state_dict(checkpoint["state_dict"])  # with the observation statistics, applied frozen below
    episodic_returns = []
    for episode in range(eval_episodes):
        obs, _ = env.reset(seed=seed + episode)
        done, episodic_return = False, 0.0
        while not done:
            with torch.no_grad():
                x = agent.normalize(torch.as_tensor(obs, dtype=torch.float32, device=device))
                action = agent.get_greedy_action(x)
            obs, reward, terminated, truncated, _ = env.step(action.cpu().numpy())
            episodic_return, done = episodic_return + float(reward), terminated or truncated
        episodic_returns.append(episodic_return)
    env.close()
    return episodic_returns


def batch_sizes(args):
    """The batch, minibatch and iteration counts of the flags; one line for a combination that cannot run."""
    batch_size = args.num_envs * args.num_steps
    if args.num_minibatches < 1 or batch_size % args.num_minibatches:
        got = f"got {args.num_minibatches} and {batch_size}"
        raise SystemExit(f"error: --num-minibatches must divide --num-envs * --num-steps ({got})")
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = args.total_timesteps // batch_size
    if num_iterations < 1:
        got = f"got {args.total_timesteps} and {batch_size}"
        raise SystemExit(f"error: --total-timesteps must be at least one batch, --num-envs * --num-steps ({got})")
    if args.norm_adv and minibatch_size < 2:
        got = f"got {args.num_minibatches} for a batch of {batch_size}"
        raise SystemExit(
            f"error: --norm-adv needs minibatches of 2 or more (one has no std): lower --num-minibatches ({got})"
        )
    return batch_size, minibatch_size, num_iterations


def start_run(args, device):
    """The run directory with args.json, its metrics.jsonl open, and the wandb run with --track (else None)."""
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
    return run_dir, metrics_file, wandb_run


def make_envs(args, run_dir):
    """The vector env: SAME_STEP autoreset puts the last obs of an ended episode in infos["final_obs"] (detail 7)."""
    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, i, args.capture_video, run_dir) for i in range(args.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        copy=False,  # the observations are copied into the storage anyway
    )
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)  # wraps first: logs the raw rewards
    if args.norm_reward:
        envs = gym.wrappers.vector.NormalizeReward(envs, gamma=args.gamma)
        envs = gym.wrappers.vector.ClipReward(envs, -10.0, 10.0)
    if isinstance(envs.single_action_space, gym.spaces.Box):
        envs = gym.wrappers.vector.ClipAction(envs)
    return envs


def finish_run(args, agent, envs, run_dir, global_step, metrics_file, wandb_run, device, stopped):
    """Saves the agent with --save-model and evaluates it if the run was not stopped; closes the files and the run."""
    envs.close()
    if args.save_model:
        model_path = f"{run_dir}/{args.exp_name}.cleanrl_model"
        torch.save({"env_id": args.env_id, "norm_obs": args.norm_obs, "state_dict": agent.state_dict()}, model_path)
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


def main():
    args = tyro.cli(Args)
    # 1 thread is the fastest for these tiny networks on CPU (measured in benchmarks/classic.py)
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.eval_checkpoint is not None:
        returns = evaluate(args.eval_checkpoint, args.eval_episodes, args.seed + 10_000, device)
        print(f"eval/episodic_return={np.mean(returns):.2f} +- {np.std(returns):.2f} over {len(returns)}")
        return
    action_space = check_env(args.env_id, args.capture_video)
    column = 1 if isinstance(action_space, gym.spaces.Box) else 0
    for name, defaults in DEFAULTS.items():  # detail 17: the flags left at None
        if getattr(args, name) is None:
            setattr(args, name, defaults[column])
    batch_size, minibatch_size, num_iterations = batch_sizes(args)
    run_dir, metrics_file, wandb_run = start_run(args, device)

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    envs = make_envs(args, run_dir)
    obs_shape, act_shape = envs.single_observation_space.shape, envs.single_action_space.shape
    agent = Agent(obs_shape[0], envs.single_action_space, args.norm_obs).to(device)
    # fused: one kernel for all parameters instead of a Python loop over them; the same Adam update
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)

    # ALGO LOGIC: storage setup
    T, N = args.num_steps, args.num_envs
    obs = torch.zeros((T, N) + obs_shape, device=device)
    act_dtype = torch.float32 if agent.continuous else torch.long
    actions = torch.zeros((T, N) + act_shape, dtype=act_dtype, device=device)
    old_logprobs = torch.zeros((T, N), device=device)  # log-probs of the actions under the rollout policy
    rewards = np.zeros((T, N), dtype=np.float32)  # env outputs stay numpy until the rollout ends
    dones = np.zeros((T, N), dtype=np.float32)
    values = torch.zeros((T, N), device=device)

    # TRY NOT TO MODIFY: start the game
    global_step = 0
    start_time = time.time()
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = agent.normalize(torch.as_tensor(next_obs, dtype=torch.float32, device=device), update=True)
    stopped = None  # Ctrl-C, SIGTERM (a preemption stops as Ctrl-C does) or an error: saves what there is first
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * args.learning_rate

            episode_returns = []
            for step in range(T):
                global_step += N
                obs[step] = next_obs
                with torch.inference_mode():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
                actions[step] = action
                old_logprobs[step] = logprob

                # TRY NOT TO MODIFY: execute the game and log data.
                next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
                # detail 6: bootstrap a truncated (not terminated) episode from V(final obs)
                bootstrap = truncations & ~terminations
                if bootstrap.any():
                    final_obs = np.stack(infos["final_obs"][bootstrap])  # (n_truncated, obs_dim)
                    with torch.inference_mode():
                        final_obs = agent.normalize(torch.as_tensor(final_obs, dtype=torch.float32, device=device))
                        final_values = agent.get_value(final_obs).flatten()
                    reward[bootstrap] += args.gamma * final_values.cpu().numpy()  # reward: (N,)
                rewards[step], dones[step] = reward, terminations | truncations
                next_obs = agent.normalize(torch.as_tensor(next_obs, dtype=torch.float32, device=device), update=True)
                if "episode" in infos:  # detail 20
                    for i in infos["_episode"].nonzero()[0]:
                        r, length = float(infos["episode"]["r"][i]), int(infos["episode"]["l"][i])
                        episode_returns.append(r)
                        episode = {
                            "charts/episodic_return": r,
                            "charts/episodic_length": length,
                        }
                        log(episode, global_step, metrics_file, wandb_run)

            # ALGO LOGIC: advantages; last_value is V(obs after the last step), masked if that step ended
            with torch.inference_mode():
                last_value = agent.get_value(next_obs).flatten()  # (N,)
                rewards_t, dones_t = torch.from_numpy(rewards).to(device), torch.from_numpy(dones).to(device)
                advantages, returns = compute_gae(rewards_t, values, dones_t, last_value, args.gamma, args.gae_lambda)

            # flatten the batch: (T, N, ...) -> (T*N, ...)
            b_obs = obs.reshape((-1,) + obs_shape)
            b_old_logprobs = old_logprobs.reshape(-1)
            b_actions = actions.reshape((-1,) + act_shape)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)

            # Optimizing the policy and value network; stats summed over every minibatch (detail 21)
            stats = torch.zeros(6, device=device)  # pg_loss, v_loss, entropy, old_approx_kl, approx_kl, clipfrac
            num_updates = 0
            for epoch in range(args.update_epochs):
                b_inds = torch.randperm(batch_size, device=device)
                for start in range(0, batch_size, minibatch_size):
                    mb_inds = b_inds[start : start + minibatch_size]
                    _, logprobs, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                    logratio = logprobs - b_old_logprobs[mb_inds]
                    ratio = logratio.exp()
                    with torch.no_grad():
                        # k1 and k3 estimators of KL(old || new), http://joschu.net/blog/kl-approx.html
                        old_approx_kl = (-logratio).mean()
                        approx_kl = ((ratio - 1) - logratio).mean()
                        clipfrac = ((ratio - 1.0).abs() > args.clip_coef).float().mean()

                    mb_advantages = b_advantages[mb_inds]
                    if args.norm_adv:
                        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

                    # Policy loss: max of the negated surrogates = min of the surrogates
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                    # Value loss
                    newvalue = newvalue.view(-1)
                    mb_returns = b_returns[mb_inds]
                    if args.clip_vloss:
                        mb_values = b_values[mb_inds]
                        v_loss_unclipped = (newvalue - mb_returns) ** 2
                        v_clipped = mb_values + torch.clamp(newvalue - mb_values, -args.clip_coef, args.clip_coef)
                        v_loss_clipped = (v_clipped - mb_returns) ** 2
                        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
                    else:
                        v_loss = 0.5 * ((newvalue - mb_returns) ** 2).mean()

                    entropy_loss = entropy.mean()
                    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                    stats += torch.stack([pg_loss, v_loss, entropy_loss, old_approx_kl, approx_kl, clipfrac]).detach()
                    num_updates += 1

                if args.target_kl is not None and approx_kl > args.target_kl:
                    break

            y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
            var_y = np.var(y_true)
            explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

            # TRY NOT TO MODIFY: record losses and speed
            pg, vl, ent, old_kl, kl, cf = (stats / num_updates).tolist()
            sps = int(global_step / (time.time() - start_time))
            metrics = {
                "charts/learning_rate": optimizer.param_groups[0]["lr"],
                "charts/SPS": sps,
                "losses/value_loss": vl,
                "losses/policy_loss": pg,
                "losses/entropy": ent,
                "losses/old_approx_kl": old_kl,
                "losses/approx_kl": kl,
                "losses/clipfrac": cf,
                "losses/explained_variance": float(explained_var),
            }
            log(metrics, global_step, metrics_file, wandb_run)
            ret = f"{np.mean(episode_returns):.1f}" if episode_returns else "-"
            eta = (num_iterations - iteration) * batch_size / max(sps, 1)  # seconds left at this pace
            print(
                f"iter={iteration}/{num_iterations} global_step={global_step} episodic_return={ret} "
                f"value_loss={vl:.3f} policy_loss={pg:.4f} entropy={ent:.3f} approx_kl={kl:.4f} SPS={sps} "
                f"ETA={time.strftime('%H:%M:%S', time.gmtime(eta))}"
            )
    except BaseException as e:
        stopped = e
        print(f"stopped at global_step={global_step} ({type(e).__name__}); saving what we have")
    finish_run(args, agent, envs, run_dir, global_step, metrics_file, wandb_run, device, stopped)


if __name__ == "__main__":
    main()
