"""FSDP2 sharding of the LLM scripts under torchrun: per-rank bytes of parameters, gradients and AdamW state, per-rank
peak memory and seconds per update, against the number of processes.

    python benchmarks/sharding.py                         # 1, 2 and 4 gloo processes on this CPU
    python benchmarks/sharding.py --nproc 1 2 4 8         # on a machine with 8 GPUs (NCCL)
    python benchmarks/sharding.py --no-run                # the table from benchmarks/results/sharding_<device>.json

The model is a Llama of 34M parameters whose weights dominate (8 layers of d 512, an untied head; benchmarks/scale.py
builds it from its config with random weights). PPO trains a policy and a separate critic beside a frozen reference
and a reward model; GRPO at beta 0.04 a policy beside a reference. Each configuration runs as one torchrun launch of
--updates updates; a wrapper around the script's own optimizer_step counts, on every rank after its first step, the
bytes of the rank's shards of every model's parameters, of the gradients and of AdamW's state. Peak memory is the
rank's peak RSS on a CPU (max_memory_allocated on a GPU), seconds the median of time/generation + time/scoring +
time/update over the updates after the first. Writes benchmarks/results/sharding_<device>.json and the table
sharding_<device>.md, which goes into docs/scaling.md (benchmarks/docs_tables.py).
"""

import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from docs_tables import write_table  # noqa: E402
from scale import build, machine_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name: the script and its flags beside the model's
    "ppo": ["ppo_llm.py", "--prompts-per-update", "8", "--num-mini-batches", "1", "--reward-model", "RM"],
    "grpo": ["grpo_llm.py", "--prompts-per-update", "4", "--num-generations", "2", "--beta", "0.04"],
}


@dataclass
class Args:
    nproc: tuple[int, ...] = (1, 2, 4)
    """numbers of processes"""
    configs: tuple[str, ...] = ("ppo", "grpo")
    """configurations (names in CONFIGS)"""
    updates: int = 3
    """updates per launch; the first is warm-up"""
    run: bool = True
    """run the launches (--no-run: only write the table from the result file)"""
    child: str | None = None
    """internal: run the script in this torchrun process (a JSON spec) and write this rank's counts"""


def local_bytes(tensors):
    """Bytes of this rank's shards (a DTensor's local tensor, a plain tensor whole)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def child(spec):
    """One rank of a launch: the script's main() with its loading, optimizer_step and final save wrapped to count this
    rank's bytes and peaks."""
    sys.path.insert(0, ROOT)
    script = __import__(spec["script"].removesuffix(".py"))
    models, counts = [], {}
    load_models, place, frozen_copy, prepare = script.load_models, script.place, script.frozen_copy, script.prepare
    optimizer_step, save_checkpoint = script.optimizer_step, script.save_checkpoint

    def counting_load(*args):  # the process before any model: Python, torch, transformers, the tokenizer
        counts["before_loading_mb"] = current_mb()
        return load_models(*args)

    def counting_place(model, *args):
        counts["largest_unit_mb"] = max(counts.get("largest_unit_mb", 0), largest_unit(model) / 2**20)
        models.append(place(model, *args))
        return models[-1]

    def counting_copy(*args):
        models.append(frozen_copy(*args))
        return models[-1]

    def counting_prepare(*args):  # every model loaded and placed
        counts["loading_peak_mb"], counts["loaded_rss_mb"] = peak_mb(), current_mb()
        counts["loaded_mb"] = local_bytes({id(p): p for m in models for p in m.parameters()}.values()) / 2**20
        reset_peak()
        return prepare(*args)

    def counting_save(*args, **kwargs):  # the final save
        counts["training_peak_mb"] = peak_mb()
        reset_peak()
        save_checkpoint(*args, **kwargs)
        counts["saving_peak_mb"] = peak_mb()

    def counting_step(optimizer, params, max_grad_norm):
        grads = local_bytes(p.grad for p in params if p.grad is not None)
        norm = optimizer_step(optimizer, params, max_grad_norm)
        if "params" not in counts:
            weights = {id(p): p for m in models for p in m.parameters()}.values()  # a LoRA reference is the policy
            state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
            counts.update(params=local_bytes(weights), grads=grads, optimizer=local_bytes(state))
        return norm

    script.load_models, script.place, script.frozen_copy, script.prepare = (
        counting_load,
        counting_place,
        counting_copy,
        counting_prepare,
    )
    script.optimizer_step, script.save_checkpoint = counting_step, counting_save
    rank = int(os.environ.get("RANK", 0))
    script.main(script.parse_args(spec["argv"]))
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(counts, f)


def largest_unit(model):
    """Bytes of the largest FSDP unit of a model as it is loaded: a transformer block, or the rest (the root)."""
    blocks = getattr(model, "_no_split_modules", None) or ()
    units = [m for m in model.modules() if type(m).__name__ in blocks]
    in_blocks = sum(p.nbytes for m in units for p in m.parameters())
    return max(
        [sum(p.nbytes for p in m.parameters()) for m in units] + [sum(p.nbytes for p in model.parameters()) - in_blocks]
    )


def current_mb():
    """This process's memory now: allocated on a GPU, the RSS on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**10


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: the peak RSS (VmHWM) starts again from the current RSS


def peak_mb():
    """This process's peak memory so far: max_memory_allocated on a GPU, the peak RSS (VmHWM) on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**10


def launch(name, n, updates):
    """One torchrun launch of a configuration on n processes: each rank's counts and the seconds per update."""
    model = build("llama-34m")
    script, *flags = CONFIGS[name]
    with tempfile.TemporaryDirectory() as out:
        argv = ["--model", model, "--dataset", f"{model}/prompts.jsonl", "--max-new-tokens", "16", "--output-dir", out]
        argv += ["--total-steps", str(updates), "--micro-batch-size", "4", "--eval-every", "0", "--sample-every", "0"]
        argv += ["--save-every", "0"] + [f"{model}/rm" if x == "RM" else x for x in flags]
        spec = json.dumps({"script": script, "argv": argv, "out": out})
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        command = [torchrun, "--standalone", "--nproc_per_node", str(n), __file__, "--child", spec]
        # a fixed mmap threshold: glibc's dynamic one keeps freed blocks of up to 32 MiB (an all-gathered layer) in its
        # heap, which the RSS would count as live; every block over 128 KiB goes back when freed
        env = os.environ | {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, env=env)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(n)]
        (path,) = glob.glob(os.path.join(out, "*", "metrics.jsonl"))
        metrics = [json.loads(line) for line in open(path)][1:]
    seconds = statistics.median(m["time/generation"] + m["time/scoring"] + m["time/update"] for m in metrics)
    return {"ranks": ranks, "s_per_update": seconds}


def table(results, device):
    """The markdown table: per configuration and N, the largest rank's bytes, their share of one process's, each phase's
    peak memory, the worst rank's whole-process peak against one process's, what a rank other than 0 holds for a while
    as it loads, and seconds."""
    backend = "NCCL" if device == "cuda" else "gloo"
    caption = (
        f"Machine: {results['machine']}, {backend}, torch {results['torch']}. Command: `{results['command']}`; "
        f"{results['updates']} updates a launch, seconds the median after the first. State = parameters of every "
        "model + gradients + AdamW, the largest rank's; share = state / (the one-process state / N), 1.00 being a "
        "perfect split. Peak memory of the largest rank while loading (rank 0 reads each checkpoint and sends each "
        "rank its shards), training, and saving at the end (each rank writes its own shards; policy/ is gathered into "
        "rank 0 a model at a time): max_memory_allocated on a GPU, the RSS on a CPU (glibc's mmap threshold fixed at "
        "128 KiB). Worst: the largest whole-process peak of any rank, against one process's. Loading, rank > 0: the "
        "most such a rank held for a while as it loaded (its peak over its memory once loaded), against the largest "
        "FSDP unit (a block, or the root: embeddings, final norm, head)."
    )
    header = "| script | N | parameters MiB | gradients MiB | AdamW MiB | state share | peak MiB: loading | training "
    header += "| saving | worst | loading, rank > 0: transient MiB / unit MiB | s/update |"
    lines = [caption, "", header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        runs = {int(n): r for n, r in results["runs"].get(name, {}).items()}
        if 1 not in runs:
            continue
        one = max(sum(r[k] for k in ("params", "grads", "optimizer")) for r in runs[1]["ranks"])
        one_peak = max(x[f"{k}_peak_mb"] for x in runs[1]["ranks"] for k in ("loading", "training", "saving"))
        for n, r in sorted(runs.items()):
            top = max(r["ranks"], key=lambda x: x["params"] + x["grads"] + x["optimizer"])
            share = (top["params"] + top["grads"] + top["optimizer"]) / (one / n)
            mib = [top[k] / 2**20 for k in ("params", "grads", "optimizer")]
            peaks = [max(x[f"{k}_peak_mb"] for x in r["ranks"]) for k in ("loading", "training", "saving")]
            worst = f"{max(peaks) / one_peak:.2f}x"
            transient = "-"
            if n > 1:
                others = r["ranks"][1:]
                held = max(x["loading_peak_mb"] - x["loaded_rss_mb"] for x in others)
                transient = f"{held:.0f} / {max(x['largest_unit_mb'] for x in others):.0f}"
            cells = [CONFIGS[name][0], n, f"{mib[0]:.1f}", f"{mib[1]:.1f}", f"{mib[2]:.1f}", f"{share:.2f}"]
            cells += [f"{p:.0f}" for p in peaks] + [worst, transient, f"{r['s_per_update']:.2f}"]
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def estimate():
    """Paper estimates for docs/scaling.md: the host memory of one 8-GPU node while a PPO run loads and saves (policy
    and critic trained, reference and reward model frozen, all fp32), with every rank reading every model whole and
    rank 0 gathering the trained state to save (as the scripts did before) and as they do now; and the largest model
    that trains on 8 GPUs of 80 GB with the policy gathered for generation in fp32 or bf16."""
    rows = ["| run | P | loading: before | now | saving: before | now |", "|---|---|---|---|---|---|"]
    for label, params in [("7B", 7e9), ("70B", 70e9)]:
        before_loading = 8 * 4 * 4 * params  # 8 ranks, 4 models, 4 bytes a parameter, all read before any is sharded
        now_loading = 4 * params  # rank 0, one model at a time; the others build it on the meta device
        before_saving = (
            2 * 16 * params
        )  # rank 0: weights, AdamW's two moments and policy/'s copy of both trained models
        now_saving = 4 * params  # each rank writes its own shards; rank 0 gathers policy/ a model at a time
        cells = [before_loading, now_loading, before_saving, now_saving]
        rows.append(
            f"| PPO, separate critic, reward model | {label} | "
            + " | ".join(f"{x / 1e9:,.0f} GB" for x in cells)
            + " |"
        )
    caption = (
        "Host memory of one node of 8 GPUs, on paper (`python benchmarks/sharding.py --no-run`): the most held at once "
        "while the run loads its four models, and while it saves."
    )
    largest = [
        "| run | T, F | bytes a parameter at N = 8: fp32 gather | bf16 gather | largest P: fp32 gather | bf16 gather |"
    ]
    largest.append("|---|---|---|---|---|---|")
    for run, trained, frozen in [
        ("PPO, separate critic, reward model", 2, 2),
        ("PPO, `--critic head`, reward model", 1, 2),
        ("GRPO, β > 0 (a reference)", 1, 1),
        ("GRPO, β = 0 (TRL's default)", 1, 0),
    ]:
        per_param = [(16 * trained + 4 * frozen) / 8 + gathered for gathered in (4, 2)]
        params = [70e9 / b for b in per_param]  # 80 GB less 10 GB for activations and the KV cache
        cells = [f"{b:g}" for b in per_param] + [f"{p / 1e9:.1f}B" for p in params]
        largest.append(f"| {run} | {trained}, {frozen} | " + " | ".join(cells) + " |")
    return caption + "\n\n" + "\n".join(rows), "\n".join(largest)


def main():
    args = tyro.cli(Args)
    if args.child:
        return child(json.loads(args.child))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = os.path.join(ROOT, "benchmarks", "results", f"sharding_{device}.json")
    if not args.run:
        if not os.path.exists(path):
            raise SystemExit(f"error: {os.path.relpath(path, ROOT)} does not exist: run python benchmarks/sharding.py")
        results = json.load(open(path))
    else:
        command = " ".join(["python benchmarks/sharding.py", *sys.argv[1:]])
        results = {"machine": machine_name(device), "torch": torch.__version__, "command": command}
        results |= {"updates": args.updates, "runs": {}}
        for name in args.configs:
            for n in args.nproc:
                print(f"{name} on {n} processes ...", flush=True)
                results["runs"].setdefault(name, {})[str(n)] = launch(name, n, args.updates)
                with open(path, "w") as f:
                    json.dump(results, f, indent=1)
    markdown = table(results, device)
    write_table(f"sharding_{device}.md", markdown)
    print(markdown)
    host, largest = estimate()
    write_table("sharding_host_estimate.md", host)
    write_table("sharding_largest_estimate.md", largest)


if __name__ == "__main__":
    main()
