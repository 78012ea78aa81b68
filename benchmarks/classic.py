"""Classic-control benchmark: PPO and REINFORCE learning curves on CartPole-v1, Acrobot-v1, Pendulum-v1; PPO's speed.

Usage (from the repository root; the curves take about 20 CPU-minutes, run 2 at a time under `nice`):
    python benchmarks/classic.py --skip-speed                     # curves only (5 seeds x 3 envs x 2 scripts)
    python benchmarks/classic.py --cleanrl ../shared/anchors/cleanrl/ppo.py   # also time it against CleanRL's ppo.py
    python benchmarks/classic.py --skip-speed --merge --envs CartPole-v1 --algos ppo_classic --steps 500000
                                       # one more configuration; the other rows of the results files stay
    python benchmarks/classic.py --profile 20                     # only: where ppo_classic.py's iteration spends

1. Learning curves: ppo_classic.py and reinforce.py, each with its defaults and only --env-id, --seed and
   --total-timesteps given (STEPS per env, or --steps), one run per seed (at most --jobs at once, under `nice`).
   Episodes are read from metrics.jsonl. A configuration is (script, env, total timesteps); with --merge the
   rows of the existing classic.csv and classic_curves.csv are kept for the configurations with no run now.
2. Speed (with --cleanrl): ppo_classic.py and CleanRL's ppo.py, each with its defaults on CartPole-v1 and one torch
   thread, timed as whole processes in pairs, --speed-pairs of them (the order alternating): a run of --speed-steps
   (40,960: 80 iterations of 512 steps) and a run of one iteration (512 steps), whose time is the start-up (imports,
   the environments, the first iteration). Steps/s less the start-up: the 79 iterations between the two, 40,448
   steps, over the difference of their times. Also the last charts/SPS each long run printed. The ratios are ours to
   CleanRL's, pair by pair, and of the medians.
Writes benchmarks/results/classic.csv (per-seed figures), classic_curves.csv (the plotted curves), classic.md (the
learning table), classic_return.png (mean and min-max over seeds), and with the speed runs classic_speed.csv and
classic_speed.md; each table also goes into the docs pages that quote it (benchmarks/docs_tables.py). --skip-speed
quotes the last classic_speed.md as it is. To rewrite the tables and the figure from the results files alone:
    python benchmarks/classic.py --only-existing --merge --skip-speed
With no run of the configurations in runs/ and no rows in classic.csv to keep, it says so and writes nothing.
3. Profile (--profile ITERATIONS, nothing else runs): CPU time per iteration of each part of ppo_classic.py's loop,
   written to classic_profile.md (profile() says how).
The variance of REINFORCE's gradient estimates is measured by benchmarks/psi_variance.py.
"""

import argparse
import csv
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from docs_tables import write_table  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
# name -> (script, label): both with their defaults
ALGOS = {
    "ppo_classic": ("ppo_classic.py", "PPO (ppo_classic.py)"),
    "reinforce": ("reinforce.py", "REINFORCE, Psi = G_t - V(s_t) (reinforce.py)"),
}
# env -> (total timesteps, the return that counts as solved, y range of the plot)
ENVS = {
    "CartPole-v1": (100_000, 475.0, (0, 520)),
    "Acrobot-v1": (100_000, -100.0, (-520, 0)),
    "Pendulum-v1": (200_000, -250.0, (-1700, 0)),
}
# Runs a script with a given torch thread count: the scripts set 1 thread themselves, so the call is disabled.
THREADS = (
    "import runpy, sys, torch; torch.set_num_threads(int(sys.argv.pop(1))); "
    "torch.set_num_threads = lambda n: None; sys.argv[0] = sys.argv[1]; sys.argv.pop(1); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def command(name, env_id, steps):
    return [ALGOS[name][0], f"--env-id={env_id}", f"--total-timesteps={steps}"]


def exp_name(name, env_id, steps):
    """bench-<script>, and -<steps> when steps is not the env's default budget."""
    return f"bench-{name}" + ("" if steps == ENVS[env_id][0] else f"-{steps}")


def train(name, env_id, steps, seed):
    """Runs one training run and returns its run directory."""
    cmd = ["nice", "-n", "10", sys.executable, *command(name, env_id, steps), f"--seed={seed}"]
    cmd.append(f"--exp-name={exp_name(name, env_id, steps)}")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    run_dir = re.search(r"^run directory: (\S+)$", out.stdout, re.M).group(1)
    print(f"{name} {env_id} {steps} seed {seed}: {out.stdout.strip().splitlines()[-1]}", flush=True)
    return os.path.join(REPO, run_dir)


def latest_run(name, env_id, steps, seed):
    pattern = f"{exp_name(name, env_id, steps)}__{env_id}__{seed}__*"
    runs = sorted(glob.glob(os.path.join(REPO, "runs", pattern)))
    return runs[-1] if runs else None


def old_results(configs):
    """The per-seed rows and curves of classic.csv and classic_curves.csv of the configurations not in `configs`.

    Files written before the total_timesteps column existed hold the env's default budget.
    """
    per_seed, curves = [], {}
    path = os.path.join(RESULTS, "classic.csv")
    if not os.path.exists(path):
        return per_seed, curves
    for r in csv.DictReader(open(path)):
        r["total_timesteps"] = int(r.get("total_timesteps") or ENVS[r["env_id"]][0])
        if (r["algorithm"], r["env_id"], r["total_timesteps"]) in configs:
            continue
        r["seed"], r["episodes"] = int(r["seed"]), int(r["episodes"])
        r["last100_mean_return"] = float(r["last100_mean_return"])
        first = r["first_step_last100_ge_threshold"]
        r["first_step_last100_ge_threshold"] = int(first) if first else ""
        per_seed.append(r)
    points = {}
    for r in csv.DictReader(open(os.path.join(RESULTS, "classic_curves.csv"))):
        key = (r["algorithm"], r["env_id"], int(r.get("total_timesteps") or ENVS[r["env_id"]][0]), int(r["seed"]))
        if key[:3] not in configs:
            points.setdefault(key, []).append(float(r["last100_mean_return"]))  # in grid order
    curves = {key: np.array(v) for key, v in points.items()}
    return per_seed, curves


def episodes(run_dir):
    """(global_step, episodic_return) of every episode of a run, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    rows = [(r["global_step"], r["charts/episodic_return"]) for r in records if "charts/episodic_return" in r]
    return np.array(rows, dtype=np.float64)  # (num_episodes, 2)


def trailing_mean(returns, window=100):
    """Mean of the last `window` episodes at each episode (fewer at the start)."""
    csum = np.concatenate([[0.0], np.cumsum(returns)])
    idx = np.arange(1, len(returns) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def timed(script, steps):
    """One whole run of `script` (its defaults, CartPole-v1, `steps` total timesteps, one torch thread), in a
    directory of its own: (wall seconds from start to exit, the last charts/SPS it printed)."""
    cmd = [sys.executable, "-u", "-c", THREADS, "1", script, f"--total-timesteps={steps}"]
    with tempfile.TemporaryDirectory() as cwd:  # where the script writes its run directory
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        seconds = time.perf_counter() - start
    sps = [int(v) for v in re.findall(r"SPS[=:] ?(\d+)", out.stdout.decode())]
    return seconds, sps[-1]


def machine():
    """The CPU and its load, for the tables' captions."""
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", cpu).group(1).strip()
    return f"{os.cpu_count()} CPU cores ({model}), shared; load average {os.getloadavg()[0]:.1f} at the end"


def profile(iterations):
    """CPU time per iteration of each part of ppo_classic.py's loop (CartPole-v1, defaults, 1 thread), in-process.

    Each part is the function that does it, wrapped to add up its time.process_time(): the vector env's step (with
    its wrappers), the policy's forward pass in the rollout (no action given) and in the update, backward, the
    gradient clip, Adam's step, GAE, and the conversions between numpy and torch (torch.as_tensor, torch.from_numpy,
    Tensor.cpu, Tensor.numpy). "rest of main()" is main()'s CPU time from the first env step on, less the parts:
    its own Python, the storage writes, the minibatch indexing and the losses. Returns [(part, ms per iteration)].
    """
    import gymnasium as gym
    import torch

    sys.path.insert(0, REPO)
    import ppo_classic

    spent, starts, depth = {}, [], [0]  # a part called inside another is counted in the outer one only

    def timed(owner, attr, part_of):
        fn = getattr(owner, attr)

        def wrapper(*a, **k):
            if depth[0]:
                return fn(*a, **k)
            depth[0], start = 1, time.process_time()
            try:
                return fn(*a, **k)
            finally:
                depth[0], part = 0, part_of(a, k)
                if starts or part == "env step":  # the loop starts at the first env step: set-up is left out
                    spent[part] = spent.get(part, 0.0) + time.process_time() - start
                    starts.append(start)

        setattr(owner, attr, wrapper)

    def forward(a, k):
        given = len(a) > 2 or k.get("action") is not None
        return "policy forward, update" if given else "policy forward, rollout"

    timed(gym.wrappers.vector.RecordEpisodeStatistics, "step", lambda a, k: "env step")
    timed(ppo_classic.Agent, "get_action_and_value", forward)
    timed(ppo_classic.Agent, "get_value", lambda a, k: "value of the last / final obs")
    timed(ppo_classic, "compute_gae", lambda a, k: "GAE")
    timed(torch.Tensor, "backward", lambda a, k: "backward")
    timed(torch.nn.utils, "clip_grad_norm_", lambda a, k: "gradient clip")
    timed(torch.optim.Adam, "step", lambda a, k: "Adam step")
    for owner, attr in [(torch, "as_tensor"), (torch, "from_numpy"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy")]:
        timed(owner, attr, lambda a, k: "numpy <-> torch")
    timed(ppo_classic, "log", lambda a, k: "logging")
    cwd = os.getcwd()
    os.chdir(tempfile.mkdtemp())  # the run directory goes there
    sys.argv = ["ppo_classic.py", f"--total-timesteps={512 * iterations}"]
    ppo_classic.main()
    os.chdir(cwd)
    loop = time.process_time() - starts[0]
    rows = [(part, 1000 * t / iterations) for part, t in sorted(spent.items(), key=lambda kv: -kv[1])]
    return [*rows, ("rest of main()", 1000 * (loop - sum(spent.values())) / iterations)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    p.add_argument("--steps", type=int, default=None, help="total timesteps of every run (default: each env's)")
    p.add_argument("--merge", action="store_true", help="keep the results files' rows of the other configurations")
    p.add_argument("--jobs", type=int, default=2, help="training runs at once")
    p.add_argument("--reuse", action="store_true", help="reuse the latest runs/bench-* run of each seed")
    p.add_argument("--only-existing", action="store_true", help="train nothing: tabulate the runs that exist")
    p.add_argument("--cleanrl", default=None, help="path of a local copy of CleanRL's ppo.py to time too")
    p.add_argument("--speed-pairs", type=int, default=5, help="pairs of runs, each of both scripts")
    p.add_argument("--speed-steps", type=int, default=40960, help="total timesteps of each long run")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="ITERATIONS", help="only profile ppo_classic.py")
    args = p.parse_args()
    if args.profile:
        rows = profile(args.profile)
        total = sum(ms for _, ms in rows)
        lines = [
            f"CartPole-v1, defaults, 1 torch thread, {args.profile} iterations of 4 envs x 128 steps, in one process "
            f"(`python benchmarks/classic.py --profile {args.profile}`). Machine: {machine()}; "
            f"{time.strftime('%Y-%m-%d')}. CPU time per iteration: {total:.1f} ms ({int(512 / total * 1000):,} "
            "steps/CPU-s inside the loop).",
            "",
            "| part | ms per iteration | share |",
            "| --- | --- | --- |",
            *[f"| {part} | {ms:.1f} | {ms / total:.0%} |" for part, ms in rows],
        ]
        write_table("classic_profile.md", "\n".join(lines))
        print("\n".join(lines))
        return
    algos = {a: ALGOS[a] for a in args.algos}
    configs = [(name, env_id, args.steps or ENVS[env_id][0]) for env_id in reversed(args.envs) for name in algos]
    os.makedirs(RESULTS, exist_ok=True)

    # 1. learning curves
    jobs = [(*config, seed) for config in configs for seed in args.seeds]  # longest first
    with ThreadPoolExecutor(args.jobs) as pool:
        todo = [job for job in jobs if not ((args.reuse or args.only_existing) and latest_run(*job))]
        futures = {job: pool.submit(train, *job) for job in ([] if args.only_existing else todo)}
    runs = {job: futures[job].result() if job in futures else latest_run(*job) for job in jobs}
    runs = {job: run_dir for job, run_dir in runs.items() if run_dir is not None}

    per_seed, curves = old_results({job[:3] for job in runs}) if args.merge else ([], {})
    if not runs and not per_seed:  # an empty table would replace the docs': say so and write nothing
        if args.merge:
            raise SystemExit(
                "error: no runs/bench-* run of these configurations, and no benchmarks/results/classic.csv"
            )
        raise SystemExit(
            "error: no runs/bench-* run of these configurations: --merge rewrites the tables from classic.csv"
        )
    for (name, env_id, steps, seed), run_dir in runs.items():
        ep = episodes(run_dir)
        smooth = trailing_mean(ep[:, 1])
        solved = np.nonzero(smooth >= ENVS[env_id][1])[0]
        per_seed.append(
            {
                "algorithm": name,
                "env_id": env_id,
                "total_timesteps": steps,
                "seed": seed,
                "episodes": len(ep),
                "last100_mean_return": round(float(smooth[-1]), 2),
                "first_step_last100_ge_threshold": int(ep[solved[0], 0]) if len(solved) else "",
                "run_dir": os.path.relpath(run_dir, REPO),
            }
        )
        # the trailing-100 mean as of each grid step (nan before the first episode)
        grid = np.linspace(0, steps, 101)[1:]  # (100,) global steps
        idx = np.searchsorted(ep[:, 0], grid, side="right") - 1
        curves[(name, env_id, steps, seed)] = np.where(idx >= 0, smooth[np.maximum(idx, 0)], np.nan)
    # rows and panels in ENVS' order, then by steps, script, seed
    order = {e: i for i, e in enumerate(ENVS)}
    per_seed.sort(key=lambda r: (order[r["env_id"]], r["total_timesteps"], r["algorithm"], r["seed"]))
    curves = dict(sorted(curves.items(), key=lambda kv: (order[kv[0][1]], kv[0][2], kv[0][0], kv[0][3])))
    panels = sorted({(e, s) for (_, e, s, _) in curves}, key=lambda es: (order[es[0]], es[1]))
    seeds = sorted({r["seed"] for r in per_seed})

    with open(os.path.join(RESULTS, "classic.csv"), "w", newline="") as f:
        fields = ["algorithm", "env_id", "total_timesteps", "seed", "episodes", "last100_mean_return"]
        w = csv.DictWriter(f, fieldnames=[*fields, "first_step_last100_ge_threshold", "run_dir"])
        w.writeheader()
        w.writerows(per_seed)
    with open(os.path.join(RESULTS, "classic_curves.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["algorithm", "env_id", "total_timesteps", "seed", "global_step", "last100_mean_return"])
        for (name, env_id, steps, seed), curve in curves.items():
            grid = np.linspace(0, steps, 101)[1:]
            w.writerows([name, env_id, steps, seed, int(g), round(float(v), 2)] for g, v in zip(grid, curve))

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (env_id, steps) in zip(axes[0], panels):
        _, threshold, ylim = ENVS[env_id]
        grid = np.linspace(0, steps, 101)[1:]
        num_seeds = set()
        for name, color in zip(ALGOS, ["C0", "C1"]):
            stack = np.array([c for (n, e, s, _), c in curves.items() if (n, e, s) == (name, env_id, steps)])
            if not len(stack):  # stack: (seeds, 100)
                continue
            num_seeds.add(len(stack))
            with warnings.catch_warnings():  # all-nan grid points before the first episode ends
                warnings.simplefilter("ignore", RuntimeWarning)
                ax.plot(grid, np.nanmean(stack, 0), color=color, label=ALGOS[name][1])
                ax.fill_between(grid, np.nanmin(stack, 0), np.nanmax(stack, 0), color=color, alpha=0.2)
        ax.axhline(threshold, color="grey", lw=0.8, ls="--")
        seeds_text = "/".join(map(str, sorted(num_seeds)))
        ax.set(xlabel="environment steps", ylim=ylim, title=f"{env_id}, {steps:,} steps, {seeds_text} seeds")
        ax.legend(loc="lower right", fontsize=8)
    axes[0, 0].set_ylabel("mean return of the last 100 episodes")
    fig.suptitle("mean (line) and min-max (band) over seeds; dashed: threshold", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "classic_return.png"), dpi=100)

    lines = [
        f"Seeds {' '.join(map(str, seeds))}, each script with its defaults. Mean return of the last 100 training "
        "episodes (sampled actions) at the end of the run, per seed and over seeds; steps = first step at which that "
        "mean reached the threshold (median over the seeds that did).",
        "",
        "| command | per seed (seed) | mean ± std over seeds | worst seed | seeds ≥ threshold | steps to threshold |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for env_id, steps in panels:
        threshold = ENVS[env_id][1]
        for name in ALGOS:
            rows = [r for r in per_seed if (r["algorithm"], r["env_id"], r["total_timesteps"]) == (name, env_id, steps)]
            if not rows:
                continue
            last = np.array([r["last100_mean_return"] for r in rows])
            reached = [r["first_step_last100_ge_threshold"] for r in rows if r["first_step_last100_ge_threshold"] != ""]
            median_steps = f"{int(np.median(reached)):,}" if reached else "-"
            per_seed_text = ", ".join("{:.1f} (s{})".format(v, r["seed"]) for v, r in zip(last, rows))
            lines.append(
                f"| `python {' '.join(command(name, env_id, steps))}` "
                f"| {per_seed_text} "
                f"| {last.mean():.1f} ± {last.std():.1f} | {last.min():.1f} "
                f"| {int((last >= threshold).sum())}/{len(last)} (≥ {threshold:g}) | {median_steps} |"
            )

    write_table("classic.md", "\n".join(lines))
    print("\n".join(lines))

    # 2. speed: configurations interleaved so each sees the same load; --skip-speed quotes the last table as it is
    speed_path = os.path.join(RESULTS, "classic_speed.md")
    if args.skip_speed:
        if os.path.exists(speed_path):
            write_table("classic_speed.md", open(speed_path).read())
        return
    if not args.cleanrl:
        raise SystemExit("error: the speed runs time ppo_classic.py against CleanRL's ppo.py: give --cleanrl PATH")
    scripts = {"ppo_classic.py": os.path.join(REPO, "ppo_classic.py"), "CleanRL ppo.py": os.path.abspath(args.cleanrl)}
    rows = []
    for pair in range(args.speed_pairs):
        order = list(scripts) if pair % 2 == 0 else list(scripts)[::-1]  # each goes first in every other pair
        for steps in (args.speed_steps, 512):  # a long run, then one iteration: the start-up
            for name in order:
                load = os.getloadavg()[0]  # before the run: on shared cores it says how far its seconds hold
                seconds, sps = timed(scripts[name], steps)
                rows.append(dict(script=name, pair=pair, steps=steps, seconds=round(seconds, 3), sps=sps, load=load))
                print(f"speed pair {pair}: {name}, {steps} steps: {seconds:.2f} s, SPS {sps}", flush=True)
    with open(os.path.join(RESULTS, "classic_speed.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["script", "pair", "steps", "seconds", "sps", "load"])
        w.writeheader()
        w.writerows(rows)
    write_table("classic_speed.md", speed_table(rows, args.speed_steps, args.speed_pairs))


def speed_table(rows, steps, pairs):
    """classic_speed.md from the speed rows: each script's medians, then ours against CleanRL's, pair by pair."""
    iterations = steps // 512 - 1  # between a long run and a one-iteration run

    def of(name, n, key="seconds"):  # (pairs,): the figure of each pair's run
        return np.array(
            [r[key] for r in sorted(rows, key=lambda r: r["pair"]) if (r["script"], r["steps"]) == (name, n)]
        )

    lines = [
        f"CartPole-v1, each script's defaults, one torch thread, {pairs} pairs of whole runs (`python "
        "benchmarks/classic.py --only-existing --merge --cleanrl PATH/TO/cleanrl/ppo.py`, CleanRL's file unchanged at "
        "commit fe8d8a0), "
        f"the order alternating. Machine: {machine()}; {time.strftime('%Y-%m-%d')}. Start-up: a run of one iteration "
        f"(512 steps); steps/s less the start-up: the {iterations * 512:,} steps between the two runs over the "
        "difference of their times. SPS: the last charts/SPS the long run printed. Medians, and each pair's figure. "
        f"The 1-minute load average before each run: {min(r['load'] for r in rows):.1f} to "
        f"{max(r['load'] for r in rows):.1f}.",
        "",
        f"| script | whole run, {steps:,} steps (s) | start-up (s) | steps/s less the start-up | printed SPS |",
        "| --- | --- | --- | --- | --- |",
    ]
    rates = {}
    for name in ["ppo_classic.py", "CleanRL ppo.py"]:
        whole, start, sps = of(name, steps), of(name, 512), of(name, steps, "sps")
        rates[name] = iterations * 512 / (whole - start)
        cells = [f"{np.median(x):.2f} ({', '.join(f'{v:.2f}' for v in x)})" for x in (whole, start)]
        cells.append(f"{np.median(rates[name]):,.0f} ({', '.join(f'{v:,.0f}' for v in rates[name])})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {np.median(sps):,.0f} ({', '.join(map(str, sps))}) |")
    ours, theirs = "ppo_classic.py", "CleanRL ppo.py"
    for what, a, b in [
        ("steps/s less the start-up", rates[ours], rates[theirs]),
        ("printed SPS", of(ours, steps, "sps"), of(theirs, steps, "sps")),
        ("whole run (CleanRL's time / ours)", of(theirs, steps), of(ours, steps)),
    ]:
        pair = ", ".join(f"{x:.2f}" for x in a / b)
        lines.append(f"\nppo_classic.py against CleanRL, {what}: {np.median(a / b):.2f}x (the pairs: {pair})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
