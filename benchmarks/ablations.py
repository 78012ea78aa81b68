"""What each implementation detail of ppo_llm.py buys on the embedded task: the run as it is, and the run with one
detail left out, 3 seeds each, every run a fresh process.

Each ablation is the smallest change that removes its detail, made here, not in ppo_llm.py: a flag where one exists,
else one line of one of its functions replaced in the imported module (the line and its replacement are in ABLATIONS
and in the table), so that the script gains no flag that exists only to be switched off. The run is ppo_llm.py's
defaults but for --total-steps 150 (the default 300 reaches 0.90 near update 70 and gains little after 150); the two
details that act on a reward model's scores are measured against the same run with --reward-model assets/arith-rm
(and --reward-fn arithmetic, whose accuracy is the one measured). Recorded for every run: the held-out accuracy at
each evaluation (256 prompts, every 10 updates), updates and seconds to 0.90 (never: not within the run), the KL to
the reference at the end (objective/kl, the mean over the last 10 updates), the first minibatch's mean ratio and
approx-KL (detail 5), and whether a non-finite gradient stopped the run.

    python benchmarks/ablations.py                     # every run, 2 at a time: benchmarks/results/ablations.json
    python benchmarks/ablations.py --ablations full dropout --seeds 1
    python benchmarks/ablations.py --table             # measure nothing: the table and figure from ablations.json
"""

import inspect
import json
import math
import os
import platform
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
RM = ["--reward-model", "assets/arith-rm", "--reward-fn", "arithmetic"]
# name: (detail, baseline, flags, [(function, line, its replacement)], what is left out)
ABLATIONS = {
    "full": ("", "", [], [], "ppo_llm.py as it is"),
    "full, reward model": ("", "", RM, [], "as it is, scored by the embedded reward model"),
    "no EOS cut": ("2", "full", [], [("truncate_after_eos",
        "return responses.masked_fill(after_eos, pad_token_id), ~after_eos, is_eos.any(1)",
        "return responses, torch.ones_like(after_eos), is_eos.any(1)")],
        "the tokens after the first EOS count in every loss (and the score lands on the last position)"),
    "score on the last position": ("3", "full", [], [("main",
        "rewards[torch.arange(batch_size, device=device), last] += normalized",
        "rewards[:, -1] += normalized")],
        "the score added at the padded response's last position, not its last real token's"),
    "no KL penalty": ("3, 12", "full", ["--kl-coef", "0"], [("main",
        "if ref_policy is None and (args.kl_coef or args.kl_target):", "if ref_policy is None:")],
        "beta = 0 (the reference still scored, for the KL it would have penalised)"),
    "top-k 50 sampling": ("4", "full", [], [("load_models",
        "do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0",
        "do_sample=True, temperature=args.temperature, top_k=50, top_p=1.0")],
        "sampling with transformers' default top-k 50, the log-probs still of softmax(logits / T)"),
    "old log-probs in one pass": ("5", "full", [], [("main",
        "out = [training_forward(policy, critic, value_head, batch, mb, args) for mb in micro_batches]",
        "out = [training_forward(policy, critic, value_head, batch, mb, args) for mb in [epochs[0]]]")],
        "old log-probs and values from one forward over the whole batch, not the training's micro-batches"),
    "dropout 0.1": ("6", "full", [], [("load_model",
        'config.update({k: 0.0 for k, v in config.to_dict().items() if isinstance(v, float) and "drop" in k})',
        'config.update({k: 0.1 for k, v in config.to_dict().items() if isinstance(v, float) and "drop" in k})'),
        ("load_model", "module.p = 0.0", "module.p = 0.1")],
        "GPT-2's dropout 0.1 left on in training (generation and scoring run in eval mode)"),
    "position ids 0, 1, 2, ...": ("6", "full", [], [("position_ids",
        "return (attention_mask.cumsum(1) - 1).clamp(min=0)",
        "return torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)")],
        "position ids counted from the left edge, padding included (generate() counts real tokens)"),
    "random value head": ("8", "full", [], [("build_value_model",
        "nn.init.zeros_(value_head.weight)", "pass")],
        "the value head's weight left at nn.Linear's random initialisation"),
    "critic from the policy": ("8", "full, reward model", RM, [("build_value_model",
        "source = args.reward_model if reward_model is not None and rm_tokenizer is None else args.model",
        "source = args.model")],
        "with a reward model, the critic initialised from the policy instead of the reward model"),
    "advantages not whitened": ("9", "full", [], [("main",
        "advantages = masked_whiten(advantages, mask)", "pass")],
        "GAE's advantages as they are, not whitened over the batch"),
    "no value clipping": ("10", "full", [], [("value_loss",
        "loss = 0.5 * masked_mean(torch.max(losses, clipped_losses), mask)",
        "loss = 0.5 * masked_mean(losses, mask)")],
        "the plain squared error for the value loss"),
    "micro-batches averaged": ("11", "full", ["--micro-batch-size", "8"], [("accumulate_gradients",
        "(loss * mask.sum() / n_tokens).backward()", "(loss / len(micro_batches)).backward()")],
        "each micro-batch's token mean weighted alike (8 micro-batches of 8), not by its share of the tokens"),
    "scores not whitened": ("13", "full, reward model", [*RM, "--score-norm", "off"], [],
        "with a reward model, its raw scores in the reward, not whitened per batch"),
}  # fmt: skip
# what each row shows, written from the results in benchmarks/results/ablations.json (--table puts it in the table)
READINGS = {
    "no EOS cut": "lower, and 0.90 in 1 run of 3: the pad after EOS enters every loss and the KL (its mean swings from "
    "-0.65 to 5.0 nats), and the score moves to the last position",
    "score on the last position": "the score is lost for every response shorter than the longest (a reward at a "
    "masked position counts 0): never 0.90",
    "no KL penalty": "no measurable effect in 150 updates: the KL without the penalty is as small (0.52 nats a "
    "response), so at beta 0.05 the penalty (about 0.03) barely acts here",
    "top-k 50 sampling": "no measurable effect here (50 of 98 tokens), though the sampler's distribution is then not "
    "the one the log-probs describe",
    "old log-probs in one pass": "the full run's numbers, bit for bit: a CPU runs one kernel for every batch shape, "
    "so the first ratio stays exactly 1; on a GPU it would not",
    "dropout 0.1": "the first ratio is 0.92 and the first approx-KL 0.9 before any step: the clip sees dropout's "
    "noise as policy change, and learning stalls near 0.81",
    "position ids 0, 1, 2, ...": "a left-padded prompt sits at other positions than in generate(), so the log-probs "
    "are not the sampler's (the KL estimate turns negative): lower",
    "random value head": "within the noise here",
    "critic from the policy": "no measurable effect with the embedded reward model",
    "advantages not whitened": "no measurable effect (0.90 sooner, within the noise)",
    "no value clipping": "the full run's numbers, bit for bit: the value clip never binds in it (its val/clipfrac_avg "
    "is 0 throughout)",
    "micro-batches averaged": "no measurable effect: responses of 3.5 tokens on average give the micro-batches nearly "
    "equal token counts",
    "scores not whitened": "the raw scores outweigh the KL penalty: the KL nearly doubles and the accuracy falls, the "
    "reward model optimised against the truth (as ppo-rm-raw in Results)",
}


@dataclass
class Args:
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    """the runs to make (names in ABLATIONS); each replaces its earlier results in ablations.json"""
    seeds: tuple[int, ...] = (1, 2, 3)
    """seeds of each"""
    total_steps: int = 150
    """updates per run"""
    jobs: int = 2
    """runs at a time (each runs on one torch thread)"""
    runs_dir: str = os.path.join(ROOT, "benchmarks", "runs", "ablations")
    """where the runs' directories and logs go"""
    table: bool = False
    """measure nothing: the table and figure from benchmarks/results/ablations.json"""
    child: str | None = None
    """internal: make one run in this process (a JSON spec) and print its record"""


def apply(module, name):
    """Ablation `name`'s line replacements, in module: each function it changes redefined in place from its source (the
    file's: a function's lines are read from its file)."""
    for function in dict.fromkeys(function for function, _, _ in ABLATIONS[name][3]):
        source = textwrap.dedent(inspect.getsource(getattr(module, function)))
        for _, line, replacement in [patch for patch in ABLATIONS[name][3] if patch[0] == function]:
            assert source.count(line) == 1, (name, function, line)
            source = source.replace(line, replacement)
        exec(compile(source, module.__file__, "exec"), module.__dict__)


def child(spec):
    """One run: the ablation applied to ppo_llm, main() on its flags; the run's record from its metrics.jsonl."""
    sys.path.insert(0, ROOT)
    import ppo_llm

    apply(ppo_llm, spec["ablation"])
    first, accumulate = {}, ppo_llm.accumulate_gradients

    def first_minibatch(*args, **kwargs):  # its stats before any optimizer step (detail 5)
        stats = accumulate(*args, **kwargs)
        first.setdefault("stats", stats)
        return stats

    ppo_llm.accumulate_gradients = first_minibatch
    diverged, step = [], ppo_llm.optimizer_step

    def noting_divergence(*args):  # a non-finite gradient norm stops the run (after saving): diverged
        try:
            return step(*args)
        except FloatingPointError:
            diverged.append(True)
            raise

    ppo_llm.optimizer_step = noting_divergence
    argv = [*ABLATIONS[spec["ablation"]][2], "--seed", str(spec["seed"]), "--total-steps", str(spec["total_steps"])]
    argv += ["--output-dir", spec["run_dir"], "--save-every", "0", "--sample-every", "0", *spec.get("toy", [])]
    start = time.time()
    try:
        run_dir = ppo_llm.main(ppo_llm.parse_args(argv))
    except SystemExit:
        if not diverged:
            raise
        run_dir = os.path.join(spec["run_dir"], os.listdir(spec["run_dir"])[0])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    curve = [[m["update"], m["eval/accuracy"]] for m in metrics if "eval/accuracy" in m]
    reached = [m for m in metrics if m.get("eval/accuracy", 0) >= 0.9]
    updates = [m for m in metrics if "objective/kl" in m]
    stats = first.get("stats", [])
    record = {
        "ablation": spec["ablation"],
        "seed": spec["seed"],
        "command": "python ppo_llm.py " + " ".join(argv[: argv.index("--output-dir")]),
        "final_accuracy": curve[-1][1],
        "curve": curve,
        "updates_to_90": reached[0]["update"] if reached else None,
        "seconds_to_90": reached[0].get("time/elapsed") if reached else None,
        "final_kl": sum(m["objective/kl"] for m in updates[-10:]) / len(updates[-10:]),
        "first_ratio": sum(s["val/ratio"].item() for s in stats) / len(stats) if stats else None,
        "first_approxkl": sum(s["policy/approxkl_avg"].item() for s in stats) / len(stats) if stats else None,
        "kl_coef": updates[-1]["objective/kl_coef"],
        "diverged": bool(diverged),
        "updates": len(updates),
        "seconds": time.time() - start,
    }
    print(json.dumps(record))


def run(name, seed, args):
    """One run in a fresh process, its output in runs_dir/<name>_<seed>.log; its record."""
    run_dir = os.path.join(args.runs_dir, f"{name}_{seed}".replace(" ", "_").replace(",", ""))
    spec = {"ablation": name, "seed": seed, "total_steps": args.total_steps, "run_dir": run_dir}
    os.makedirs(run_dir, exist_ok=True)
    with open(run_dir + ".log", "w") as log:
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=log, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"error: the {name} run of seed {seed} failed: {run_dir}.log says why")
    print(f"{name}, seed {seed}: {done.stdout.splitlines()[-1][:160]}", flush=True)
    return json.loads(done.stdout.splitlines()[-1])


def mean_se(values):
    """(mean, standard error) of the values, None where a value is None (a run that never reached 0.90)."""
    if not values or any(v is None for v in values):
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def shown(mean, se, digits):
    return "never" if mean is None else f"{mean:.{digits}f} ± {se:.{digits}f}"


def table(saved):
    """The table: a row per ablation, mean ± standard error over its seeds, the difference from its baseline's."""
    runs = {}
    for r in saved["runs"]:
        runs.setdefault(r["ablation"], []).append(r)
    seeds = sorted({r["seed"] for r in saved["runs"]})
    lines = [
        f"`python benchmarks/ablations.py` on {saved['machine']}, torch {saved['torch']}: ppo_llm.py's embedded run "
        f"for {saved['total_steps']} updates, seeds {', '.join(map(str, seeds))}, two runs at a time, "
        f"{saved['hours']:.1f} hours in all. Mean ± standard error over the seeds; Δ: the difference of the means from "
        "the baseline's, marked ~ when it is under twice its standard error (no measurable effect). first ratio: the "
        "mean ratio of the first minibatch, before any optimizer step.",
        "",
        "| left out (detail) | the change | final accuracy | Δ | updates to 0.90 | final KL | Δ | first ratio | "
        "diverged | reading |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (detail, baseline, flags, patches, what) in ABLATIONS.items():
        if name not in runs:
            continue
        rs = runs[name]
        acc, kl = mean_se([r["final_accuracy"] for r in rs]), mean_se([r["final_kl"] for r in rs])
        deltas = []
        for key, (mean, se) in [("final_accuracy", acc), ("final_kl", kl)]:
            base = mean_se([r[key] for r in runs.get(baseline, [])])
            if not baseline or base[0] is None:
                deltas.append("")
                continue
            diff, error = mean - base[0], math.sqrt(se**2 + base[1] ** 2)
            deltas.append(f"{diff:+.3f}" + (" ~" if abs(diff) < 2 * error else ""))
        reached = [r["updates_to_90"] for r in rs if r["updates_to_90"] is not None]
        to_90 = shown(*mean_se(reached), 0) if reached else "never"
        if 0 < len(reached) < len(rs):
            to_90 += f" (never in {len(rs) - len(reached)} of {len(rs)})"
        shown_flags = [flag for flag in flags if name.startswith("full") or flag not in RM]
        change = [f"`{' '.join(shown_flags)}`"] if shown_flags else []
        for function, old, new in patches:
            change.append(f"`{function}` drops `{old}`" if new == "pass" else f"`{function}`: `{new}`")
        ratio = mean_se([r["first_ratio"] for r in rs])
        label = f"{name} ({detail})" if detail else name
        lines.append(f"| {label}: {what} | {'; '.join(change) or '-'} | {shown(*acc, 3)} | {deltas[0]} | {to_90} | "
                     f"{shown(*kl, 2)} | {deltas[1]} | {shown(*ratio, 4)} | {sum(r['diverged'] for r in rs)} of "
                     f"{len(rs)} | {READINGS.get(name, '')} |")  # fmt: skip
    return "\n".join(lines)


def figure(saved, path):
    """Each run's held-out accuracy against updates, a panel per ablation beside its baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in ABLATIONS if ABLATIONS[name][1] and any(r["ablation"] == name for r in saved["runs"])]
    columns = 4
    fig, axes = plt.subplots(math.ceil(len(names) / columns), columns, figsize=(14, 2.6 * math.ceil(len(names) / 4)),
                             sharex=True, sharey=True, squeeze=False)  # fmt: skip
    for ax, name in zip(axes.flat, names):
        for who, color in [(ABLATIONS[name][1], "0.6"), (name, "C3")]:
            for r in [r for r in saved["runs"] if r["ablation"] == who]:
                ax.plot(*zip(*r["curve"]), color=color, lw=1, label=who if r["seed"] == 1 else None)
        ax.axhline(0.9, color="0.8", lw=0.5, ls="--")
        ax.set_title(f"{name} (detail {ABLATIONS[name][0]})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("update")
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def write(saved):
    write_table("ablations.md", table(saved), results_dir=RESULTS)
    figure(saved, os.path.join(RESULTS, "ablations.png"))


def main():
    args = tyro.cli(Args)
    if args.child:
        return child(json.loads(args.child))
    path = os.path.join(RESULTS, "ablations.json")
    if args.table:
        return write(saved_results(path)[0])
    unknown = [name for name in args.ablations if name not in ABLATIONS]
    if unknown:
        raise SystemExit(f"error: --ablations {unknown[0]}: not one of {', '.join(ABLATIONS)}")
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    saved = {"runs": []}
    if os.path.exists(path):
        saved = saved_results(path)[0]
    machine = f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"
    saved |= {"machine": machine, "torch": torch.__version__, "total_steps": args.total_steps}
    start = time.time()
    jobs = [(name, seed) for seed in args.seeds for name in args.ablations]
    with ThreadPoolExecutor(args.jobs) as pool:
        records = list(pool.map(lambda job: run(*job, args), jobs))
    done = {(r["ablation"], r["seed"]) for r in records}
    saved["runs"] = [r for r in saved["runs"] if (r["ablation"], r["seed"]) not in done] + records
    saved["hours"] = saved.get("hours", 0) + (time.time() - start) / 3600  # every invocation's wall time
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    write(saved)
    print(table(saved))


if __name__ == "__main__":
    main()
