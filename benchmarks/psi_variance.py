"""Variance of REINFORCE's policy-gradient estimate for each choice of Psi, at fixed policy snapshots on CartPole-v1.

Usage (from the repository root; about 3 CPU-minutes; on a shared machine, under `nice -n 10`):
    python benchmarks/psi_variance.py
    python benchmarks/psi_variance.py --from-csv    # measure nothing: the table and plot from psi_variance.csv
                                                    # (without the csv it says so and writes nothing)

1. Snapshots: `reinforce.py --save-model` (its defaults, seed 1) stopped after SNAPSHOTS steps; the same seed
   replays the same run, so each snapshot is the policy that run had at that step.
2. V: the snapshot's own V, refitted on --fit-batches fresh batches of that policy (--vf-iters Adam steps at
   1e-3 on each, as reinforce.py does per batch), so that it is close to V of the snapshot policy.
3. Then --batches batches of the script's size (8 whole episodes) from the frozen snapshot. On each batch, the
   gradient of reinforce.py's loss -mean_t log pi(a_t|s_t) Psi_t over the policy's parameters, for all four
   Psi on the same episodes, raw and normalised per batch (--norm-adv, the script's default).
   Reported per Psi: |mean g|, tr Cov(g) = mean |g - mean g|^2 (the variance of the estimate, summed over
   parameters) and the signal-to-noise ratio SNR = |mean g|^2 / tr Cov(g) (scale-free: the raw and normalised
   numbers compare, and so do the Psi).
Writes benchmarks/results/psi_variance.csv, psi_variance.md (also into the docs pages that quote it,
benchmarks/docs_tables.py) and psi_variance.png.
"""

import argparse
import csv
import glob
import os
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
sys.path.insert(0, REPO)
import gymnasium as gym  # noqa: E402

import reinforce  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from docs_tables import write_table  # noqa: E402

SNAPSHOTS = [1, 5_000, 15_000]  # --total-timesteps of the runs whose final policy is measured
PSIS = ["episode-return", "reward-to-go", "reward-to-go-baseline", "advantage"]


def snapshot(steps):
    """Trains reinforce.py (defaults, seed 1) for `steps` steps and returns the saved model's path."""
    cmd = [sys.executable, "reinforce.py", f"--total-timesteps={steps}", "--save-model"]
    cmd += ["--eval-episodes=1", f"--exp-name=psivar-{steps}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    run_dir = re.search(r"^run directory: (\S+)$", out, re.M).group(1)
    return glob.glob(os.path.join(REPO, run_dir, "*.cleanrl_model"))[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=50, help="batches per snapshot")
    p.add_argument("--fit-batches", type=int, default=4, help="batches to refit V on, per snapshot")
    p.add_argument("--vf-iters", type=int, default=80)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--from-csv", action="store_true", help="measure nothing: rewrite the table and plot from the csv")
    args = p.parse_args()
    if args.from_csv:  # the rows typed as below: counts int, normalised bool, psi str, the rest float
        types = dict(snapshot_steps=int, batches=int, psi=str, normalised=lambda v: v == "True")
        if not os.path.exists(os.path.join(RESULTS, "psi_variance.csv")):
            raise SystemExit(
                "error: --from-csv: benchmarks/results/psi_variance.csv does not exist: measure first "
                "(python benchmarks/psi_variance.py)"
            )
        with open(os.path.join(RESULTS, "psi_variance.csv")) as f:
            return report([{k: types.get(k, float)(v) for k, v in r.items()} for r in csv.DictReader(f)])
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    os.makedirs(RESULTS, exist_ok=True)
    a = reinforce.Args()
    envs = gym.vector.SyncVectorEnv(
        [reinforce.make_env("CartPole-v1", i, False, None) for i in range(a.num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs.reset(seed=args.seed)

    rows = []
    for steps in SNAPSHOTS:
        checkpoint = torch.load(snapshot(steps))
        agent = reinforce.Agent(envs.single_observation_space.shape[0], envs.single_action_space, True)
        agent.load_state_dict(checkpoint["state_dict"])
        vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=a.vf_learning_rate)
        for _ in range(args.fit_batches):  # V of this policy (detail 2 of the docstring above)
            obs, _, rewards, bootstraps, dones, masks = reinforce.rollout(envs, agent, a.gamma, "cpu")
            returns = reinforce.reward_to_go(rewards + bootstraps, dones, a.gamma)
            for _ in range(args.vf_iters):
                v_loss = (((agent.get_value(obs).squeeze(-1) - returns) ** 2) * masks).sum() / masks.sum()
                vf_optimizer.zero_grad()
                v_loss.backward()
                vf_optimizer.step()

        params = list(agent.actor.parameters())
        grads = {(psi, norm): [] for psi in PSIS for norm in (False, True)}  # -> (batches, num_params)
        episode_returns = []
        for _ in range(args.batches):
            obs, actions, rewards, bootstraps, dones, masks = reinforce.rollout(envs, agent, a.gamma, "cpu")
            episode_returns += rewards.sum(0).tolist()
            num_valid = masks.sum()
            with torch.no_grad():
                values = agent.get_value(obs).squeeze(-1)
            _, logprobs, _ = agent.get_action(obs, actions)  # (T, N)
            for psi_name in PSIS:
                psi, _ = reinforce.compute_psi(psi_name, rewards + bootstraps, dones, values, a.gamma, a.gae_lambda)
                for norm in (False, True):
                    weight = psi
                    if norm:  # as reinforce.py does with --norm-adv
                        mean = (psi * masks).sum() / num_valid
                        std = (((psi - mean) ** 2 * masks).sum() / (num_valid - 1).clamp(min=1)).sqrt()
                        weight = (psi - mean) / (std + 1e-8)
                    loss = -(logprobs * weight * masks).sum() / num_valid
                    g = torch.autograd.grad(loss, params, retain_graph=True)
                    grads[(psi_name, norm)].append(torch.cat([x.reshape(-1) for x in g]).numpy())
        for (psi_name, norm), g in grads.items():
            g = np.array(g, dtype=np.float64)  # (batches, num_params)
            mean = g.mean(0)
            tr_cov = float(((g - mean) ** 2).sum(1).sum() / (len(g) - 1))
            rows.append(
                {
                    "snapshot_steps": steps,
                    "policy_mean_return": round(float(np.mean(episode_returns)), 1),
                    "psi": psi_name,
                    "normalised": norm,
                    "batches": len(g),
                    "mean_grad_norm": float(f"{np.linalg.norm(mean):.4g}"),
                    "trace_cov": float(f"{tr_cov:.4g}"),
                    "snr": float(f"{np.linalg.norm(mean) ** 2 / tr_cov:.4g}"),
                }
            )
        print(f"snapshot {steps}: mean return {np.mean(episode_returns):.1f}", flush=True)
    envs.close()

    with open(os.path.join(RESULTS, "psi_variance.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    report(rows)


def report(rows):
    """psi_variance.md and psi_variance.png from the rows of psi_variance.csv."""
    batches = rows[0]["batches"]
    lines = [
        f"Policy-gradient estimate per Psi, CartPole-v1, {batches} batches of 8 episodes per snapshot.",
        "tr Cov: variance of the gradient estimate summed over the policy's parameters (raw Psi);",
        "SNR = |mean g|^2 / tr Cov, raw Psi and normalised per batch (reinforce.py's default).",
        "",
        "| snapshot (steps, mean return) | Psi | \\|mean g\\| (raw) | tr Cov (raw) | SNR raw | SNR normalised |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for steps in SNAPSHOTS:
        for psi_name in PSIS:
            raw, nrm = [next(r for r in rows if r["snapshot_steps"] == steps and r["psi"] == psi_name
                             and r["normalised"] == n) for n in (False, True)]  # fmt: skip
            lines.append(
                f"| {steps:,} ({raw['policy_mean_return']}) | {psi_name} | {raw['mean_grad_norm']:.3g} "
                f"| {raw['trace_cov']:.3g} | {raw['snr']:.3g} | {nrm['snr']:.3g} |"
            )
    write_table("psi_variance.md", "\n".join(lines))
    print("\n".join(lines))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.2
    x = np.arange(len(SNAPSHOTS))
    for k, psi_name in enumerate(PSIS):
        for ax, key, norm in [(axes[0], "trace_cov", False), (axes[1], "snr", False)]:
            vals = [next(r[key] for r in rows if r["snapshot_steps"] == s and r["psi"] == psi_name
                         and r["normalised"] == norm) for s in SNAPSHOTS]  # fmt: skip
            ax.bar(x + (k - 1.5) * width, vals, width, label=psi_name)
    labels = [f"{s:,} steps\nreturn {next(r['policy_mean_return'] for r in rows if r['snapshot_steps'] == s)}"
              for s in SNAPSHOTS]  # fmt: skip
    for ax, title in [(axes[0], "variance of the estimate, tr Cov(g) (raw Psi)"), (axes[1], "SNR |mean g|^2 / tr Cov")]:
        ax.set(yscale="log", title=title, xticks=x, xticklabels=labels)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"REINFORCE on CartPole-v1: gradient estimates of 8-episode batches, {batches} per snapshot")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "psi_variance.png"), dpi=100)


if __name__ == "__main__":
    main()
