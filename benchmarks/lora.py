"""LoRA (--lora-r) against full fine-tuning, both LLM scripts, on this machine (CPU, fp32: no autocast there).

(a) memory and time: each script for 1 update on benchmarks/scale.py's GPT-2-124M- and Qwen2-0.5B-shaped models
    and the arithmetic prompts (random weights, vocabularies of 50257 and 151936: responses run to --max-new-tokens;
    Qwen2 with --critic head: a separate 0.5B critic would double the trained state), with and without --lora-r,
    each run in its own process: peak resident set (perf/peak_memory_mb, ru_maxrss, loading included) and seconds
    of that update (the first, warm-up included);
(b) learning: `ppo_llm.py` defaults on the embedded task for --updates updates, full fine-tuning (lr 1e-4, the
    default) against LoRA (--lora-r 16, lr 1e-3: LoRA usually wants ~10x), 3 seeds, held-out accuracy.
Runs are sequential, niced; results go to benchmarks/results/lora.json and lora.md as they come (lora.md also into the
docs pages that quote it, benchmarks/docs_tables.py).

    python benchmarks/lora.py                 # both parts
    python benchmarks/lora.py --part memory   # or learning
    python benchmarks/lora.py --part table    # measure nothing: lora.md and lora.png from lora.json

--part table without benchmarks/results/lora.json (it is written by a measuring run) says so and writes nothing.
"""

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import write_table  # noqa: E402
from scale import build, machine_name  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results")


@dataclass
class Args:
    part: Literal["both", "memory", "learning", "table"] = "both"
    """what to measure (table: only rewrite lora.md and lora.png from lora.json)"""
    updates: int = 30
    """PPO updates per learning run (the default run is 300)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    lora_r: int = 16
    lora_lr: float = 1e-3
    grpo: bool = False
    """also measure grpo_llm.py in part (a)"""


def run(script, flags, out):
    """One run of `script` in its own niced process; returns its metrics records."""
    cmd = ["nice", "-n", "10", sys.executable, os.path.join(ROOT, script), "--output-dir", out, *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def memory_part(args, results):
    common = ["--total-steps", "1", "--max-new-tokens", "4", "--micro-batch-size", "8", "--eval-every", "0",
              "--sample-every", "0"]  # fmt: skip
    # scale.py's models, built in a child process; their one-token-per-character tokenizers read the arithmetic prompts
    gpt2, qwen2 = ["--model", build("gpt2-124m")], ["--model", build("qwen2-0.5b")]
    ppo = ["--prompts-per-update", "8", "--num-mini-batches", "1", "--num-ppo-epochs", "1"]
    grpo = ["--prompts-per-update", "2", "--num-generations", "4", "--micro-batch-size", "4", "--beta", "0.04"]
    runs = [
        ("GPT-2-124M", "ppo_llm.py", gpt2, ppo),
        ("Qwen2-0.5B", "ppo_llm.py", qwen2, ppo + ["--critic", "head"]),
    ]
    runs += [("GPT-2-124M", "grpo_llm.py", gpt2, grpo)] if args.grpo else []
    for shape, script, model, flags in runs:
        for lora in [[], ["--lora-r", str(args.lora_r)]]:
            with tempfile.TemporaryDirectory() as out:
                m = run(script, [*common, *model, *flags, *lora], out)[-1]
            name = f"{shape}: {script} {'--lora-r ' + str(args.lora_r) if lora else '(full)'}"
            results["memory"][name] = {
                "peak_rss_mb": m["perf/peak_memory_mb"],
                "s_per_update": m["time/generation"] + m["time/scoring"] + m["time/update"],
                "flags": " ".join(flags + lora),
            }
            print(name, results["memory"][name], flush=True)
            save(results)


def learning_part(args, results):
    for seed in args.seeds:
        for name, flags in [("full", []), (f"lora-r{args.lora_r}", ["--lora-r", str(args.lora_r), "--learning-rate",
                                                                       str(args.lora_lr)])]:  # fmt: skip
            with tempfile.TemporaryDirectory() as out:
                m = run("ppo_llm.py", ["--seed", str(seed), "--total-steps", str(args.updates), *flags], out)
            curve = [(x["update"], x["eval/accuracy"]) for x in m if "eval/accuracy" in x]
            results["learning"].setdefault(name, {})[str(seed)] = {"curve": curve, "seconds": m[-1]["time/elapsed"]}
            print(name, seed, curve[-1], flush=True)
            save(results)


def save(results):
    with open(os.path.join(OUT, "lora.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"LoRA against full fine-tuning. Machine: {results['machine']}; CPU, fp32 (no autocast on CPU).\n"]
    if results["memory"]:
        lines += ["Memory: GPT-2-124M and Qwen2-0.5B shapes (random weights, from their configs), 1 update, 4 new "
                  "tokens.\n",
                  "| run | batch flags | peak RSS (MB) | s / update (the first) |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {k} | `{v['flags']}` | {v['peak_rss_mb']:.0f} | {v['s_per_update']:.1f} |"
                  for k, v in results["memory"].items()]  # fmt: skip
    if results["learning"]:
        updates = [u for u, _ in next(iter(next(iter(results["learning"].values())).values()))["curve"]]
        lines += ["\nLearning: the embedded task, `ppo_llm.py` defaults, held-out accuracy (256 problems, temperature "
                  "1), mean ± std over the seeds (numpy's, as in llm_learning.md).\n",
                  "| run | seeds | " + " | ".join(f"update {u}" for u in updates) + " | end, per seed |",
                  "|---|---|" + "---|" * (len(updates) + 1)]  # fmt: skip
        for name, seeds in results["learning"].items():
            curves = np.array([[a for _, a in s["curve"]] for s in seeds.values()])  # (seeds, evaluations)
            cells = [f"{m:.3f} ± {sd:.3f}" for m, sd in zip(curves.mean(0), curves.std(0))]
            ends = ", ".join(f"{e:.3f}" for e in curves[:, -1])
            lines.append(f"| {name} | {len(seeds)} | {' | '.join(cells)} | {ends} |")
    write_table("lora.md", "\n".join(lines), OUT)
    if results["learning"]:
        plot(results["learning"])


def plot(learning):
    """Held-out accuracy against updates, a line per seed, LoRA beside full fine-tuning: lora.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, seeds), color in zip(learning.items(), ["C0", "C1", "C2"]):
        for i, s in enumerate(seeds.values()):
            ax.plot(*zip(*s["curve"]), color=color, alpha=0.8, label=name if i == 0 else None)
    ax.set(xlabel="PPO update (128 responses each)", ylabel="held-out accuracy", title="ppo_llm.py: LoRA vs full")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "lora.png"), dpi=100)


def main():
    args = tyro.cli(Args)
    results = {"machine": machine_name("cpu"), "memory": {}, "learning": {}}
    path = os.path.join(OUT, "lora.json")
    if os.path.exists(path):  # one part at a time keeps the other's results
        with open(path) as f:
            results = json.load(f)
    if args.part == "table":
        # a header with no rows would replace the docs' placeholders: without results, say so and write nothing
        if not results["memory"] and not results["learning"]:
            state = "has no results" if os.path.exists(path) else "does not exist"
            raise SystemExit(
                f"error: --part table: {os.path.relpath(path, ROOT)} {state}: measure first "
                "(python benchmarks/lora.py, or --part memory / --part learning)"
            )
        return save(results)
    results["args_" + args.part] = vars(args)
    if args.part in ("both", "memory"):
        results["memory"] = {}  # measured again in full
        memory_part(args, results)
    if args.part in ("both", "learning"):
        learning_part(args, results)


if __name__ == "__main__":
    main()
