"""--vllm against generate(): benchmarks/scale.py's gpt2-grpo and gpt2-ppo configurations (GPT-2-124M's shape, random
weights, responses that run to --max-new-tokens), each with and without --vllm, side by side in one run, and the time
of one push of the policy's weights into the engine. Run it in the vLLM venv (README), where both legs use the same
transformers; on a GPU (benchmarks/gpu.py's last part) the runs are the scripts' defaults there, bf16 autocast:

    .venv-vllm/bin/python benchmarks/vllm_speed.py [--updates 3]
    python benchmarks/vllm_speed.py --table      # measure nothing: the tables from vllm_<device>.json

Results: vllm_<device>.json and vllm_<device>.md in --out-dir (benchmarks/results/; docs/scaling.md quotes them);
seconds are medians over the updates after the first (which warms up, the engine's first steps included), the
engine's start is not in an update; the log-prob differences are the largest any update logged. The load average
of the machine is taken before each leg: on shared cores it says how far the seconds can be trusted."""

import json
import os
import subprocess
import sys

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402
from docs_tables import saved_results, write_table  # noqa: E402

PUSH = """import statistics, sys, time, torch
sys.path.insert(0, sys.argv[1])
import {script}_llm as script
args = script.Args(model=sys.argv[2], vllm=True, max_new_tokens={new}, max_prompt_length={prompt})
policy = script.load_models(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))[1]
script.prepare(args, [policy])
script.start_vllm(args, policy, args.max_prompt_length)
seconds = []
for _ in range(int(sys.argv[3])):
    script.PUSHED.clear()  # as an optimizer step does: the weights pushed again
    start = time.perf_counter()
    with script.vllm_pushed(policy):
        seconds.append(time.perf_counter() - start)
print(statistics.median(seconds))"""


def push_seconds(script, path, pushes, new):
    """The median seconds of `pushes` pushes of the model at path into an engine (vllm_pushed), in a process of its
    own: the time the rollout spends before its first token."""
    code = PUSH.format(script=script, new=new, prompt=scale.PROMPT_TOKENS)
    done = subprocess.run([scale.PY, "-c", code, scale.ROOT, path, str(pushes)], check=True, capture_output=True)
    return float(done.stdout.split()[-1])


def measure(
    updates: int = 3,
    runs: tuple[str, ...] = ("gpt2-grpo", "gpt2-ppo"),
    table: bool = False,
    out_dir: str = scale.RESULTS,
    pushes: int = 3,
):
    """updates: per run, the first warm-up; runs: scale.py's CONFIGS (the result file's rows of the others are kept);
    table: only the tables, from vllm_cpu.json and vllm_cuda.json; pushes: timed pushes of the weights for each run's
    model."""
    if table:
        for saved in saved_results(os.path.join(out_dir, "vllm_c*.json")):  # vllm_cpu, vllm_cuda
            write(saved, out_dir)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path, rows = os.path.join(out_dir, f"vllm_{device}.json"), []
    for name in runs:
        shape, script, prompts, gens, new, micro, extra = scale.CONFIGS[name]
        for vllm in [False, True]:
            scale.CONFIGS[name] = (shape, script, prompts, gens, new, micro, extra + ["--vllm"] * vllm)
            load = os.getloadavg()[0]
            rows.append({"config": name, "vllm": vllm, "load": load} | scale.ours(name, updates))
            if vllm:
                rows[-1]["time/push"] = push_seconds(script, scale.build(shape), pushes, new)
            print(json.dumps(rows[-1]), flush=True)
    machine, kept = scale.machine_name(device), []
    for row in rows:
        row |= {"machine": machine, "updates": updates}
    if os.path.exists(path):  # the rows of the configs not run this time, each with its machine and --updates
        old = saved_results(path)[0]
        kept = [
            {"machine": old["machine"], "updates": old["updates"]} | r for r in old["rows"] if r["config"] not in runs
        ]
    dtype = "bf16 autocast" if device == "cuda" else "fp32"
    saved = {"machine": machine, "device": device, "dtype": dtype, "updates": updates, "rows": kept + rows}
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    write(saved, out_dir)


def write(saved, out_dir):
    rows, runs = saved["rows"], list(dict.fromkeys(r["config"] for r in saved["rows"]))
    command = f".venv-vllm/bin/python benchmarks/vllm_speed.py --updates {saved['updates']}"
    lines = [f"Machine: {saved['machine']}, {saved['dtype']}. Command: `{command}`; medians after the first update.",
             "", "| config | sampled by | load | s/update | generation | push | scoring | training | tokens/s | "
             "peak GiB | log-prob diff max | mean |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        how = "vLLM" if r["vllm"] else "generate()"
        times = [r["s/update"], r["time/generation"], r.get("time/push"), r["time/scoring"], r["time/update"]]
        cells = [f"{t:.2f}" if t is not None else "" for t in times + [r["perf/tokens_per_sec"]]]
        cells.append(f"{r['perf/peak_memory_mb'] / 1024:.2f}")
        cells += [f"{r[k]:.1e}" if k in r else "" for k in ["vllm/logprob_diff_max", "vllm/logprob_diff_mean"]]
        lines.append(f"| {r['config']} | {how} | {r.get('load', float('nan')):.1f} | " + " | ".join(cells) + " |")
    for name in runs:
        base, fast = [r for r in rows if r["config"] == name]
        lines.append(f"\n{name}: generation {fast['time/generation'] / base['time/generation']:.2f}x, "
                     f"s/update {fast['s/update'] / base['s/update']:.2f}x with --vllm")  # fmt: skip
    lines.append("\nThe push is part of the generation column; the load is the 1-minute load average before each leg.")
    for name in runs:  # a config kept from an earlier run
        r = [r for r in rows if r["config"] == name][0]
        if (r.get("machine", saved["machine"]), r.get("updates", saved["updates"])) != (
            saved["machine"],
            saved["updates"],
        ):
            lines.append(f"{name}: an earlier run's, on {r['machine']}, --updates {r['updates']}.")
    write_table(f"vllm_{saved.get('device', 'cpu')}.md", "\n".join(lines), out_dir)


def main():
    tyro.cli(measure)


if __name__ == "__main__":
    main()
