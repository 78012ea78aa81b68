"""Time per update of ppo_llm.py and grpo_llm.py against the floor: a bare `generate` of the same batch.

Each script runs in this process for --warmup + --updates updates (no eval, no samples); the time of an
update is split into generation / scoring (reference, reward, values) / optimisation from the scripts'
own metrics, and divided by the time of a bare policy.generate of a batch of the same size and response
length, measured here with the same model, machine and thread count, in the same run. Results go to
benchmarks/results/llm_speed_<model>_<device>.md and .json; the table also into the docs pages that quote it
(benchmarks/docs_tables.py).

    python benchmarks/llm_speed.py                        # embedded default (CPU)
    python benchmarks/llm_speed.py --gpt2-shape           # GPT-2-124M shape built from its config, random weights
    python benchmarks/llm_speed.py --table                # measure nothing: each .md from its .json

--table without a .json says so and writes nothing.
"""

import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo_llm  # noqa: E402
import ppo_llm  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402
from scale import machine_name  # noqa: E402


@dataclass
class Args:
    gpt2_shape: bool = False
    """benchmark a GPT-2-124M-shaped model built from its config (random weights, no download) instead of
    the embedded default; responses then run to --max-new-tokens (EOS is 1 token in 50257)"""
    batch_size: int | None = None
    """sequences (responses) per update; default: each script's own default"""
    max_new_tokens: int = 8
    """response length limit"""
    micro_batch_size: int | None = None
    """sequences per forward pass; default: each script's own default"""
    updates: int = 5
    """timed updates per script"""
    warmup: int = 2
    """untimed updates first"""
    cuda: bool = True
    """use the GPU when there is one (bf16 autocast, as the scripts do)"""
    out_dir: str = os.path.join(ROOT, "benchmarks", "results")
    """where the markdown and JSON results go"""
    table: bool = False
    """measure nothing: each llm_speed_<model>_<device>.md from its .json in --out-dir"""


def gpt2_shaped_model(path):
    """GPT-2-124M (12 layers, 768 wide, 50257 tokens) with random weights, and a 50257-token tokenizer whose
    first ids are characters so that the arithmetic prompts still encode."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    tokens = specials + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(tokens + [f"<{i}>" for i in range(50257 - len(tokens))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def bare_generate_seconds(model_path, batch_size, args, device, n):
    """Median seconds of one policy.generate of `batch_size` arithmetic prompts (after one warm-up call)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model_path).to(device).eval()
    policy.generation_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, top_k=0, top_p=1.0,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    with open(os.path.join(ROOT, "assets", "arith", "train.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    rng = random.Random(0)
    times = []
    for _ in range(n + 1):
        enc = tokenizer(rng.sample(prompts, batch_size), padding=True, return_tensors="pt")
        enc = enc.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            policy.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return sorted(times[1:])[n // 2]


def run_script(module, model_path, args, extra):
    """Per-update times (medians over the timed updates) from a short run of the script's main(), and the
    batch and micro-batch sizes it ran with."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    G = getattr(module.Args, "num_generations", 1)  # GRPO: completions per prompt
    sizes = {"prompts_per_update": args.batch_size // G} if args.batch_size else {}
    sizes |= {"micro_batch_size": args.micro_batch_size} if args.micro_batch_size else {}
    with tempfile.TemporaryDirectory() as out:
        common = dict(model=model_path, total_steps=args.warmup + args.updates, max_new_tokens=args.max_new_tokens,
                      eval_every=0, sample_every=0, output_dir=out, cuda=args.cuda)  # fmt: skip
        script_args = module.Args(**common, **sizes, **extra)
        run_dir = module.main(script_args)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f][args.warmup :]
    keys = ["time/generation", "time/scoring", "time/update", "perf/tokens_per_sec", "perf/peak_memory_mb"]
    result = {k: sorted(m[k] for m in metrics)[len(metrics) // 2] for k in keys}
    totals = sorted(m["time/generation"] + m["time/scoring"] + m["time/update"] for m in metrics)
    result["time/total"] = totals[len(totals) // 2]
    result["batch_size"], result["micro_batch_size"] = script_args.prompts_per_update * G, script_args.micro_batch_size
    return result


def main():
    args = tyro.cli(Args)
    if args.table:
        for result in saved_results(os.path.join(args.out_dir, "llm_speed_*.json")):
            print(table(result, args.out_dir))
        return
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = gpt2_shaped_model(tmp) if args.gpt2_shape else os.path.join(ROOT, "assets", "arith-sft")
        runs = {
            "PPO (separate critic)": (ppo_llm, dict(critic="separate")),
            "PPO (shared value head)": (ppo_llm, dict(critic="head")),
            "GRPO (beta 0, mu 1)": (grpo_llm, dict(beta=0.0, num_iterations=1)),
        }
        results = {name: run_script(module, model_path, args, extra) for name, (module, extra) in runs.items()}
        floors = {b: bare_generate_seconds(model_path, b, args, device, args.updates)
                  for b in {r["batch_size"] for r in results.values()}}  # fmt: skip
    flags = sys.argv[1:]
    if "--out-dir" in flags:  # where the results went is no part of the command that measures them
        at = flags.index("--out-dir")
        flags = flags[:at] + flags[at + 2 :]
    result = {
        "name": "gpt2-124m-shape" if args.gpt2_shape else "arith-sft",
        "device": device.type,
        "machine": f"{machine_name(device.type)}, torch threads {torch.get_num_threads()}",
        "command": " ".join(["python benchmarks/llm_speed.py", *flags]),
        "platform": platform.platform(),
        "bare_generate_s": {str(b): seconds for b, seconds in floors.items()},
        "args": vars(args),
        "results": results,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"llm_speed_{result['name']}_{device.type}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result, args.out_dir))


def table(result, out_dir):
    """llm_speed_<model>_<device>.md from a result (into the docs through write_table)."""
    args = result["args"]
    autocast = "bf16 autocast on " if result["device"] == "cuda" else ""
    lines = [
        f"Model {result['name']}, up to {args['max_new_tokens']} new tokens, {autocast}{result['machine']}. Medians "
        f"over {args['updates']} updates after {args['warmup']} of warm-up.",
        "",
        "| script | batch / micro-batch | generation | scoring | optimisation | total | bare generate | total / bare "
        "generate | tokens/s | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, r in result["results"].items():
        floor = result["bare_generate_s"][str(r["batch_size"])]
        ms = [r[k] * 1000 for k in ["time/generation", "time/scoring", "time/update", "time/total"]]
        lines.append(
            f"| {run} | {r['batch_size']} / {r['micro_batch_size']} | {ms[0]:.0f} ms | {ms[1]:.0f} ms | {ms[2]:.0f} ms "
            f"| {ms[3]:.0f} ms | {floor * 1000:.0f} ms | {r['time/total'] / floor:.2f}x | "
            f"{r['perf/tokens_per_sec']:.0f} | {r['perf/peak_memory_mb']:.0f} |"
        )
    text = f"Command: `{result['command']}` ({result['platform']})\n\n" + "\n".join(lines)
    write_table(f"llm_speed_{result['name']}_{result['device']}.md", text, out_dir)
    return text


if __name__ == "__main__":
    main()
