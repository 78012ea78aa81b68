"""Learning curves of ppo_llm.py and grpo_llm.py on the embedded arithmetic task, over seeds (CPU).

Each configuration runs once per seed as its own process with the scripts' defaults (one torch thread),
--jobs at a time, into benchmarks/runs/ (ignored by git). Then the metrics.jsonl files are summarised:

- benchmarks/results/llm_learning.md: held-out accuracy at the start and the end, time and samples to
  reach 90%, final KL, per configuration (mean and spread over seeds);
- benchmarks/results/llm_accuracy.png: held-out accuracy and KL against updates, samples and wall time;
- benchmarks/results/llm_reward_hacking.png: with the learned reward model, its score against the true
  accuracy of the same rollouts: where the two part, the policy is exploiting the reward model.

    python benchmarks/llm_learning.py                   # run everything, then summarise
    python benchmarks/llm_learning.py --no-run          # only summarise runs that exist
"""

import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import matplotlib
import numpy as np
import tyro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "ppo": ["ppo_llm.py"],
    "ppo-head": ["ppo_llm.py", "--critic", "head"],
    "ppo-rm": ["ppo_llm.py", "--reward-model", "assets/arith-rm"],
    "ppo-rm-raw": ["ppo_llm.py", "--reward-model", "assets/arith-rm", "--score-norm", "off"],
    # the paper's beta, so the KL is measured; k3 without the ratio, as these runs were made before detail 30
    "grpo": ["grpo_llm.py", "--loss-type", "grpo", "--beta", "0.04", "--no-use-bias-correction-kl"],
    "dr_grpo": ["grpo_llm.py", "--loss-type", "dr_grpo", "--scale-rewards", "none"],
    "dapo": ["grpo_llm.py", "--loss-type", "dapo", "--epsilon-high", "0.28"],
    # issue #18, short runs (CPU budget, on a shared machine under load 8-14): at mu = 1 cispo's gradient is
    # dapo's and sapo's is grpo's (ratio 1), and --delta / --off-policy-mask-threshold change nothing, so the
    # family runs at mu = 2, beside dapo at mu = 2: 120 updates, or 60 for the last three
    "dapo-mu2": ["grpo_llm.py", "--loss-type", "dapo", "--epsilon-high", "0.28", "--num-iterations", "2"],
    "cispo-mu2": ["grpo_llm.py", "--loss-type", "cispo", "--epsilon-high", "4.0", "--num-iterations", "2"],
    "sapo-mu2": ["grpo_llm.py", "--loss-type", "sapo", "--num-iterations", "2"],
    "dapo-top-ent-mu2": ["grpo_llm.py", "--loss-type", "dapo", "--epsilon-high", "0.28", "--num-iterations", "2"]
    + ["--top-entropy-quantile", "0.2"],
    "dapo-ent-coef-mu2": ["grpo_llm.py", "--loss-type", "dapo", "--epsilon-high", "0.28", "--num-iterations", "2"]
    + ["--ent-coef", "0.01"],
}
for name in ["dapo-mu2", "cispo-mu2", "sapo-mu2", "dapo-top-ent-mu2", "dapo-ent-coef-mu2"]:
    CONFIGS[name] += ["--total-steps", "120" if name in ["dapo-mu2", "cispo-mu2"] else "60"]


@dataclass
class Args:
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    """configurations to run (names of CONFIGS)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of each configuration"""
    jobs: int = 2
    """runs at a time (each uses one torch thread)"""
    run: bool = True
    """run the configurations (--no-run: only summarise existing runs)"""
    runs_dir: str = os.path.join(ROOT, "benchmarks", "runs")
    """where the runs go"""
    out_dir: str = os.path.join(ROOT, "benchmarks", "results")
    """where the table and plots go"""
    at_update: int = 0
    """also tabulate the held-out accuracy at this update, to compare runs of different lengths (0: off)"""


def load(runs_dir, name):
    """Metrics of every seed of one configuration: a list of lists of dicts."""
    runs = []
    for path in sorted(glob.glob(os.path.join(runs_dir, name, "*", "metrics.jsonl"))):
        with open(path) as f:
            runs.append([json.loads(line) for line in f])
    return runs


def series(run, key, x="update"):
    points = [(m[x] if x != "time/elapsed" else m.get(x, 0.0), m[key]) for m in run if key in m]
    return np.array([p[0] for p in points]), np.array([p[1] for p in points])


def kl_key(run):
    """ppo_llm.py logs objective/kl (summed over a response); grpo_llm.py logs kl (mean per token), only when
    beta > 0 (with beta 0 it loads no reference model)."""
    return "objective/kl" if any("objective/kl" in m for m in run) else "kl"


def first_reaching(run, x, threshold=0.9):
    xs, acc = series(run, "eval/accuracy", x)
    hits = np.nonzero(acc >= threshold)[0]
    return xs[hits[0]] if len(hits) else np.nan


def main():
    args = tyro.cli(Args)
    if args.run:
        jobs = [(name, seed) for name in args.configs for seed in args.seeds]
        running = []
        while jobs or running:
            while jobs and len(running) < args.jobs:
                name, seed = jobs.pop(0)
                out = os.path.join(args.runs_dir, name)
                cmd = [sys.executable, *CONFIGS[name], "--seed", str(seed), "--output-dir", out, "--sample-every", "0"]
                os.makedirs(out, exist_ok=True)
                log = open(os.path.join(args.runs_dir, f"{name}_{seed}.log"), "w")
                print("running:", " ".join(cmd[1:]), flush=True)
                running.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
            running[0][0].wait()
            running.pop(0)[1].close()

    os.makedirs(args.out_dir, exist_ok=True)
    data = {name: load(args.runs_dir, name) for name in args.configs}
    data = {name: runs for name, runs in data.items() if runs}

    # Table: accuracy at start and end, time and samples to 90%, final KL (mean +- std over seeds).
    def stat(values, fmt, missing="not reached"):
        values = np.array(values, dtype=float)
        ok = values[~np.isnan(values)]
        if not len(ok):
            return missing
        text = f"{np.mean(ok):{fmt}} ± {np.std(ok):{fmt}}"
        return text + (f" ({len(ok)}/{len(values)} seeds)" if len(ok) < len(values) else "")

    at = f" at update {args.at_update} |" if args.at_update else ""
    rows = [f"| configuration | seeds | held-out accuracy, start |{at} end | seconds to 90% | samples to 90% | "
            "final KL* |", "|---|---|---|---|---|---|---|" + ("---|" if at else "")]  # fmt: skip
    for name, runs in data.items():
        start = [series(r, "eval/accuracy")[1][0] for r in runs]
        end = [series(r, "eval/accuracy")[1][-1] for r in runs]
        kl = [series(r, kl_key(r))[1][-5:].mean() if any(kl_key(r) in m for m in r) else np.nan for r in runs]
        acc_at = [dict(zip(*series(r, "eval/accuracy"))).get(args.at_update, np.nan) for r in runs]
        rows.append(
            f"| {name} (`{' '.join(CONFIGS[name])}`) | {len(runs)} | {stat(start, '.3f')} |"
            + (f" {stat(acc_at, '.3f')} |" if at else "")
            + f" {stat(end, '.3f')} | "
            f"{stat([first_reaching(r, 'time/elapsed') for r in runs], '.0f')} | "
            f"{stat([first_reaching(r, 'episode') for r in runs], '.0f')} | {stat(kl, '.3f', 'none (beta 0)')} |"
        )
    rows.append(
        "\n*ppo_llm.py: `objective/kl`, nats per response (k1 summed over its tokens); grpo_llm.py: `kl`, "
        "nats per token (k3, mean); both the mean of the last 5 updates. Accuracy: `eval/accuracy`, 256 "
        "held-out problems sampled at temperature 1; seconds: `time/elapsed` at the first evaluation >= 0.9."
    )
    table = "\n".join(rows)
    print(table)
    with open(os.path.join(args.out_dir, "llm_learning.md"), "w") as f:
        f.write(table + "\n")

    # Curves: mean and min-max band over seeds, against updates, samples and wall time.
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for name, runs in data.items():
        for col, x in enumerate(["update", "episode", "time/elapsed"]):
            for row, key in enumerate(["eval/accuracy", "kl"]):
                curves = [series(r, kl_key(r) if key == "kl" else key, x) for r in runs]
                n = min(len(c[0]) for c in curves)
                if n == 0:
                    continue  # grpo with beta 0 loads no reference and logs no KL
                xs = np.mean([c[0][:n] for c in curves], axis=0)
                ys = np.array([c[1][:n] for c in curves])
                (line,) = axes[row, col].plot(xs, ys.mean(0), label=name)
                axes[row, col].fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
                axes[row, col].set_xlabel({"update": "updates", "episode": "samples", "time/elapsed": "seconds"}[x])
                axes[row, col].set_ylabel(
                    {
                        "eval/accuracy": "held-out accuracy",
                        "kl": "KL to reference (ppo: per response, grpo: per token)",
                    }[key]
                )
    axes[0, 0].axhline(0.9, color="gray", ls=":")
    axes[0, 0].legend()
    fig.suptitle("Embedded arithmetic task, CPU: mean and min-max over seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "llm_accuracy.png"), dpi=80)

    # Reward hacking: the reward model's score of the rollouts against their true accuracy, mean over seeds.
    rm_runs = [name for name in ["ppo-rm", "ppo-rm-raw"] if name in data]
    if rm_runs:
        fig, axes = plt.subplots(1, len(rm_runs), figsize=(7 * len(rm_runs), 4.5), squeeze=False)
        for ax, name in zip(axes[0], rm_runs):
            acc_ax = ax.twinx()
            for key, axis, color in [("objective/scores", ax, "C0"), ("objective/accuracy", acc_ax, "C3")]:
                curves = [series(r, key)[1] for r in data[name]]
                n = min(len(c) for c in curves)
                ys = np.array([np.convolve(c[:n], np.ones(10) / 10, mode="valid") for c in curves])  # 10-update mean
                xs = np.arange(len(ys[0])) + 10
                axis.plot(xs, ys.mean(0), color=color)
                axis.fill_between(xs, ys.min(0), ys.max(0), color=color, alpha=0.2)
            ax.set_ylabel("reward-model score (raw)", color="C0")
            acc_ax.set_ylabel("true accuracy of the same rollouts", color="C3")
            ax.set_xlabel("updates")
            ax.set_title(f"{name}: `{' '.join(CONFIGS[name][1:])}`", fontsize=9)
        fig.suptitle(
            "PPO against the learned reward model: its score (blue) vs the truth (red), mean and min-max of 3 seeds"
        )
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "llm_reward_hacking.png"), dpi=80)


if __name__ == "__main__":
    main()
