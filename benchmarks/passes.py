"""What two of the scripts' passes hold at a real model's shape, each measured both ways in a fresh process:

1. One no-grad forward (old log-probs, values, the reference) at Qwen2-0.5B's depth: 24 layers of width 256, 16
   sequences of 1,016 tokens, random weights. The scripts' hidden_states() keeps only the trunk's output (a hook);
   output_hidden_states=True, the naive way, keeps all 25 layers' states until the forward returns.
2. The LM head trained in bf16 (FSDP's bf16 gather under --mixed-precision bf16) at Qwen2-0.5B's head: V = 151,936,
   H = 896, 1,024 tokens, forward and backward of lm_head_logprobs: the head cast to fp32 once, as the scripts do,
   against once a chunk, in its forward and again in its backward (each 110-token chunk a call of its own under
   torch.utils.checkpoint, which is how the scripts cast it before).

Peak memory is the process's peak resident set over the one before the pass, the peak reset first (Linux's
/proc/self/clear_refs), glibc's mmap threshold fixed at 128 KiB (freed blocks go back to the system); on a GPU,
max_memory_allocated over memory_allocated. Seconds: the median of 3 after a warm-up.

    python benchmarks/passes.py           # benchmarks/results/passes_<device>.json and .md, and into docs/scaling.md
    python benchmarks/passes.py --table   # measure nothing: passes_<device>.md from passes_<device>.json
"""

import json
import os
import subprocess
import sys
import time
import types
from dataclasses import dataclass

import torch
import tyro
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
MEASUREMENTS = {  # name: (pass, how)
    "forward, every layer's states": ("forward", "output_hidden_states"),
    "forward, the trunk's output": ("forward", "hidden_states"),
    "bf16 head, cast once a chunk": ("head", "per chunk"),
    "bf16 head, cast once": ("head", "once"),
}


@dataclass
class Args:
    table: bool = False
    """measure nothing: passes_<device>.md from passes_<device>.json"""
    child: str | None = None
    """internal: one measurement in this process, printed as JSON"""


def resident_mb(field):
    """VmRSS or VmHWM (the peak) of this process, MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**10


def measured(fn, device):
    """(peak MiB of fn() over the memory before it, its median seconds over 3 calls after one warm-up)."""
    fn()
    seconds = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM back to the current resident set
            before = resident_mb("VmRSS")
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated() - before) / 2**20, sorted(seconds)[1]
    return resident_mb("VmHWM") - before, sorted(seconds)[1]


def child(name):
    import transformers

    import ppo_llm

    kind, how = MEASUREMENTS[name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if kind == "forward":
        config = transformers.Qwen2Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=24,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                          max_position_embeddings=1024)  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config).to(device).eval()
        ids = torch.randint(4096, (16, 1016), device=device)
        mask = torch.ones_like(ids)

        @torch.no_grad()
        def fn():
            if how == "hidden_states":
                return ppo_llm.hidden_states(model, ids, mask, 16)
            inputs = dict(input_ids=ids, attention_mask=mask, position_ids=ppo_llm.position_ids(mask), use_cache=False)
            return model(**inputs, output_hidden_states=True, logits_to_keep=1).hidden_states[-1][:, 15:-1]

    else:
        head = torch.nn.Linear(896, 151936, bias=False, device=device, dtype=torch.bfloat16)
        model = types.SimpleNamespace(config=types.SimpleNamespace(), get_output_embeddings=lambda: head)  # an LM's
        hidden = torch.randn(1, 1024, 896, device=device, requires_grad=True)
        labels = torch.randint(151936, (1, 1024), device=device)
        n = ppo_llm.LM_HEAD_CHUNK // 151936  # tokens a chunk

        def fn():
            head.weight.grad = hidden.grad = None
            if how == "once":
                logprobs, _ = ppo_llm.lm_head_logprobs(hidden, model, labels, 1.0)
            else:  # each chunk a call under checkpoint, its cast inside: made again in the backward, as each chunk is

                def chunk(h, y):
                    return ppo_llm.lm_head_logprobs(h, model, y, 1.0)[0]

                chunks = [checkpoint(chunk, hidden[:, i : i + n], labels[:, i : i + n], use_reentrant=False)
                          for i in range(0, 1024, n)]  # fmt: skip
                logprobs = torch.cat(chunks, 1)
            logprobs.sum().backward()

    peak, seconds = measured(fn, device)
    print(json.dumps({"peak_mb": peak, "seconds": seconds}))


def machine(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    return f"{model}, {os.cpu_count()} cores"


def table(saved):
    lines = [
        f"One pass at a real shape, each in a fresh process ({saved['machine']}, torch {saved['torch']}); peak memory "
        "over the memory before it, seconds the median of 3. Command: `python benchmarks/passes.py`",
        "",
        "| pass | kept | peak MiB | seconds |",
        "|---|---|---|---|",
    ]
    labels = {
        "forward": "no-grad forward, Qwen2 depth (24 layers x 256), 16 x 1,016 tokens",
        "head": "bf16 LM head trained, V 151,936 x H 896, 1,024 tokens, forward + backward",
    }
    for name, result in saved["results"].items():
        kind, what = labels[MEASUREMENTS[name][0]], name.split(", ", 1)[1]
        lines.append(f"| {kind} | {what} | {result['peak_mb']:.0f} | {result['seconds']:.2f} |")
    return "\n".join(lines)


def main():
    args = tyro.cli(Args)
    if args.child:
        return child(args.child)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.table:
        for saved in saved_results(os.path.join(RESULTS, "passes_*.json")):
            write_table(f"passes_{saved['device']}.md", table(saved), results_dir=RESULTS)
        return
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072"}
    results = {}
    for name in MEASUREMENTS:
        done = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"error: {name}: {done.stderr.strip().splitlines()[-1]}")
        results[name] = json.loads(done.stdout.splitlines()[-1])
        print(name, results[name], flush=True)
    saved = {"device": device, "machine": machine(device), "torch": torch.__version__, "results": results}
    with open(os.path.join(RESULTS, f"passes_{device}.json"), "w") as f:
        json.dump(saved, f, indent=1)
    write_table(f"passes_{device}.md", table(saved), results_dir=RESULTS)
    print(table(saved))


if __name__ == "__main__":
    main()
