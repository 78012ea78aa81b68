"""Exit codes of many 2-process torchrun launches of one LLM script: how often a finished run still fails.

Each launch is `torchrun --standalone --nproc_per_node 2 <script>` on the embedded default with tiny settings (2
updates, the settings of tests/test_ddp.py), one after another, each in a fresh output directory that is deleted
afterwards, with OMP_NUM_THREADS=1. A line per launch gives its exit code and seconds; at the end the exit codes are
counted, and benchmarks/results/torchrun_stress_<script>.json (under --root) keeps every launch's code and time, the
last lines of each failure's stderr, whether the failed run had saved its policy (an abort at exit, after the work),
the machine, its load average before and after, and the torch version; the summary goes into the docs through
docs_tables.write_table. The failure this was written for: a rank that aborts at exit with "terminate called without
an active exception", a gloo worker thread that needs the GIL after the interpreter has started to shut down. It
lives on when something still holds the process group at destroy_process_group(): the scripts import
torch.distributed.nn before init_process_group for that reason (tests/test_ddp.py).

    python benchmarks/torchrun_stress.py                                  # ppo_llm.py, 100 launches (~15 min, CPU)
    python benchmarks/torchrun_stress.py --script grpo_llm.py --launches 200
    python benchmarks/torchrun_stress.py --root /path/to/checkout         # that checkout's scripts and results/
    python benchmarks/torchrun_stress.py --script grpo_llm.py --table    # measure nothing: the table from its .json
"""

import collections
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402
from scale import machine_name  # noqa: E402

# the end-to-end torchrun test's settings: 2 updates, a sample line each, an evaluation of 20 prompts at 0 and 2
SETTINGS = {
    "ppo_llm.py": ["--prompts-per-update", "8", "--num-mini-batches", "1"],
    "grpo_llm.py": ["--prompts-per-update", "4", "--num-generations", "2"],
}
COMMON = ["--total-steps", "2", "--micro-batch-size", "4", "--sample-every", "1"]
COMMON += ["--eval-every", "2", "--eval-size", "20"]


@dataclass
class Args:
    script: Literal["ppo_llm.py", "grpo_llm.py"] = "ppo_llm.py"
    """the script to launch"""
    launches: int = 100
    """how many launches, one after another"""
    root: str = ROOT
    """the repository whose script runs and whose benchmarks/results/ gets the JSON"""
    timeout: float = 600
    """seconds before a launch is stopped (counted as exit code "timeout")"""
    tail_chars: int = 3000
    """how much of the end of a failed launch's stderr is kept"""
    table: bool = False
    """measure nothing: the table from --root's benchmarks/results/torchrun_stress_<script>.json"""


def launch(args, torchrun):
    """One torchrun launch in a fresh output directory: (exit code or "timeout", seconds, stderr, policy saved)."""
    out = tempfile.mkdtemp(prefix="torchrun_stress_")
    command = [torchrun, "--standalone", "--nproc_per_node", "2", args.script, *SETTINGS[args.script], *COMMON,
               "--output-dir", out]  # fmt: skip
    start = time.perf_counter()
    with subprocess.Popen(command, cwd=args.root, env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as p:  # fmt: skip
        try:
            _, stderr = p.communicate(timeout=args.timeout)
            code = p.returncode
        except subprocess.TimeoutExpired:
            p.terminate()  # SIGTERM: torchrun stops its ranks (each in a session of its own, out of reach of a kill)
            code, stderr = "timeout", p.communicate()[1]
    seconds = time.perf_counter() - start
    saved = bool(glob.glob(os.path.join(out, "*", "policy", "*.safetensors")))
    shutil.rmtree(out, ignore_errors=True)
    return code, seconds, stderr, saved


def main():
    args = tyro.cli(Args)
    args.root = os.path.abspath(args.root)
    path = os.path.join(args.root, "benchmarks", "results", f"torchrun_stress_{args.script.removesuffix('.py')}.json")
    if args.table:
        return print(table(saved_results(path)[0], os.path.dirname(path)))
    if not os.path.isfile(os.path.join(args.root, args.script)):
        raise SystemExit(f"error: no {args.script} in --root {args.root}")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    load_before = os.getloadavg()
    launches, failures = [], []
    for i in range(args.launches):
        code, seconds, stderr, saved = launch(args, torchrun)
        launches.append({"exit_code": code, "seconds": round(seconds, 2)})
        if code != 0:
            tail = stderr[-args.tail_chars :]
            failures.append({"launch": i, "exit_code": code, "policy_saved": saved, "stderr_tail": tail})
        print(f"launch {i + 1}/{args.launches}: exit code {code}  {seconds:.1f}s", flush=True)
    counts = collections.Counter(str(run["exit_code"]) for run in launches)
    aborts = sum("terminate called without an active exception" in f["stderr_tail"] for f in failures)
    result = {
        "script": args.script,
        "command": f"torchrun --standalone --nproc_per_node 2 {args.script} {' '.join(SETTINGS[args.script] + COMMON)}",
        "launches": len(launches),
        "exit_codes": dict(counts),
        "failures": len(failures),
        "failures_terminate_without_active_exception": aborts,
        "failures_after_the_policy_was_saved": sum(f["policy_saved"] for f in failures),
        "mean_seconds": round(sum(run["seconds"] for run in launches) / len(launches), 2),
        "machine": machine_name("cpu"),
        "load_average_before_after": [load_before, os.getloadavg()],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": asdict(args),
        "per_launch": launches,
        "failed_launches": failures,
    }
    os.makedirs(os.path.join(args.root, "benchmarks", "results"), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"\n{args.script}: {len(failures)} of {len(launches)} launches failed ({aborts} with 'terminate called "
        f"without an active exception'); exit codes {dict(counts)}; {result['machine']}, torch {torch.__version__}"
    )
    print(f"wrote {path}")
    print(table(result, os.path.join(args.root, "benchmarks", "results")))


def table(result, results_dir):
    """torchrun_stress_<script>.md from a result (into the docs through write_table)."""
    script, (load_before, _) = result["script"], result["load_average_before_after"]
    text = "\n".join([
        f"`python benchmarks/torchrun_stress.py --script {script} --launches {result['launches']}` "
        f"({result['machine']}, torch {result['torch']}, load average {load_before[0]:.1f} before): "
        f"`{result['command']}`, one launch after another", "",
        "| launches | exit code 0 | failed | of which aborted at exit | mean seconds |", "|---|---|---|---|---|",
        f"| {result['launches']} | {result['exit_codes'].get('0', 0)} | {result['failures']} | "
        f"{result['failures_terminate_without_active_exception']} | {result['mean_seconds']:.1f} |",
    ])  # fmt: skip
    write_table(f"torchrun_stress_{script.removesuffix('.py')}.md", text, results_dir)
    return text


if __name__ == "__main__":
    main()
