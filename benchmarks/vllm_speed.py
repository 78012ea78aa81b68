"""--vllm against generate(): benchmarks/scale.py's gpt2-grpo and gpt2-ppo configurations (GPT-2-124M's shape, random
weights, responses that run to --max-new-tokens), each with and without --vllm, side by side in one run. Run it in
the vLLM venv (README), where both legs use the same transformers:

    .venv-vllm/bin/python benchmarks/vllm_speed.py [--updates 3]
    python benchmarks/vllm_speed.py --table      # measure nothing: the table from vllm_cpu.json

Results: benchmarks/results/vllm_cpu.json and vllm_cpu.md (docs/scaling.md quotes it); seconds are medians over the
updates after the first (which warms up, the engine's first steps included); the engine's start is not in an update."""

import json
import os
import sys

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale  # noqa: E402
from docs_tables import saved_results, write_table  # noqa: E402

RESULTS = scale.RESULTS


def measure(updates: int = 3, runs: tuple[str, ...] = ("gpt2-grpo", "gpt2-ppo"), table: bool = False):
    """updates: per run, the first warm-up; runs: scale.py's CONFIGS; table: only the table, from vllm_cpu.json."""
    path = os.path.join(RESULTS, "vllm_cpu.json")
    if table:
        write(saved_results(path)[0])
        return
    rows = []
    for name in runs:
        shape, script, prompts, gens, new, micro, extra = scale.CONFIGS[name]
        for vllm in [False, True]:
            scale.CONFIGS[name] = (shape, script, prompts, gens, new, micro, extra + ["--vllm"] * vllm)
            result = scale.ours(name, updates)
            rows.append({"config": name, "vllm": vllm} | result)
            print(json.dumps(rows[-1]), flush=True)
    saved = {"machine": scale.machine_name("cpu"), "updates": updates, "rows": rows}
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    write(saved)


def write(saved):
    rows, runs = saved["rows"], list(dict.fromkeys(r["config"] for r in saved["rows"]))
    command = f".venv-vllm/bin/python benchmarks/vllm_speed.py --updates {saved['updates']}"
    lines = [f"Machine: {saved['machine']}, fp32. Command: `{command}`; medians after the first update.",
             "", "| config | sampled by | s/update | generation | scoring | training | tokens/s | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        how = "vLLM" if r["vllm"] else "generate()"
        times = [r["s/update"], r["time/generation"], r["time/scoring"], r["time/update"], r["perf/tokens_per_sec"]]
        peak = r["perf/peak_memory_mb"] / 1024
        lines.append(f"| {r['config']} | {how} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {peak:.2f} |")
    for name in runs:
        base, fast = [r for r in rows if r["config"] == name]
        lines.append(f"\n{name}: generation {fast['time/generation'] / base['time/generation']:.2f}x, "
                     f"s/update {fast['s/update'] / base['s/update']:.2f}x with --vllm")  # fmt: skip
    write_table("vllm_cpu.md", "\n".join(lines))


def main():
    tyro.cli(measure)


if __name__ == "__main__":
    main()
