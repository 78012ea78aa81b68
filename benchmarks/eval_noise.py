"""How much one held-out evaluation of a policy varies: assets/sums-sft, evaluated as each place that quotes it does.

The trace task's SFT policy is quoted at several accuracies: assets/README.md (make_sums_models.py's evaluation after
building it), the start of the trace tables (each script's evaluation at update 0, for seeds 1, 2, 3). All of them
sample one completion of each of the 256 problems of assets/sums/test.jsonl at temperature 1 from the same policy and
score it with the same rule; they differ in the random numbers the samples are drawn with. This evaluates the policy

- as make_sums_models.py does (policy_metrics: torch seed 1, the 256 prompts in one generate);
- as grpo_llm.py and ppo_llm.py do at update 0 of a run (`--total-steps 0`), seeds 1, 2, 3: ppo_llm.py samples 128
  prompts a batch (grpo_llm.py 64) and builds its value model first, whose initialisation draws from the same
  generator, so its samples are not grpo_llm.py's, nor those of its own --eval-only (no value model), also measured;
- with `grpo_llm.py --eval-only`, seeds 1 to --seeds, for the spread of one evaluation and the mean of many.

    python benchmarks/eval_noise.py              # about 3 minutes on one CPU core
    python benchmarks/eval_noise.py --table      # measure nothing: eval_noise.md from eval_noise.json

Results: benchmarks/results/eval_noise.json and eval_noise.md (also into the docs pages that quote it,
benchmarks/docs_tables.py). --table without eval_noise.json says so and writes nothing.
"""

import contextlib
import io
import json
import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "assets"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import make_sums_models  # noqa: E402
from docs_tables import write_table  # noqa: E402
from llm_learning import TRACE  # noqa: E402

import grpo_llm  # noqa: E402
import ppo_llm  # noqa: E402

KEYS = ["eval/accuracy", "eval/mean_length_right", "eval/mean_length_wrong"]


@dataclass
class Args:
    seeds: int = 30
    """evaluations with grpo_llm.py --eval-only, seeds 1 to N"""
    table: bool = False
    """measure nothing: eval_noise.md from eval_noise.json"""
    out_dir: str = os.path.join(ROOT, "benchmarks", "results")


def script_evaluation(module, flags):
    """The metrics of one run of a script's main() (its printing silenced)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return module.main(module.parse_args([*TRACE, *flags]))


def update_zero(module, seed):
    """The evaluation a run of `module` logs at update 0 (--total-steps 0: no update)."""
    with tempfile.TemporaryDirectory() as out:
        run_dir = script_evaluation(module, ["--seed", str(seed), "--total-steps", "0", "--output-dir", out])
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return json.loads(f.readline())


def builder_evaluation():
    """make_sums_models.py's evaluation of the saved policy, as its main() makes it after training."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = os.path.join(ROOT, "assets", "sums-sft")
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    with open(os.path.join(ROOT, "assets", "sums", "test.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    torch.manual_seed(make_sums_models.Args().seed)
    m = make_sums_models.policy_metrics(policy, tokenizer, rows, True, make_sums_models.Args().eval_max_new_tokens)
    return {key: m[key.removeprefix("eval/")] for key in KEYS}


def measure(args):
    os.chdir(ROOT)  # the trace task's flags name files under the repository root
    results = {"builder": builder_evaluation()}
    results["grpo_update_0"] = [update_zero(grpo_llm, seed) for seed in [1, 2, 3]]
    results["ppo_update_0"] = [update_zero(ppo_llm, seed) for seed in [1, 2, 3]]
    results["ppo_eval_only"] = [script_evaluation(ppo_llm, ["--eval-only", "--seed", str(seed)]) for seed in [1, 2, 3]]
    seeds = range(1, args.seeds + 1)
    results["eval_only"] = [script_evaluation(grpo_llm, ["--eval-only", "--seed", str(seed)]) for seed in seeds]
    return results


def write(results, out_dir):
    """eval_noise.md from the evaluations."""
    formats = [".3f", ".1f", ".1f"]

    def each(evaluations):  # per metric: each evaluation's value, and their mean
        cells = []
        for key, fmt in zip(KEYS, formats):
            values = [e[key] for e in evaluations]
            cells.append(", ".join(f"{v:{fmt}}" for v in values) + f" (mean {np.mean(values):{fmt}})")
        return " | ".join(cells)

    many = results["eval_only"]
    spread = []
    for key, fmt in zip(KEYS, formats):
        values = [e[key] for e in many]
        spread.append(f"{np.mean(values):{fmt}} ± {np.std(values):{fmt}}")
    builder = " | ".join(f"{results['builder'][key]:{fmt}}" for key, fmt in zip(KEYS, formats))
    stderr = np.mean([e["eval/accuracy_stderr"] for e in many])
    lines = [
        "assets/sums-sft on the 256 problems of assets/sums/test.jsonl, one completion each sampled at temperature 1, "
        "scored by the gsm8k rule; lengths in tokens with the EOS, of the right (reward > 0) and of the wrong "
        "completions. Command: `python benchmarks/eval_noise.py`",
        "",
        "| evaluation | its random numbers | accuracy | length right | length wrong |",
        "|---|---|---|---|---|",
        f"| make_sums_models.py's, in assets/README.md | torch seed 1, the 256 prompts in one batch | {builder} |",
        f"| grpo_llm.py's at update 0: the trace tables' grpo start | seeds 1, 2, 3 | {each(results['grpo_update_0'])}"
        " |",
        "| ppo_llm.py's at update 0: the trace table's ppo start | seeds 1, 2, 3, drawn after the value model's "
        f"initialisation, 128 prompts a batch (grpo_llm.py: 64) | {each(results['ppo_update_0'])} |",
        "| `ppo_llm.py --eval-only` | seeds 1, 2, 3, no value model, 128 prompts a batch | "
        f"{each(results['ppo_eval_only'])} |",
        f"| `grpo_llm.py --eval-only` | seeds 1 to {len(many)}: mean ± std | {' | '.join(spread)} |",
        "",
        f"One evaluation's standard error (`eval/accuracy_stderr`, the mean over the {len(many)}): {stderr:.3f}.",
    ]
    write_table("eval_noise.md", "\n".join(lines), out_dir)
    return "\n".join(lines)


def main():
    args = tyro.cli(Args)
    path = os.path.join(args.out_dir, "eval_noise.json")
    if args.table:
        if not os.path.exists(path):  # a table without rows would replace the docs': say so and write nothing
            where = os.path.relpath(path)
            raise SystemExit(f"error: --table: {where} does not exist: measure first (python benchmarks/eval_noise.py)")
        with open(path) as f:
            return print(write(json.load(f), args.out_dir))
    results = measure(args)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(write(results, args.out_dir))


if __name__ == "__main__":
    main()
