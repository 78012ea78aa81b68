"""Data-parallel scaling of the LLM scripts under torchrun: tokens per second against processes.

Usage (from the repository root; 13 minutes on 2 CPU cores shared with other jobs):
    python benchmarks/ddp_scaling.py                        # 1 and 2 processes, CPU (gloo)
    python benchmarks/ddp_scaling.py --nproc 1 2 4 8        # on a machine with 8 GPUs (NCCL)

Each script runs with its defaults (the embedded model; --prompts-per-update is the whole update's, split over
the processes) for STEPS updates (times --steps-scale) under `torchrun --standalone --nproc_per_node N`, the
configurations interleaved --repeats times so that each sees the same machine load. The figure is the median over
updates 2.. of perf/tokens_per_sec (each rank's response tokens / its update's wall time, summed over the ranks), the
median over repeats. Writes benchmarks/results/ddp_scaling.csv and the table ddp_scaling.md, which also goes into
the docs pages that quote it (benchmarks/docs_tables.py).
"""

import argparse
import csv
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from docs_tables import write_table  # noqa: E402
from scale import machine_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = {"ppo_llm.py": 8, "grpo_llm.py": 20}

parser = argparse.ArgumentParser()
parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
parser.add_argument("--repeats", type=int, default=2)
parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply the updates per run")
cli = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
command = " ".join(["python benchmarks/ddp_scaling.py", *sys.argv[1:]])
updates = {script: int(steps * cli.steps_scale) for script, steps in STEPS.items()}
lines = [f"Machine: {machine_name(device)}, {'NCCL' if device == 'cuda' else 'gloo'}; load average "
         f"{os.getloadavg()[0]:.1f} at the start. Command: `{command}` ({cli.repeats} repeats; ppo_llm.py "
         f"{updates['ppo_llm.py']} updates, grpo_llm.py {updates['grpo_llm.py']}).", "",
         "| script | processes | tokens/s | speedup |", "|---|---|---|---|"]  # fmt: skip
torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
results = {}
for repeat in range(cli.repeats):
    for script, steps in updates.items():
        for n in cli.nproc:
            out = tempfile.mkdtemp()
            launch = [torchrun, "--standalone", "--nproc_per_node", str(n), script, "--total-steps", str(steps),
                      "--eval-every", "0", "--sample-every", "0", "--output-dir", out]  # fmt: skip
            subprocess.run(launch, cwd=ROOT, check=True, capture_output=True)
            (path,) = glob.glob(os.path.join(out, "*", "metrics.jsonl"))
            rates = [json.loads(line)["perf/tokens_per_sec"] for line in open(path)][1:]
            results.setdefault((script, n), []).append(statistics.median(rates))
            print(f"{script} x{n} repeat {repeat}: {results[(script, n)][-1]:.0f} tokens/s", flush=True)
os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
with open(os.path.join(ROOT, "benchmarks", "results", "ddp_scaling.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["script", "processes", "tokens_per_sec", "speedup", "repeats"])
    for (script, n), rates in results.items():
        rate, base = statistics.median(rates), statistics.median(results[(script, cli.nproc[0])])
        writer.writerow([script, n, f"{rate:.1f}", f"{rate / base:.2f}", " ".join(f"{r:.1f}" for r in rates)])
        lines.append(f"| {script} | {n} | {rate:.0f} | {rate / base:.2f}x |")
write_table("ddp_scaling.md", "\n".join(lines))
print("\n".join(lines))
