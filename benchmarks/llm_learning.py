"""Learning curves of ppo_llm.py and grpo_llm.py on the embedded tasks, over seeds (CPU).

Each configuration runs once per seed as its own process (one torch thread), --jobs at a time, into benchmarks/runs/
(ignored by git). The metrics the tables and figures read are then copied from each run's metrics.jsonl into
benchmarks/results/llm_curves/<configuration>.csv (one row per logged update, a column per metric, the seed first),
which git keeps; every table and figure is written from those files alone, each group's from the curves of all its
configurations:

The arithmetic task (`--configs arithmetic`, the default), the scripts' defaults:
- benchmarks/results/llm_learning.md: held-out accuracy at the start and the end, time and samples to
  reach 90%, final KL, per configuration (mean and spread over seeds);
- benchmarks/results/llm_accuracy.png: held-out accuracy and KL against updates, samples and wall time;
- benchmarks/results/llm_reward_hacking.png: with the learned reward model, its score against the true
  accuracy of the same rollouts: where the two part, the policy is exploiting the reward model.

Running sums with a trace (assets/sums-sft on assets/sums/*.jsonl, assets/README.md), through the path a user takes
with their own data: local GSM8K-style files and the gsm8k reward function:
- `--configs trace`: benchmarks/results/trace_learning.md and trace_learning.png, PPO and GRPO with their defaults,
  held-out accuracy at the start, after 15 minutes (time/elapsed) and at the end, and against minutes and updates;
- `--configs trace-family`: the GRPO family (grpo, dr_grpo, dapo, gspo, cispo) at --num-iterations 4, so that the
  importance ratios move away from 1, for the same number of updates: benchmarks/results/trace_family.md and
  trace_family.png, held-out accuracy, the mean length of right and of wrong completions, entropy and clip fraction
  against updates.

The calculator task (assets/calc-sft on assets/calc/*.jsonl, assets/README.md), `--configs calc`: PPO and GRPO with
`--tools calculator`, and each with a control whose every tool call fails: benchmarks/results/calc_learning.md and
calc_learning.png, held-out accuracy and tool calls per response at the start, after 15 minutes and at the end.

vLLM against generate() (docs/scaling.md#vllm), `--configs vllm`: grpo_llm.py with its defaults and ppo_llm.py with
its defaults stopped at 100 updates, each with and without `--vllm`, from an SFT policy whose head size vLLM's CPU
attention serves: assets/make_arith_models.py's policy with 2 heads (head size 80; the embedded one's 4 heads give 40,
which it does not serve), built into benchmarks/runs/arith-2heads/ when it is missing. BOTH legs run in the vLLM venv's
python, .venv-vllm/bin/python (the README's third command builds it), so that only `--vllm` differs:
benchmarks/results/vllm_learning.md and vllm_learning.png, held-out accuracy at the same evaluations, the mean and each
seed of each leg, and a verdict.

    python benchmarks/llm_learning.py --configs vllm --seeds 1 2 --jobs 1

On-policy distillation (assets/README.md: assets/arith-teacher and the smaller assets/arith-student), `--configs
distill`: every run from the student, pure distillation (`--teacher` alone: the teacher is the only training signal,
the arithmetic reward only measures) in grpo_llm.py, in ppo_llm.py and in ppo_llm.py at `--gamma 0`, and RL with the
arithmetic reward in each script, the same 25,600 samples each: benchmarks/results/distill_learning.md, held-out
accuracy at the start and the end, the teacher's (`distill/teacher_accuracy`), the updates, samples and minutes to 90%
of it, the final `distill/reverse_kl`, RL's samples to 90% over distillation's against Thinking Machines' 7-10x, and a
verdict computed from them; distill_learning.png, held-out accuracy against updates, samples and minutes with the
teacher's as a line, and the reverse KL against samples.

    python benchmarks/llm_learning.py --configs distill

The guessing game (assets/guess.py's GuessingGame, assets/README.md), a stateful environment, `--configs guess`: PPO
with the game's per-turn rewards (guess-ppo), PPO with the same rewards summed at the end through the wrapper
benchmarks/guess_summed.py, whose turn_rewards stays empty (guess-ppo-summed), GRPO (guess-grpo, the episode's total),
and PPO in a control whose every answer is "no" (benchmarks/guess_control.py, guess-ppo-control), the same 3,840 games
each: benchmarks/results/guess_learning.md, held-out success and guesses per game at the start and the end against
bisection's 4.16, the updates, samples and minutes to success >= 0.9, the samples to <= 5 guesses, each seed, and a
verdict on the per-turn credit computed from them; guess_learning.png, success and guesses against samples and
minutes.

    python benchmarks/llm_learning.py --configs guess-ppo guess-ppo-summed guess-grpo
    python benchmarks/llm_learning.py --configs guess-ppo-control --seeds 1
    python benchmarks/llm_learning.py --no-run --configs guess

On a GPU (benchmarks/gpu.py runs it), `--configs gpu`: the README's first command, `ppo_llm.py`, for 100 updates:
benchmarks/results/llm_learning_cuda.md, the arithmetic table's columns.

    python benchmarks/llm_learning.py                                # the arithmetic task: run, then summarise
    python benchmarks/llm_learning.py --configs trace trace-family   # the trace task
    python benchmarks/llm_learning.py --no-run --configs trace       # measure nothing: tables and figures from
                                                                     # the curves in benchmarks/results/llm_curves/
    python benchmarks/llm_learning.py --reuse --configs trace-ppo    # run only the seeds without a finished run

--no-run without the curves of a group's configurations says so and writes nothing.
"""

import csv
import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import matplotlib
import numpy as np
import tyro

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from docs_tables import write_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "ppo": ["ppo_llm.py"],
    "ppo-head": ["ppo_llm.py", "--critic", "head"],
    "ppo-rm": ["ppo_llm.py", "--reward-model", "assets/arith-rm", "--reward-fn", "arithmetic"],
    "ppo-rm-raw": [
        "ppo_llm.py",
        "--reward-model",
        "assets/arith-rm",
        "--reward-fn",
        "arithmetic",
        "--score-norm",
        "off",
    ],
    "grpo": ["grpo_llm.py", "--loss-type", "grpo", "--beta", "0.04"],  # the paper's beta, so that the KL is measured
    "dr_grpo": ["grpo_llm.py", "--loss-type", "dr_grpo", "--scale-rewards", "none"],
    "dapo": ["grpo_llm.py", "--loss-type", "dapo", "--epsilon-high", "0.28"],
}
ARITHMETIC = list(CONFIGS)

# The trace task through the general path: the GSM8K command with local paths (--max-new-tokens: the checkpoint's
# generation_config, 64; the longest right trace and its EOS are 55 tokens). PPO stops at 150 of its 300 updates, past
# the 15 minutes the table reads (the learning rate is constant: the budget changes nothing before it).
TRACE = ["--model", "assets/sums-sft", "--dataset", "assets/sums/train.jsonl", "--prompt-column", "question"]
TRACE += ["--reward-fn", "gsm8k", "--eval-split", "assets/sums/test.jsonl"]
CONFIGS["trace-ppo"] = ["ppo_llm.py", *TRACE, "--total-steps", "150"]
CONFIGS["trace-grpo"] = ["grpo_llm.py", *TRACE]
# The GRPO family at mu = 4 (at mu = 1 cispo's gradient is dapo's and gspo's ratio is 1) and the same number of
# updates: grpo with the script's defaults; gspo with the range TRL documents from the GSPO paper (v2, section 5.1);
# cispo's cap at TRL's recommended 5 (our 1 + 4); dapo's overlong penalty above 64 - 8 = 56 tokens, longer than any
# right trace.
FAMILY = {
    "grpo": [],
    "dr_grpo": ["--loss-type", "dr_grpo", "--scale-rewards", "none"],
    "dapo": ["--loss-type", "dapo", "--epsilon-high", "0.28", "--overlong-buffer", "8"],
    "gspo": ["--importance-sampling-level", "sequence", "--epsilon", "3e-4", "--epsilon-high", "4e-4"],
    "cispo": ["--loss-type", "cispo", "--epsilon-high", "4.0"],
}
FAMILY_UPDATES = 200
VARIANT = {f"trace-{variant}-mu4": variant for variant in FAMILY}  # configuration name -> variant
for name, variant in VARIANT.items():
    CONFIGS[name] = ["grpo_llm.py", *TRACE, "--num-iterations", "4", "--total-steps", str(FAMILY_UPDATES)]
    CONFIGS[name] += FAMILY[variant]
# The README's first command on a GPU (benchmarks/gpu.py), stopped at 100 of its 300 updates: the learning rate is
# constant, so they are the default run's first 100, past the ~70 the CPU runs took to reach 90%.
CONFIGS["gpu-ppo"] = ["ppo_llm.py", "--total-steps", "100"]
# The calculator task (assets/calc-sft, assets/README.md) with each script's defaults, and its control: a tool of the
# same name and description whose every call fails, so that what the runs gain comes from the tool's results.
CALC = ["--model", "assets/calc-sft", "--dataset", "assets/calc/train.jsonl"]
CALC_STEPS = {"ppo_llm.py": "50", "grpo_llm.py": "100"}
for script, short in [("ppo_llm.py", "ppo"), ("grpo_llm.py", "grpo")]:
    CONFIGS[f"calc-{short}"] = [script, *CALC, "--tools", "calculator", "--total-steps", CALC_STEPS[script]]
    CONFIGS[f"calc-{short}-control"] = [script, *CALC, "--tools", "benchmarks/calc_control.py:calculator"]
    CONFIGS[f"calc-{short}-control"] += ["--total-steps", CALC_STEPS[script]]
# --vllm against generate(): GRPO's and PPO's defaults from the embedded SFT policy's builder with 2 heads (head size
# 80, which vLLM's CPU attention serves; 4 give 40, which it does not), in the vLLM venv for both legs. No reward model
# is used: --rm-steps 0. PPO is the README's first command stopped at 100 of its 300 updates, as gpu-ppo (the ~70 it
# took to reach 90% are among them).
VLLM_PYTHON = ".venv-vllm/bin/python"
ARITH2 = os.path.join("benchmarks", "runs", "arith-2heads")
ARITH2_BUILD = ["assets/make_arith_models.py", "--n-head", "2", "--rm-steps", "0", "--out-dir", ARITH2, "--overwrite"]
CONFIGS["grpo-2heads"] = ["grpo_llm.py", "--model", os.path.join(ARITH2, "arith-sft")]
CONFIGS["ppo-2heads"] = ["ppo_llm.py", "--model", os.path.join(ARITH2, "arith-sft"), "--total-steps", "100"]
for name in ["grpo-2heads", "ppo-2heads"]:
    CONFIGS[f"{name}-vllm"] = [*CONFIGS[name], "--vllm"]
# On-policy distillation (assets/README.md: the teacher and the student): every run from the same student, the teacher
# the only training signal in the first three, the arithmetic reward in the last two; the same samples in all five,
# 25,600 (PPO's 200 updates of 128 responses, GRPO's 400 of 8 x 8), about 5 minutes of PPO on the shared CPU.
STUDENT, TEACHER = "assets/arith-student", "assets/arith-teacher"
DISTILL_STEPS = {"ppo_llm.py": "200", "grpo_llm.py": "400"}
for script, short in [("grpo_llm.py", "grpo"), ("ppo_llm.py", "ppo")]:
    CONFIGS[f"distill-{short}"] = [script, "--model", STUDENT, "--teacher", TEACHER]
CONFIGS["distill-ppo-gamma0"] = [*CONFIGS["distill-ppo"], "--gamma", "0"]
for script, short in [("grpo_llm.py", "grpo"), ("ppo_llm.py", "ppo")]:
    CONFIGS[f"rl-{short}"] = [script, "--model", STUDENT]
DISTILL = ["distill-grpo", "distill-ppo", "distill-ppo-gamma0", "rl-grpo", "rl-ppo"]
for name in DISTILL:
    CONFIGS[name] += ["--total-steps", DISTILL_STEPS[CONFIGS[name][0]]]
# The guessing game (assets/guess.py, assets/README.md), a stateful environment: PPO with the game's per-turn rewards,
# PPO with the same rewards summed at the end (benchmarks/guess_summed.py: its turn_rewards stays empty), GRPO (which
# uses the episode's total), and a control whose every answer is "no" (benchmarks/guess_control.py). The same samples
# in each: PPO's 30 updates of 128 games, GRPO's 60 of 8 x 8; the whole held-out set (248 games) every 3,840/6 = 640
# samples.
GUESS = ["--model", "assets/guess-sft", "--dataset", "assets/guess/train.jsonl", "--max-tool-calls", "8"]
GUESS += ["--eval-size", "248"]
GUESS_PPO = ["--total-steps", "30", "--eval-every", "5"]
CONFIGS["guess-ppo"] = ["ppo_llm.py", *GUESS, "--environment", "assets/guess.py:GuessingGame", *GUESS_PPO]
CONFIGS["guess-ppo-summed"] = ["ppo_llm.py", *GUESS, "--environment", "benchmarks/guess_summed.py:SummedGuessingGame"]
CONFIGS["guess-ppo-summed"] += GUESS_PPO
CONFIGS["guess-grpo"] = ["grpo_llm.py", *GUESS, "--environment", "assets/guess.py:GuessingGame"]
CONFIGS["guess-grpo"] += ["--total-steps", "60", "--eval-every", "10"]
GUESS_CONTROL = "benchmarks/guess_control.py:ControlGuessingGame"
CONFIGS["guess-ppo-control"] = ["ppo_llm.py", *GUESS, "--environment", GUESS_CONTROL, *GUESS_PPO]
BISECTION_GUESSES, BISECTION_REWARD = 129 / 31, 1 - 0.1 * 129 / 31  # assets/guess.py: the optimum, 4.16 and 0.584
GROUPS = {"arithmetic": ARITHMETIC, "trace": ["trace-ppo", "trace-grpo"], "trace-family": list(VARIANT)}
GROUPS["calc"] = ["calc-ppo", "calc-grpo", "calc-ppo-control", "calc-grpo-control"]
GROUPS["gpu"] = ["gpu-ppo"]
GROUPS["guess"] = ["guess-ppo", "guess-ppo-summed", "guess-grpo", "guess-ppo-control"]
GROUPS["distill"] = DISTILL
GROUPS["vllm"] = ["grpo-2heads", "grpo-2heads-vllm", "ppo-2heads", "ppo-2heads-vllm"]
TRACE_MINUTES = 15
SHARED = "Seconds are wall clock, two runs at a time on 2 CPU cores shared with other work: they depend on its load."


@dataclass
class Args:
    configs: list[str] = field(default_factory=lambda: ["arithmetic"])
    """configurations to run and summarise: of CONFIGS or GROUPS (arithmetic, trace, trace-family, calc, gpu, vllm,
    distill, guess)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of each configuration"""
    jobs: int = 2
    """runs at a time (each uses one torch thread)"""
    run: bool = True
    """run the configurations (--no-run: measure nothing; the tables and figures from the committed curves)"""
    reuse: bool = False
    """do not run a (configuration, seed) that has a finished run in --runs-dir: collect that one"""
    runs_dir: str = os.path.join(ROOT, "benchmarks", "runs")
    """where the runs go"""
    out_dir: str = os.path.join(ROOT, "benchmarks", "results")
    """where the curves (out_dir/llm_curves/), the tables and the figures go"""
    at_update: int = 0
    """also tabulate the held-out accuracy at this update, to compare runs of different lengths (0: off)"""
    total_steps: int = 0
    """run each configuration for this many updates instead (a short check: benchmarks/gpu.py --smoke; 0: off)"""


CURVES = "llm_curves"  # out_dir/llm_curves/<configuration>.csv
# the metrics the tables and figures read; a configuration's file has the columns its runs log
KEYS = """update episode time/elapsed eval/accuracy eval/accuracy_stderr eval/mean_length_right eval/mean_length_wrong
objective/kl kl objective/scores objective/accuracy completions/mean_length entropy clip_ratio/region_mean
cispo_clip_ratio importance_ratio/mean tools/call_frequency eval/tools/call_frequency eval/mean_reward
vllm/logprob_diff_max vllm/logprob_diff_mean distill/reverse_kl distill/teacher_accuracy""".split()


def curves_path(out_dir, name):
    return os.path.join(out_dir, CURVES, f"{name}.csv")


def finished_runs(runs_dir, name):
    """{seed: the run directory} of the configuration's runs that reached their --total-steps, the latest of a seed."""
    runs = {}
    for run_dir in sorted(glob.glob(os.path.join(runs_dir, name, "*__*__*")), key=lambda d: int(d.split("__")[-1])):
        try:
            with open(os.path.join(run_dir, "args.json")) as f:
                run_args = json.load(f)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                last = json.loads(f.readlines()[-1])
        except (OSError, ValueError, IndexError):  # killed before its first update, say
            continue
        if last["update"] == run_args["total_steps"]:
            runs[run_args["seed"]] = run_dir
    return runs


def collect(args, name):
    """Each seed's metrics.jsonl, the KEYS it has, into out_dir/llm_curves/<name>.csv (one row per logged update)."""
    runs = finished_runs(args.runs_dir, name)
    if missing := [seed for seed in args.seeds if seed not in runs]:
        raise SystemExit(
            f"error: {name}: no finished run of seed {' '.join(map(str, missing))} in "
            f"{os.path.join(args.runs_dir, name)} (its log: {name}_<seed>.log there)"
        )
    rows = []
    for seed in args.seeds:
        with open(os.path.join(runs[seed], "metrics.jsonl")) as f:
            rows += [{"seed": seed} | {k: m[k] for k in KEYS if k in m} for m in map(json.loads, f)]
    columns = ["seed"] + [k for k in KEYS if any(k in row for row in rows)]
    os.makedirs(os.path.join(args.out_dir, CURVES), exist_ok=True)
    with open(curves_path(args.out_dir, name), "w", newline="") as f:
        writer = csv.DictWriter(f, columns, lineterminator="\n")
        writer.writeheader()
        for row in rows:  # 8 significant digits: an accuracy k/256 exactly
            writer.writerow({k: v if isinstance(v, int) else f"{v:.8g}" for k, v in row.items()})
    print(f"{name}: seeds {' '.join(map(str, args.seeds))} from {args.runs_dir} into {curves_path(args.out_dir, name)}")


def load(out_dir, name):
    """The curves of every seed of one configuration: a list (one per seed) of lists of {metric: value}."""
    runs = {}
    with open(curves_path(out_dir, name)) as f:
        for row in csv.DictReader(f):
            seed = int(row.pop("seed"))
            point = {k: int(v) if k in ("update", "episode") else float(v) for k, v in row.items() if v != ""}
            runs.setdefault(seed, []).append(point)
    return list(runs.values())


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


def at_time(run, seconds, key="eval/accuracy"):
    """The last value of `key` logged at or before `seconds` of time/elapsed (the first evaluation counts as 0 s)."""
    xs, ys = series(run, key, "time/elapsed")
    before = np.nonzero(xs <= seconds)[0]
    return ys[before[-1]] if len(before) else np.nan


def stat(values, fmt, missing="not reached"):
    """'mean ± std' over seeds of the values that exist, and how many seeds have one when some do not."""
    values = np.array(values, dtype=float)
    ok = values[~np.isnan(values)]
    if not len(ok):
        return missing
    text = f"{np.mean(ok):{fmt}} ± {np.std(ok):{fmt}}"
    return text + (f" ({len(ok)}/{len(values)} seeds)" if len(ok) < len(values) else "")


def smooth(curve, window):
    """A (x, y) curve as its `window`-point moving average, each mean placed at the last x it covers."""
    xs, ys = curve
    if len(ys) < window:
        return xs[:0], ys[:0]
    return xs[window - 1 :], np.convolve(ys, np.ones(window) / window, mode="valid")


def plot_band(ax, curves, label=None, color=None):
    """Mean over seeds of (x, y) curves, cut to the shortest, and the min-max band; False when a seed has none."""
    n = min(len(c[0]) for c in curves)
    if n == 0:
        return False
    xs = np.mean([c[0][:n] for c in curves], axis=0)
    ys = np.array([c[1][:n] for c in curves])
    (line,) = ax.plot(xs, ys.mean(0), label=label, color=color)
    ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
    return True


def expand(names):
    """--configs as names of CONFIGS, groups expanded, in order, each once."""
    out = []
    for name in names:
        if name not in CONFIGS and name not in GROUPS:
            raise SystemExit(f"error: --configs {name}: not one of {', '.join(list(GROUPS) + list(CONFIGS))}")
        out += [n for n in GROUPS.get(name, [name]) if n not in out]
    return out


def run_all(args, names):
    """Every (configuration, seed) as its own process, --jobs at a time, into runs_dir/<configuration>/."""
    jobs = [(name, seed) for name in names for seed in args.seeds]
    if args.reuse:
        jobs = [(name, seed) for name, seed in jobs if seed not in finished_runs(args.runs_dir, name)]
    if set(GROUPS["vllm"]) & {name for name, _ in jobs}:
        prepare_vllm(args)
    running = []
    while jobs or running:
        while jobs and len(running) < args.jobs:
            name, seed = jobs.pop(0)
            out = os.path.join(args.runs_dir, name)
            python = VLLM_PYTHON if name in GROUPS["vllm"] else sys.executable  # both legs: only --vllm differs
            cmd = [python, *CONFIGS[name], "--seed", str(seed), "--output-dir", out, "--sample-every", "0"]
            if args.total_steps:
                cmd += ["--total-steps", str(args.total_steps)]
            os.makedirs(out, exist_ok=True)
            log = open(os.path.join(args.runs_dir, f"{name}_{seed}.log"), "w")
            print("running:", " ".join(cmd[1:]), flush=True)
            running.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(1)  # the next job starts as soon as any running one ends
        for process, log in [r for r in running if r[0].poll() is not None]:
            log.close()
            running.remove((process, log))


def prepare_vllm(args):
    """The vLLM venv is there, and the 2-head SFT policy: built by the vLLM venv's python when it is missing."""
    if not os.path.exists(os.path.join(ROOT, VLLM_PYTHON)):
        raise SystemExit(f"error: --configs vllm runs in {VLLM_PYTHON}, which is missing: the README's third command")
    if os.path.exists(os.path.join(ROOT, ARITH2, "arith-sft", "tokenizer.json")):
        return
    os.makedirs(args.runs_dir, exist_ok=True)
    print("building:", " ".join(ARITH2_BUILD), flush=True)
    with open(os.path.join(args.runs_dir, "arith-2heads.log"), "w") as log:
        subprocess.run([VLLM_PYTHON, *ARITH2_BUILD], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)


def accuracy_rows(args, data):
    """The table's rows: accuracy at start and end, time and samples to 90%, final KL (mean +- std over seeds)."""
    at = f" at update {args.at_update} |" if args.at_update else ""
    header = (
        f"| configuration | seeds | held-out accuracy, start |{at} end | seconds to 90% | samples to 90% | final KL* |"
    )
    rows = [header, "|---|---|---|---|---|---|---|" + ("---|" if at else "")]
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
    return rows


def summarise_arithmetic(args, data):
    """llm_learning.md, llm_accuracy.png and llm_reward_hacking.png."""
    rows = accuracy_rows(args, data)
    rows.append(
        "\n*ppo_llm.py: `objective/kl`, nats per response (k1 summed over its tokens); grpo_llm.py: `kl`, "
        "nats per token (k3, mean); both the mean of the last 5 updates. Accuracy: `eval/accuracy`, 256 "
        "held-out problems sampled at temperature 1; seconds: `time/elapsed` at the first evaluation >= 0.9. "
        f"{SHARED}"
    )
    table = "\n".join(rows)
    print(table)
    write_table("llm_learning.md", table, args.out_dir)

    # Curves: mean and min-max band over seeds, against updates, samples and wall time.
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for name, runs in data.items():
        for col, x in enumerate(["update", "episode", "time/elapsed"]):
            for row, key in enumerate(["eval/accuracy", "kl"]):
                # grpo with beta 0 loads no reference and logs no KL
                if not plot_band(axes[row, col], [series(r, kl_key(r) if key == "kl" else key, x) for r in runs], name):
                    continue
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
                plot_band(axis, [smooth(series(r, key), 10) for r in data[name]], color=color)  # 10-update mean
            ax.set_ylabel("reward-model score (raw)", color="C0")
            acc_ax.set_ylabel("true accuracy of the same rollouts", color="C3")
            ax.set_xlabel("updates")
            ax.set_title(f"{name}: `{' '.join(CONFIGS[name][1:])}`", fontsize=9)
        fig.suptitle(
            "PPO against the learned reward model: its score (blue) vs the truth (red), mean and min-max of 3 seeds"
        )
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "llm_reward_hacking.png"), dpi=80)


def summarise_trace(args, data):
    """trace_learning.md: PPO and GRPO with their defaults on the trace task, accuracy at start, 15 minutes, end."""
    seconds = 60 * TRACE_MINUTES
    header = f"| configuration | seeds | held-out accuracy, start | after {TRACE_MINUTES} min | end | updates in "
    header += f"{TRACE_MINUTES} min | each seed's run |"
    rows = [header, "|---|---|---|---|---|---|---|"]
    for name, runs in data.items():
        accuracy = [series(r, "eval/accuracy")[1] for r in runs]
        in_time = [at_time(r, seconds, "update") for r in runs]
        ends = [(r[-1]["update"], r[-1].get("time/elapsed", 0.0) / 60) for r in runs]
        rows.append(
            f"| {name} (`{' '.join(CONFIGS[name][:1] + CONFIGS[name][1 + len(TRACE) :])}`) | {len(runs)} | "
            f"{stat([a[0] for a in accuracy], '.3f')} | {stat([at_time(r, seconds) for r in runs], '.3f')} | "
            f"{stat([a[-1] for a in accuracy], '.3f')} | {stat(in_time, '.0f')} | "
            f"{'; '.join(f'{u} updates in {m:.1f} min' for u, m in ends)} |"
        )
    rows.append(
        f"\nEach is `python <script> {' '.join(TRACE)}` and the flags named, the script's defaults otherwise. "
        f"Accuracy: `eval/accuracy`, the 256 held-out problems of assets/sums/test.jsonl sampled at temperature 1, "
        f"mean ± std over seeds; after {TRACE_MINUTES} min: the last evaluation at or before `time/elapsed` = "
        f"{seconds} s (the last one when a run ended sooner). {SHARED}"
    )
    table = "\n".join(rows)
    print(table)
    write_table("trace_learning.md", table, args.out_dir)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in data.items():  # the evaluations' time/elapsed, averaged over seeds at each update
        minutes = [series(r, "eval/accuracy", "time/elapsed")[0] / 60 for r in runs]
        plot_band(axes[0], [(m, series(r, "eval/accuracy")[1]) for m, r in zip(minutes, runs)], name)
        plot_band(axes[1], [series(r, "eval/accuracy") for r in runs], name)
    axes[0].axvline(TRACE_MINUTES, color="gray", linestyle="--", linewidth=1)
    for ax, xlabel in zip(axes, ["minutes (time/elapsed)", "updates"]):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy")
    axes[0].legend()
    fig.suptitle("PPO and GRPO on the trace task (assets/sums-sft), CPU, one thread a run: mean and min-max over seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "trace_learning.png"), dpi=80)


def summarise_calc(args, data):
    """calc_learning.md and calc_learning.png: PPO and GRPO with the calculator, and their controls (every call fails):
    held-out accuracy and tool-call frequency at the start, after 15 minutes and at the end."""
    seconds = 60 * TRACE_MINUTES
    rows = [
        f"| configuration | seeds | held-out accuracy, start | after {TRACE_MINUTES} min | end | held-out calls per "
    ]
    rows[0] += f"response, start | after {TRACE_MINUTES} min | end | minutes to 0.90 | updates in {TRACE_MINUTES} min |"
    rows.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in data.items():
        accuracy = [series(r, "eval/accuracy")[1] for r in runs]
        calls = [series(r, "eval/tools/call_frequency")[1] for r in runs]
        minutes = [first_reaching(r, "time/elapsed") / 60 for r in runs]
        rows.append(
            f"| {name} (`{' '.join(CONFIGS[name][:1] + CONFIGS[name][1 + len(CALC) :])}`) | {len(runs)} | "
            f"{stat([a[0] for a in accuracy], '.3f')} | {stat([at_time(r, seconds) for r in runs], '.3f')} | "
            f"{stat([a[-1] for a in accuracy], '.3f')} | {stat([c[0] for c in calls], '.2f')} | "
            f"{stat([at_time(r, seconds, 'eval/tools/call_frequency') for r in runs], '.2f')} | "
            f"{stat([c[-1] for c in calls], '.2f')} | {stat(minutes, '.1f')} | "
            f"{stat([at_time(r, seconds, 'update') for r in runs], '.0f')} |"
        )
    rows.append(
        f"\nEach is `python <script> {' '.join(CALC)}` and the flags named, the script's defaults otherwise; the "
        f"control's tool (benchmarks/calc_control.py) has the calculator's name and description, and every call of it "
        f"fails. Held-out: the 256 problems of assets/calc/test.jsonl sampled at temperature 1 through the tool loop, "
        f"mean ± std over seeds; calls per response: `eval/tools/call_frequency`; after {TRACE_MINUTES} min: the last "
        f"evaluation at or before `time/elapsed` = {seconds} s (the last one when a run ended sooner); minutes to "
        f"0.90: `time/elapsed` at the first evaluation >= 0.9. {SHARED}"
    )
    table = "\n".join(rows)
    print(table)
    write_table("calc_learning.md", table, args.out_dir)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in data.items():  # the evaluations' time/elapsed, averaged over seeds at each update
        minutes = [series(r, "eval/accuracy", "time/elapsed")[0] / 60 for r in runs]
        plot_band(axes[0], [(m, series(r, "eval/accuracy")[1]) for m, r in zip(minutes, runs)], name)
        plot_band(axes[1], [(m, series(r, "eval/tools/call_frequency")[1]) for m, r in zip(minutes, runs)], name)
    for ax, ylabel in zip(axes, ["held-out accuracy", "held-out tool calls per response"]):
        ax.axvline(TRACE_MINUTES, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("minutes (time/elapsed)")
        ax.set_ylabel(ylabel)
    axes[0].legend()
    fig.suptitle("The calculator task (assets/calc-sft), CPU, one thread a run: mean and min-max over seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "calc_learning.png"), dpi=80)


def guess_verdict(data):
    """Whether the per-turn rewards helped PPO, from the held-out numbers of guess-ppo and guess-ppo-summed: on each
    measure, helped when every per-turn seed beats every summed seed, hurt when every summed seed beats every per-turn
    one, no clear difference when their seeds overlap; with the mean difference."""
    turn, summed = data["guess-ppo"], data["guess-ppo-summed"]

    def ends(runs, key):
        return np.array([series(r, key)[1][-1] for r in runs])

    def samples(runs, to):  # a seed that never got there counts its whole run (a lower bound)
        return np.array([to(r)[0] for r in runs], dtype=float)

    def success(run):
        return samples_to(run, GUESS_THRESHOLD)

    parts = []
    measures = [
        ("held-out success at the end", ends(turn, "eval/accuracy"), ends(summed, "eval/accuracy"), 1, ".3f"),
        ("held-out guesses at the end", ends(turn, "eval/tools/call_frequency"),
         ends(summed, "eval/tools/call_frequency"), -1, ".2f"),
        (f"samples to success >= {GUESS_THRESHOLD}", samples(turn, success), samples(summed, success), -1, ".0f"),
        (f"samples to <= {GUESS_FEW:g} guesses", samples(turn, samples_to_few), samples(summed, samples_to_few), -1,
         ".0f"),
    ]  # fmt: skip
    for label, a, b, better, fmt in measures:
        if (better * a).min() > (better * b).max():
            word = "per-turn better"
        elif (better * b).min() > (better * a).max():
            word = "summed better"
        else:
            word = "no clear difference (the seeds overlap)"
        parts.append(f"{label}: per-turn {np.mean(a):{fmt}}, summed {np.mean(b):{fmt}}, {word}")
    won = sum(p.endswith("per-turn better") for p in parts)
    lost = sum(p.endswith("summed better") for p in parts)
    if won and not lost:
        overall = f"per-turn credit helped, on {won} of {len(parts)} measures with no seed overlap"
    elif lost and not won:
        overall = f"per-turn credit hurt, on {lost} of {len(parts)} measures with no seed overlap"
    else:
        overall = "no clear effect of per-turn credit at these seeds"
    return overall, parts


GUESS_THRESHOLD = 0.9  # held-out success the table counts updates, samples and minutes to
GUESS_FEW = 5.0  # held-out guesses per game the table counts samples to: bisection's most (floor(log2 31) + 1)


def samples_to_few(run):
    """(samples at the first evaluation with at most GUESS_FEW guesses per game, False), or (the run's samples, True)
    when it never gets there: then they are a lower bound."""
    xs, guesses = series(run, "eval/tools/call_frequency", "episode")
    hits = np.nonzero(guesses <= GUESS_FEW)[0]
    if len(hits):
        return xs[hits[0]], False
    return run[-1]["episode"], True


def summarise_guess(args, data):
    """guess_learning.md and guess_learning.png: PPO with per-turn rewards, PPO with them summed at the end, GRPO and
    the control on the guessing game: held-out success and guesses per game at the start and the end against the
    optimum, the updates, samples and minutes to success >= 0.9, each seed, and a verdict computed from them."""
    header = "| configuration | seeds | success, start | end | guesses, start | end | end - bisection | "
    header += f"mean reward, end | updates to {GUESS_THRESHOLD} | samples to {GUESS_THRESHOLD} | minutes to "
    header += f"{GUESS_THRESHOLD} | samples to <= {GUESS_FEW:g} guesses | minutes a run |"
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in data.items():
        success = [series(r, "eval/accuracy")[1] for r in runs]
        guesses = [series(r, "eval/tools/call_frequency")[1] for r in runs]
        gap = [g[-1] - BISECTION_GUESSES for g in guesses]
        reward = [series(r, "eval/mean_reward")[1][-1] for r in runs]
        flags = CONFIGS[name][:1] + CONFIGS[name][1 + len(GUESS) :]
        rows.append(
            f"| {name} (`{' '.join(flags)}`) | {len(runs)} | {stat([s[0] for s in success], '.3f')} | "
            f"{stat([s[-1] for s in success], '.3f')} | {stat([g[0] for g in guesses], '.2f')} | "
            f"{stat([g[-1] for g in guesses], '.2f')} | {np.mean(gap):+.2f} ± {np.std(gap):.2f} | "
            f"{stat(reward, '.3f')} | {stat([first_reaching(r, 'update', GUESS_THRESHOLD) for r in runs], '.0f')} | "
            f"{stat([first_reaching(r, 'episode', GUESS_THRESHOLD) for r in runs], '.0f')} | "
            f"{stat([first_reaching(r, 'time/elapsed', GUESS_THRESHOLD) / 60 for r in runs], '.1f')} | "
            f"{stat([np.nan if few[1] else few[0] for few in map(samples_to_few, runs)], '.0f')} | "
            f"{stat([r[-1]['time/elapsed'] / 60 for r in runs], '.1f')} |"
        )
    rows.append(
        f"\nEach is `python <script> {' '.join(GUESS)}` and the flags named, the script's defaults otherwise: PPO 30 "
        "updates of 128 games, GRPO 60 of 8 prompts x 8 games, 3,840 games each. guess-ppo-summed's environment "
        "(benchmarks/guess_summed.py) is assets/guess.py's GuessingGame whose turn_rewards stays empty, so that the "
        "whole get_reward() lands on the episode's last token, as in GRPO; the control's (benchmarks/guess_control.py) "
        'answers every guess "no", so the answers say nothing about the hidden number (the game is scored as the '
        "real one). Held-out: the 248 games of assets/guess/test.jsonl sampled at temperature 1 through the tool loop, "
        "mean ± std over seeds; success: `eval/accuracy` (get_reward() > 0: a won game); guesses: "
        f"`eval/tools/call_frequency`, calls of guess per game (bisection, the optimum: {BISECTION_GUESSES:.2f}); "
        f"mean reward: `eval/mean_reward` (bisection: {BISECTION_REWARD:.3f}); updates, samples (`episode`) and "
        f"minutes (`time/elapsed`, evaluations included) at the first evaluation with success >= {GUESS_THRESHOLD}; "
        f"samples to <= {GUESS_FEW:g} guesses: at the first evaluation with at most {GUESS_FEW:g} guesses per game "
        "(bisection's most); the verdict counts a seed that never got there with its whole run (a lower bound). "
        f"{SHARED}"
    )
    rows += ["", "| configuration | each seed, in seed order: success at the end | guesses at the end | samples to "
             f"{GUESS_THRESHOLD} |", "|---|---|---|---|"]  # fmt: skip
    for name, runs in data.items():
        cells = [
            ", ".join(f"{series(r, 'eval/accuracy')[1][-1]:.3f}" for r in runs),
            ", ".join(f"{series(r, 'eval/tools/call_frequency')[1][-1]:.2f}" for r in runs),
            ", ".join(f"{first_reaching(r, 'episode', GUESS_THRESHOLD):.0f}" for r in runs).replace("nan", "-"),
        ]
        rows.append(f"| {name} | {' | '.join(cells)} |")
    overall, parts = guess_verdict(data)
    control = data["guess-ppo-control"]
    gain = np.mean([series(r, "eval/accuracy")[1][-1] - series(r, "eval/accuracy")[1][0] for r in control])
    real = np.mean([series(r, "eval/accuracy")[1][-1] - series(r, "eval/accuracy")[1][0] for r in data["guess-ppo"]])
    if gain < real / 2:
        needs = "what PPO learns needs the answers"
    else:
        needs = "the control gains as much: what PPO learns does not need the answers"
    rows.append(
        f"\nVerdict: {overall} ({'; '.join(parts)}). The control gained {gain:+.3f} success from start to end, "
        f"guess-ppo {real:+.3f}: {needs}. GRPO, which credits every token with the episode's total, ends at success "
        f"{np.mean([series(r, 'eval/accuracy')[1][-1] for r in data['guess-grpo']]):.3f} and "
        f"{np.mean([series(r, 'eval/tools/call_frequency')[1][-1] for r in data['guess-grpo']]):.2f} guesses after "
        f"the same games. That is what these seeds of one toy game show (248 held-out games an "
        "evaluation, a standard error of about 0.02 on success)."
    )
    table = "\n".join(rows)
    print(table)
    write_table("guess_learning.md", table, args.out_dir)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, runs in data.items():
        plot_band(axes[0], [series(r, "eval/accuracy", "episode") for r in runs], name)
        plot_band(axes[1], [series(r, "eval/tools/call_frequency", "episode") for r in runs], name)
        minutes = [series(r, "eval/accuracy", "time/elapsed")[0] / 60 for r in runs]
        plot_band(axes[2], [(m, series(r, "eval/accuracy")[1]) for m, r in zip(minutes, runs)], name)
    axes[0].axhline(GUESS_THRESHOLD, color="gray", linestyle=":", linewidth=1)
    axes[1].axhline(BISECTION_GUESSES, color="black", linewidth=1, label="bisection (4.16)")
    axes[2].axhline(GUESS_THRESHOLD, color="gray", linestyle=":", linewidth=1)
    labels = ["held-out success", "held-out guesses per game", "held-out success"]
    for ax, xlabel, ylabel in zip(axes, ["samples (episode)", "samples (episode)", "minutes (time/elapsed)"], labels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle("The guessing game (assets/guess-sft), CPU, one thread a run: mean and min-max over seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "guess_learning.png"), dpi=80)


# Each script's RL and its distillation, paired for the ratio of their samples to 90% of the teacher's accuracy
DISTILL_PAIRS = [("GRPO", "rl-grpo", "distill-grpo"), ("PPO", "rl-ppo", "distill-ppo")]
DISTILL_PAIRS.append(("PPO, distillation at gamma 0", "rl-ppo", "distill-ppo-gamma0"))
THINKING_MACHINES = (7, 10)  # Lu et al., "On-Policy Distillation" (2025): 7-10x fewer steps than RL in math


def samples_to(run, threshold):
    """(samples at the first evaluation >= threshold, False), or (the run's samples, True) when it never gets there:
    then they are a lower bound."""
    reached = first_reaching(run, "episode", threshold)
    if np.isnan(reached):
        return run[-1]["episode"], True
    return reached, False


def samples_ratio(rl_runs, distill_runs, threshold):
    """RL's samples to the threshold over distillation's: the ratio of the means over seeds, and its range (the
    fewest of RL over the most of distillation, to the most over the fewest). A seed that never got there counts its
    whole run, fewer samples than it would have needed: with an RL seed so, the ratio is a lower bound ("at least");
    with a distillation seed so, an upper bound ("at most"); with both, there is no ratio (None)."""
    rl = [samples_to(r, threshold) for r in rl_runs]
    distill = [samples_to(r, threshold) for r in distill_runs]
    rl_short, distill_short = any(short for _, short in rl), any(short for _, short in distill)
    if rl_short and distill_short:
        return None
    rl_samples, distill_samples = [s for s, _ in rl], [s for s, _ in distill]
    bound = ""
    if rl_short:
        bound = "at least"
    if distill_short:
        bound = "at most"
    return {
        "mean": np.mean(rl_samples) / np.mean(distill_samples),
        "low": min(rl_samples) / max(distill_samples),
        "high": max(rl_samples) / min(distill_samples),
        "bound": bound,
    }


def ratio_cell(ratio):
    if ratio is None:
        return "no ratio: a seed of each never reached it"
    sign = {"": "", "at least": ">= ", "at most": "<= "}[ratio["bound"]]
    return f"{sign}{ratio['mean']:.1f}x ({sign}{ratio['low']:.1f}x to {sign}{ratio['high']:.1f}x)"


def ratio_verdict(label, ratio):
    """One pair's ratio against Thinking Machines' 7-10x: below, within or above it, or not placed by a bound that
    does not exclude it (or no ratio)."""
    low, high = THINKING_MACHINES
    if ratio is None:
        return f"{label}: no ratio (a seed of each never got there)"
    mean, bound = ratio["mean"], ratio["bound"]
    why = {"at least": "an RL seed never got there", "at most": "a distillation seed never got there"}.get(bound)
    if (bound == "at least" and mean <= high) or (bound == "at most" and mean >= low):
        return f"{label}: {bound} {mean:.1f}x ({why}), which does not place it"
    if mean > high:
        where = "above"
    elif mean >= low:
        where = "within"
    else:
        where = "below"
    if bound:
        return f"{label}: {bound} {mean:.1f}x ({why}), {where} it"
    return f"{label}: {mean:.1f}x, {where} it"


def end_verdict(label, rl_runs, distill_runs):
    """The held-out accuracy at the end of a pair's runs (the same samples): distillation's mean against RL's, and
    whether they differ by more than their two standard deviations over seeds together (with 3 seeds, a coarse test)."""
    distill = [series(r, "eval/accuracy")[1][-1] for r in distill_runs]
    rl = [series(r, "eval/accuracy")[1][-1] for r in rl_runs]
    gap, spread = np.mean(distill) - np.mean(rl), np.std(distill) + np.std(rl)
    more = "more" if abs(gap) > spread else "not more"
    return (
        f"{label}: distillation {np.mean(distill):.3f}, RL {np.mean(rl):.3f}, a difference of {gap:+.3f}, {more} than "
        f"their standard deviations together ({spread:.3f})"
    )


def summarise_distill(args, data):
    """distill_learning.md and distill_learning.png: on-policy distillation and RL from the same student, against the
    teacher's held-out accuracy (distill/teacher_accuracy, logged at update 0 of every run with a teacher)."""
    teacher = []
    for runs in data.values():
        teacher += [m["distill/teacher_accuracy"] for run in runs for m in run if "distill/teacher_accuracy" in m]
    threshold = 0.9 * np.mean(teacher)
    header = "| configuration | seeds | held-out accuracy, start | end | updates to 90% of the teacher | samples "
    header += "to 90% | minutes to 90% | final reverse KL* |"
    rows = [header, "|---|---|---|---|---|---|---|---|"]
    rows.append(
        f"| the teacher (`{TEACHER}`: `distill/teacher_accuracy` of each run with a teacher) | {len(teacher)} runs | "
        f"{stat(teacher, '.3f')} | - | - | - | - | - |"
    )
    for name, runs in data.items():
        accuracy = [series(r, "eval/accuracy")[1] for r in runs]
        kl = []
        for run in runs:  # RL loads no teacher and logs no reverse KL
            values = series(run, "distill/reverse_kl")[1]
            kl.append(values[-10:].mean() if len(values) else np.nan)
        rows.append(
            f"| {name} (`{' '.join(CONFIGS[name])}`) | {len(runs)} | {stat([a[0] for a in accuracy], '.3f')} | "
            f"{stat([a[-1] for a in accuracy], '.3f')} | "
            f"{stat([first_reaching(r, 'update', threshold) for r in runs], '.0f')} | "
            f"{stat([first_reaching(r, 'episode', threshold) for r in runs], '.0f')} | "
            f"{stat([first_reaching(r, 'time/elapsed', threshold) / 60 for r in runs], '.1f')} | "
            f"{stat(kl, '.3f', 'no teacher')} |"
        )
    rows += ["", "| script | RL's samples to 90% of the teacher over distillation's: ratio of the means (range) |"]
    rows.append("|---|---|")
    verdicts, ends = [], []
    for label, rl, distill in DISTILL_PAIRS:
        ratio = samples_ratio(data[rl], data[distill], threshold)
        rows.append(f"| {label} ({rl} / {distill}) | {ratio_cell(ratio)} |")
        verdicts.append(ratio_verdict(label, ratio))
        ends.append(end_verdict(label, data[rl], data[distill]))
    seeds = "/".join(map(str, sorted({len(runs) for runs in data.values()})))
    low, high = THINKING_MACHINES
    rows.append(
        f"\nEvery run starts from {STUDENT}; the teacher ({TEACHER}): held-out accuracy {stat(teacher, '.3f')} "
        f"(`distill/teacher_accuracy` of the {len(teacher)} runs with a teacher), 90% of it {threshold:.3f}. Accuracy: "
        "`eval/accuracy`, 256 held-out problems sampled at temperature 1 (one sample each, standard error about 0.03), "
        "every 10 updates; updates, samples (`episode`) and minutes (`time/elapsed`): at the first evaluation at or "
        "above 90% of the teacher's. The first three are pure distillation (no reward is named: the arithmetic reward "
        "only measures), the last two RL with the arithmetic reward, each script's defaults otherwise. The ratio's "
        "range: the fewest samples of an RL seed over the most of a distillation seed, to the most over the fewest; "
        "'>=' where an RL seed never got there, '<=' where a distillation seed did not (its whole run counts). Within "
        "a script an update holds the same samples, so the ratio is one of updates too. *`distill/reverse_kl`, the "
        "sampled reverse KL to the teacher in nats per policy token, the mean of the last 10 updates (RL loads no "
        f"teacher). {SHARED}"
    )
    rows.append(
        f"\nVerdict, against Thinking Machines' {low}-{high}x fewer steps than RL (Lu et al., 2025, math with Qwen3 "
        f"models): {'; '.join(verdicts)}. Held-out accuracy at the end, after the same samples: {'; '.join(ends)}. "
        f"That is what {seeds} seeds of one toy task show (evaluations 10 updates apart, a standard error of about "
        "0.03 each), and nothing about larger models or longer answers."
    )
    table = "\n".join(rows)
    print(table)
    write_table("distill_learning.md", table, args.out_dir)

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for name, runs in data.items():
        for ax, x in zip(axes, ["update", "episode", "time/elapsed"]):
            curves = [series(r, "eval/accuracy", x) for r in runs]
            if x == "time/elapsed":
                curves = [(xs / 60, ys) for xs, ys in curves]
            plot_band(ax, curves, name)
        if name.startswith("distill"):
            plot_band(axes[3], [smooth(series(r, "distill/reverse_kl", "episode"), 10) for r in runs], name)
    for ax, xlabel in zip(axes, ["updates", "samples (episode)", "minutes (time/elapsed)"]):
        ax.axhline(np.mean(teacher), color="black", linewidth=1, label="the teacher")
        ax.axhline(threshold, color="gray", linestyle=":", linewidth=1, label="90% of the teacher")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy")
    axes[3].set_xlabel("samples (episode)")
    axes[3].set_ylabel("distill/reverse_kl (nats per token), 10-update mean")
    axes[0].legend(fontsize=8)
    axes[3].legend(fontsize=8)
    fig.suptitle(
        f"On-policy distillation and RL from {STUDENT}, CPU, one thread a run: mean and min-max over {seeds} seeds"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "distill_learning.png"), dpi=80)


def clip_key(run):
    """grpo_llm.py logs the hard clip's share as clip_ratio/region_mean, cispo's capped weights as cispo_clip_ratio."""
    return "cispo_clip_ratio" if any("cispo_clip_ratio" in m for m in run) else "clip_ratio/region_mean"


FAMILY_PANELS = [  # (metric or how to find it, axis label, moving-average window: per-update metrics are noisy)
    ("eval/accuracy", "held-out accuracy", 1),
    ("eval/mean_length_right", "held-out: mean length of right completions (tokens)", 1),
    ("eval/mean_length_wrong", "held-out: mean length of wrong completions (tokens)", 1),
    ("completions/mean_length", "training completions: mean length (tokens)", 10),
    ("entropy", "entropy (nats per token)", 10),
    (clip_key, "clip fraction (cispo: share of capped IS weights)", 10),
]


def summarise_family(args, data):
    """trace_family.md and trace_family.png: the GRPO family on the trace task."""

    def last(run, key, k=10):  # per-update metrics: the mean of the last k updates; evaluations: the last one
        ys = series(run, key)[1]
        return ys[-k:].mean() if len(ys) else np.nan

    header = "| variant (its flags) | seeds | updates | held-out accuracy, start | end | length right* | length wrong* "
    header += "| training length** | entropy** | clip fraction** | importance ratio** |"
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in data.items():
        flags = " ".join(FAMILY[VARIANT[name]])
        rows.append(
            f"| {VARIANT[name]} ({f'`{flags}`' if flags else 'the defaults'}) | {len(runs)} | "
            f"{', '.join(str(r[-1]['update']) for r in runs)} | "
            f"{stat([series(r, 'eval/accuracy')[1][0] for r in runs], '.3f')} | "
            f"{stat([last(r, 'eval/accuracy', 1) for r in runs], '.3f')} | "
            f"{stat([last(r, 'eval/mean_length_right', 1) for r in runs], '.1f', 'not logged')} | "
            f"{stat([last(r, 'eval/mean_length_wrong', 1) for r in runs], '.1f', 'not logged')} | "
            f"{stat([last(r, 'completions/mean_length') for r in runs], '.1f')} | "
            f"{stat([last(r, 'entropy') for r in runs], '.3f')} | "
            f"{stat([last(r, clip_key(r)) for r in runs], '.4f')} | "
            f"{stat([last(r, 'importance_ratio/mean') for r in runs], '.4f')} |"
        )
    runs = [run for runs in data.values() for run in runs]  # every variant starts from the same SFT policy
    formats = {"eval/mean_length_right": ".1f", "eval/mean_length_wrong": ".1f", "entropy": ".3f"}
    start = {key: stat([series(r, key)[1][0] for r in runs], fmt) for key, fmt in formats.items()}
    rows.append(
        f"\nEach is `python grpo_llm.py {' '.join(TRACE)} --num-iterations 4 --total-steps {FAMILY_UPDATES}` and the "
        "variant's flags; mean ± std over seeds. Accuracy: `eval/accuracy` (256 held-out problems, temperature 1) at "
        "the first and the last evaluation. *At the last evaluation, in tokens with the EOS: `eval/mean_length_right` "
        "(reward > 0), `eval/mean_length_wrong`. **Mean of the last 10 updates: `completions/mean_length`, `entropy`, "
        "`clip_ratio/region_mean` (cispo: `cispo_clip_ratio`), `importance_ratio/mean`. At the start (the first "
        f"evaluation and update, every run): length right {start['eval/mean_length_right']}, length wrong "
        f"{start['eval/mean_length_wrong']}, entropy {start['entropy']}."
    )
    rows += [
        "",
        "| variant | held-out accuracy at the end, each seed | its best evaluation, each seed (update) |",
        "|---|---|---|",
    ]
    for name, runs in data.items():
        ends, bests = [], []
        for run in runs:
            updates, accuracy = series(run, "eval/accuracy")
            ends.append(f"{accuracy[-1]:.3f}")
            bests.append(f"{accuracy.max():.3f} ({updates[accuracy.argmax()]})")
        rows.append(f"| {VARIANT[name]} | {', '.join(ends)} | {', '.join(bests)} |")
    table = "\n".join(rows)
    print(table)
    write_table("trace_family.md", table, args.out_dir)

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (key, label, window) in zip(axes.flat, FAMILY_PANELS):
        for name, runs in data.items():
            curves = [smooth(series(r, key(r) if callable(key) else key), window) for r in runs]
            # the updates every seed has a value at (an evaluation logs no length of wrong ones when all are right)
            common = sorted(set.intersection(*(set(c[0]) for c in curves)))
            curves = [(np.array(common), c[1][np.isin(c[0], common)]) for c in curves]
            plot_band(ax, curves, VARIANT[name])
        ax.set_xlabel("updates")
        ax.set_ylabel(label + (f", {window}-update mean" if window > 1 else ""), fontsize=9)
        if key is clip_key:  # gspo's tiny sequence-level range clips far more often than the others
            ax.set_yscale("symlog", linthresh=1e-4)
        if not ax.lines:  # eval/mean_length_* come with the scripts that log them
            ax.text(0.5, 0.5, f"{key}\nnot logged by these runs", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([]), ax.set_yticks([])
    axes[0, 0].legend()
    seeds = sorted({len(runs) for runs in data.values()})
    fig.suptitle(
        f"The GRPO family on the trace task (assets/sums-sft), --num-iterations 4, CPU: mean and min-max over "
        f"{'/'.join(map(str, seeds))} seed(s)"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "trace_family.png"), dpi=80)


def summarise_gpu(args, data):
    """llm_learning_cuda.md: the README's first command on one GPU, the arithmetic table's columns."""
    updates = ", ".join(str(run[-1]["update"]) for runs in data.values() for run in runs)
    rows = accuracy_rows(args, data)
    rows.append(
        f"\nThe README's first command on one GPU, the script's defaults there (bf16 autocast), {updates} updates a "
        "seed; the GPU and the versions: gpu_cuda.md. Accuracy: `eval/accuracy`, 256 held-out problems sampled at "
        "temperature 1; seconds: `time/elapsed` at the first evaluation >= 0.9. *`objective/kl`, nats per response "
        "(k1 summed over its tokens), the mean of the last 5 updates."
    )
    table = "\n".join(rows)
    print(table)
    write_table("llm_learning_cuda.md", table, args.out_dir)


def vllm_rows(name, legs):
    """One script's rows of vllm_learning.md: held-out accuracy of each leg at the same updates, and the verdict."""
    accuracy = {leg: [dict(zip(*series(r, "eval/accuracy"))) for r in runs] for leg, runs in legs.items()}
    updates = sorted(set.intersection(*(set(a) for seeds in accuracy.values() for a in seeds)))
    shown = set(updates[:: max(len(updates) // 10, 1)] + updates[-1:])  # about 11 rows; the verdict reads them all
    rows = [
        f"`{VLLM_PYTHON} {' '.join(CONFIGS[name])} --seed S [--vllm]`, {len(legs['vLLM'])} seeds a leg:",
        "",
        "| update | generate(): mean | each seed | vLLM: mean | each seed | vLLM's mean within generate()'s seeds |",
        "|---|---|---|---|---|---|",
    ]
    inside, gaps, spreads = [], [], []
    for u in updates:
        g = [a[u] for a in accuracy["generate()"]]
        v = [a[u] for a in accuracy["vLLM"]]
        inside.append(min(g) <= np.mean(v) <= max(g))
        gaps.append(abs(np.mean(v) - np.mean(g)))
        spreads.append(max(g) - min(g))
        if u in shown:
            rows.append(
                f"| {u} | {np.mean(g):.3f} | {', '.join(f'{x:.3f}' for x in g)} | {np.mean(v):.3f} | "
                f"{', '.join(f'{x:.3f}' for x in v)} | {'yes' if inside[-1] else 'no'} |"
            )
    diff_last = [series(r, "vllm/logprob_diff_max")[1][-1] for r in legs["vLLM"]]
    diff_all = [series(r, "vllm/logprob_diff_max")[1] for r in legs["vLLM"]]
    minutes = {leg: [r[-1]["time/elapsed"] / 60 for r in runs] for leg, runs in legs.items()}
    same = "yes" if np.mean(gaps) <= np.mean(spreads) else "no"
    rows += [
        "",
        f"Rows: {len(shown)} of the {len(updates)} evaluations. `vllm/logprob_diff_max` at the last update: "
        f"{', '.join(f'{x:.1e}' for x in diff_last)}; the largest over every update: "
        f"{', '.join(f'{x.max():.1e}' for x in diff_all)}; updates above 1e-5: "
        f"{', '.join(f'{(x > 1e-5).sum()} of {len(x)}' for x in diff_all)}. Minutes a run (`time/elapsed`): generate() "
        f"{', '.join(f'{x:.1f}' for x in minutes['generate()'])}, "
        f"vLLM {', '.join(f'{x:.1f}' for x in minutes['vLLM'])}.",
        "",
        f"Verdict: vLLM's mean lies within generate()'s seeds' min-max at {sum(inside)} of {len(updates)} "
        f"evaluations; the two means differ by {np.mean(gaps):.3f} on average, generate()'s seeds by "
        f"{np.mean(spreads):.3f}: no gross difference at {len(legs['vLLM'])} seeds a leg (the first at most the "
        f"second): {same}.",
    ]
    return rows


def summarise_vllm(args, data):
    """vllm_learning.md and vllm_learning.png: held-out accuracy with and without --vllm at the same updates, the
    mean and each seed of each leg, the log-prob check of the vLLM runs, and a verdict computed from them."""
    rows = [
        "Both legs in the vLLM venv (the README's third command), so that only `--vllm` differs: run by `python "
        "benchmarks/llm_learning.py --configs vllm --seeds 1 2 --jobs 1`, one run at a time, one torch thread, on 2 "
        f"CPU cores shared with other work. The policy: `{VLLM_PYTHON} {' '.join(ARITH2_BUILD[:-1])}` (the embedded "
        "SFT policy's builder with 2 heads, head size 80; no reward model is used). Held-out accuracy: "
        "`eval/accuracy`, 256 problems sampled at temperature 1, each seed in order. `vllm/logprob_diff_max`: "
        "|vLLM's log-prob - the trainer's|, the largest over an update's tokens.",
    ]
    names = [name for name in data if not name.endswith("-vllm")]
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 4 * len(names)), squeeze=False)
    for name, ax_row in zip(names, axes):
        legs = {"generate()": data[name], "vLLM": data[f"{name}-vllm"]}
        rows += ["", *vllm_rows(name, legs)]
        for leg, runs in legs.items():
            plot_band(ax_row[0], [series(r, "eval/accuracy") for r in runs], leg)
            minutes = [series(r, "eval/accuracy", "time/elapsed")[0] / 60 for r in runs]
            plot_band(ax_row[1], [(m, series(r, "eval/accuracy")[1]) for m, r in zip(minutes, runs)], leg)
        for ax, xlabel in zip(ax_row, ["updates", "minutes (time/elapsed)"]):
            ax.set_title(CONFIGS[name][0], fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out accuracy")
        ax_row[0].legend()
    table = "\n".join(rows)
    print(table)
    write_table("vllm_learning.md", table, args.out_dir)
    fig.suptitle("With and without --vllm, the 2-head arith-sft, CPU: mean and min-max over seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "vllm_learning.png"), dpi=80)


def main():
    args = tyro.cli(Args)
    names = expand(args.configs)
    groups = [group for group in GROUPS if set(GROUPS[group]) & set(names)]
    if args.run:
        run_all(args, names)
        for name in names:
            collect(args, name)
    # a group's table and figures are written from the curves of all its configurations, or not at all
    needed = [name for group in groups for name in GROUPS[group]]
    if missing := [name for name in needed if not os.path.exists(curves_path(args.out_dir, name))]:
        raise SystemExit(
            f"error: no curves of {' '.join(missing)} in {os.path.join(args.out_dir, CURVES)}: nothing "
            f"written; run them first (python benchmarks/llm_learning.py --configs {' '.join(missing)})"
        )
    summaries = {"arithmetic": summarise_arithmetic, "trace": summarise_trace, "trace-family": summarise_family,
                 "gpu": summarise_gpu, "calc": summarise_calc, "vllm": summarise_vllm,
                 "distill": summarise_distill, "guess": summarise_guess}  # fmt: skip
    for group in groups:
        summaries[group](args, {name: load(args.out_dir, name) for name in GROUPS[group]})


if __name__ == "__main__":
    main()
