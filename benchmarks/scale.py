"""ppo_llm.py and grpo_llm.py at realistic sizes: s/update split into generation / scoring / training, tokens/s
and peak memory, beside TRL at the same configuration, plus the LM head's memory and a memory estimate.

Models are built from their configs with random weights (no download) into benchmarks/runs/scale_models/, with a
tokenizer of one token per character padded with filler tokens to the vocabulary; EOS is 1 token in 50k+, so
responses run to --max-new-tokens. The reward is the arithmetic reward function (all zeros on this text: timing
only) or a random-init reward model. Each run is a subprocess; the first of --updates is warm-up. TRL runs when
its directory exists (TRL 1.12 for PPO, `trl.experimental.ppo`; current TRL for GRPO), installed beside the
shared venv:

    pip install --no-deps --target benchmarks/runs/trl112 trl==1.12.0 accelerate psutil
    pip install --no-deps --target benchmarks/runs/trl116 trl==1.16.0 accelerate psutil
    python benchmarks/scale.py                       # every config, the head benchmark, the estimate
    python benchmarks/scale.py --runs gpt2-ppo --no-head

On a CPU, glibc hands large freed blocks back to the kernel, which hands them back zeroed, page by page, at the
next allocation; PyTorch frees and allocates every activation, gradient and logit chunk each step. To see what
that costs (both scripts, TRL too, inherit the settings; results are kept under "<config>, glibc keeps freed memory"):

    MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=100000000000 python benchmarks/scale.py --runs gpt2-ppo

Results: benchmarks/results/scale_<device>.md (the runs), scale_head_<device>.md (the LM head), scale_estimate.md
(the estimate at the hub commands of README.md and docs/; `--estimate` writes it alone, running nothing) and
scale_<device>.json; each table also goes into the docs pages that quote it (benchmarks/docs_tables.py), unless
--out-dir names another directory. Peak memory is ru_maxrss on CPU, max_memory_allocated on CUDA (what the scripts
log as perf/peak_memory_mb), for TRL too.

    python benchmarks/scale.py --table               # measure nothing: the tables from each scale_<device>.json

--table without a scale_<device>.json says so and writes nothing. The tiny-grpo config and the --head-* flags are toy
sizes, to check in seconds that every path runs (benchmarks/gpu.py --smoke).
"""

import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from docs_tables import saved_results, write_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "benchmarks", "runs")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PY = sys.executable
SHAPES = {  # name: (config class, config kwargs)
    "gpt2-124m": ("GPT2Config", {}),
    "gpt2-qwen-vocab": ("GPT2Config", {"vocab_size": 151936}),
    "qwen2-0.5b": ("Qwen2Config", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                       num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                       tie_word_embeddings=True, max_position_embeddings=4096)),
    # weights-heavy and small enough for 4 CPU processes: 8 layers of d 512, an untied head (benchmarks/sharding.py)
    "llama-34m": ("LlamaConfig", dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=8192,
                                      tie_word_embeddings=False, max_position_embeddings=256)),
    "tiny": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)),  # a toy size
}  # fmt: skip
# name: (shape, script, prompts, generations per prompt, new tokens, micro-batch, our extra flags)
CONFIGS = {
    "gpt2-ppo": ("gpt2-124m", "ppo", 16, 1, 64, 8, ["--reward-model", "RM"]),
    "gpt2-grpo": ("gpt2-124m", "grpo", 4, 4, 64, 16, []),
    "qwen-vocab-ppo": ("gpt2-qwen-vocab", "ppo", 8, 1, 128, 4, ["--reward-model", "RM"]),
    "qwen2-0.5b-ppo": ("qwen2-0.5b", "ppo", 8, 1, 128, 4, ["--critic", "head"]),  # TRL: no value head on the trunk
    "qwen2-0.5b-grpo": ("qwen2-0.5b", "grpo", 2, 4, 128, 8, []),
    "tiny-grpo": ("tiny", "grpo", 2, 2, 4, 4, []),
}
PROMPT_TOKENS = 16
GLIBC_NO_TRIM = "glibc keeps freed memory"  # results of a run under the MALLOC_* settings in the module docstring
# The LM-head benchmark's rows: (implementation, what the loss reads, gradient of, hidden size); each at HEAD_TOKENS.
# The last chunked row halves H: what grows with the head's weight halves with it.
HEAD_ROWS = [
    ("chunked", "no-grad", "", 768),
    ("chunked", "log-probs (entropy logged)", "hidden", 768),
    ("chunked", "log-probs + entropy", "hidden", 768),
    ("chunked", "log-probs (entropy logged)", "hidden+weight", 768),
    ("chunked", "log-probs + entropy", "hidden+weight", 768),
    ("chunked", "log-probs (entropy logged)", "hidden+weight", 384),
    ("naive", "no-grad", "", 768),
    ("naive", "log-probs (entropy logged)", "hidden", 768),
    ("naive", "log-probs (entropy logged)", "hidden+weight", 768),
]
HEAD_TOKENS = (1024, 4096)


@dataclass
class Args:
    runs: tuple[str, ...] = ("gpt2-ppo", "gpt2-grpo", "qwen-vocab-ppo", "qwen2-0.5b-ppo", "qwen2-0.5b-grpo")
    """configs to run (names in CONFIGS)"""
    updates: int = 3
    """updates per run; the first is warm-up and dropped"""
    trl: bool = True
    """also run TRL at the same configs, where benchmarks/runs/trl112 (PPO) / trl116 (GRPO) exist"""
    head: bool = True
    """run the LM-head memory micro-benchmark"""
    head_rows: tuple[int, ...] = tuple(range(len(HEAD_ROWS)))
    """the head benchmark's rows, by index in HEAD_ROWS"""
    head_vocab: int = 151936
    """the head benchmark's vocabulary"""
    head_tokens: tuple[int, ...] = HEAD_TOKENS
    """the head benchmark's token counts (the naive head at the first only)"""
    profile: bool = False
    """only time one training micro-batch of the GPT-2-124M PPO config (trunk vs LM head, forward vs backward) and
    one AdamW step (loop vs fused)"""
    estimate: bool = False
    """only write the memory-estimate tables (scale_estimate.md: the hub commands; scale_estimate_sizes.md: common
    sizes, full and LoRA): nothing is built or run"""
    out_dir: str = RESULTS
    """where the results go (the docs quote the tables only from benchmarks/results/)"""
    table: bool = False
    """measure nothing: scale_<device>.md and scale_head_<device>.md from each scale_<device>.json in --out-dir"""
    child: str | None = None
    """internal: run one measurement in this process (a JSON spec) and print its result as JSON"""


def build(shape):
    """Directory with a random-init causal LM, a 1-label reward model of the same trunk, a tokenizer, prompts; built
    once, in a child process: a run's ru_maxrss starts at its parent's resident set, which the models would raise."""
    path = os.path.join(RUNS, "scale_models", shape)
    if not os.path.exists(os.path.join(path, "done")):
        subprocess.run([PY, __file__, "--child", json.dumps({"kind": "build", "shape": shape})], check=True)
    return path


def build_child(shape, path):
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    cls, kwargs = SHAPES[shape]
    config = getattr(transformers, cls)(**kwargs, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    # one token per character, then filler tokens up to the vocabulary's size (transformers 5 loads a tokenizer saved
    # beside a Qwen2 config as Qwen2Tokenizer, which keeps a character split but not a whitespace one)
    tokens = ["<pad>", "<eos>", "<unk>"] + [chr(c) for c in range(33, 127)]
    vocab = {t: i for i, t in enumerate(tokens + [f"<{i}>" for i in range(config.vocab_size - len(tokens))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                                     unk_token="<unk>", padding_side="left")  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config.num_labels = 1
    rm = transformers.AutoModelForSequenceClassification.from_config(config)
    rm.save_pretrained(os.path.join(path, "rm"))
    tokenizer.save_pretrained(os.path.join(path, "rm"))
    rng = random.Random(0)
    with open(os.path.join(path, "prompts.jsonl"), "w") as f:
        for _ in range(256):
            prompt = "".join(rng.choice(tokens[3:]) for _ in range(PROMPT_TOKENS))
            f.write(json.dumps({"prompt": prompt, "answer": "0"}) + "\n")
    open(os.path.join(path, "done"), "w").close()


def median(xs):
    return sorted(xs)[len(xs) // 2]


def ours(name, updates):
    """Run ppo_llm.py / grpo_llm.py as a subprocess; medians of its time/* and perf/* over the timed updates, but the
    peak memory: the highest update's (on a GPU each update's is its own), as TRL's is its process's."""
    shape, script, prompts, gens, new, micro, extra = CONFIGS[name]
    path = build(shape)
    with tempfile.TemporaryDirectory(dir=RUNS) as out:
        cmd = [PY, os.path.join(ROOT, f"{script}_llm.py"), "--model", path, "--dataset", f"{path}/prompts.jsonl",
               "--prompts-per-update", str(prompts), "--max-new-tokens", str(new), "--micro-batch-size", str(micro),
               "--total-steps", str(updates), "--eval-every", "0", "--sample-every", "0",
               "--output-dir", out]  # fmt: skip
        cmd += ["--num-generations", str(gens)] if script == "grpo" else ["--num-mini-batches", "2"]
        cmd += [f"{path}/rm" if x == "RM" else x for x in extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        (run,) = os.listdir(out)
        with open(os.path.join(out, run, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f]
    peak_memory = max(m["perf/peak_memory_mb"] for m in metrics)
    metrics = metrics[1:]  # the first update warms up
    keys = ["time/generation", "time/scoring", "time/update", "perf/tokens_per_sec"]
    result = {k: median([m[k] for m in metrics]) for k in keys} | {"perf/peak_memory_mb": peak_memory}
    result["s/update"] = median([m["time/generation"] + m["time/scoring"] + m["time/update"] for m in metrics])
    result |= {k: max(m[k] for m in metrics) for k in metrics[0] if k.startswith("vllm/")}  # --vllm's, at most
    return result


def trl(name, updates):
    """The same config under TRL, in a subprocess with TRL's directory on PYTHONPATH; None when it is absent."""
    if "--critic head" in " ".join(CONFIGS[name][-1]):
        return {"error": "not run: TRL's PPO trains a separate value model, not a head on the policy's trunk"}
    script = CONFIGS[name][1]
    target = os.path.join(RUNS, "trl112" if script == "ppo" else "trl116")
    if not os.path.isdir(target):
        return None
    env = os.environ | {"PYTHONPATH": target, "TRL_EXPERIMENTAL_SILENCE": "1"}
    spec = json.dumps({"kind": f"trl-{script}", "name": name, "updates": updates})
    done = subprocess.run([PY, __file__, "--child", spec], env=env, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.split("\n")[-2])


class Timer:
    """Wraps a function to add its wall-clock seconds to `self.total`."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **k):
        start = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - start


def trl_child(spec):
    """One TRL run (PPO 1.12 or GRPO 1.16) in this process: per-step seconds (generation, and for GRPO scoring,
    where a wrapper around TRL's own functions can see them), from a callback at every step's end, and peak memory
    (peak RSS on CPU, max_memory_allocated on CUDA, as ours)."""
    import datasets
    import transformers

    shape, script, prompts, gens, new, micro, extra = CONFIGS[spec["name"]]
    path = build(shape)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    rows = [json.loads(line) for line in open(f"{path}/prompts.jsonl")]
    cuda = torch.cuda.is_available()
    common = dict(output_dir=tempfile.mkdtemp(dir=RUNS), report_to=[], save_strategy="no", logging_steps=1,
                  learning_rate=1e-5, use_cpu=not cuda, bf16=cuda, gradient_checkpointing=False)  # fmt: skip
    if script == "ppo":
        from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

        gen = ppo_trainer.batch_generation = Timer(ppo_trainer.batch_generation)
        config = PPOConfig(**common, per_device_train_batch_size=micro, gradient_accumulation_steps=prompts // micro,
                           num_mini_batches=2, num_ppo_epochs=2, total_episodes=prompts * spec["updates"],
                           response_length=new, local_rollout_forward_batch_size=micro, stop_token="eos",
                           num_sample_generations=0, kl_coef=0.05)  # fmt: skip
        dataset = datasets.Dataset.from_dict({"input_ids": [tokenizer(r["prompt"]).input_ids for r in rows]})
        lm = transformers.AutoModelForCausalLM.from_pretrained
        rm = transformers.AutoModelForSequenceClassification.from_pretrained
        trainer = PPOTrainer(config, tokenizer, lm(path), lm(path), rm(f"{path}/rm"), dataset, rm(f"{path}/rm"))
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**common, per_device_train_batch_size=prompts * gens, num_generations=gens,
                            max_completion_length=new, max_steps=spec["updates"], beta=0.0)  # fmt: skip
        dataset = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
        trainer = GRPOTrainer(path, lambda completions, **kw: [0.0] * len(completions), config,
                              train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
        gen = trainer._generate = Timer(trainer._generate)
        both = trainer._generate_and_score_completions = Timer(trainer._generate_and_score_completions)
    marks = [(time.perf_counter(), 0.0, 0.0)]  # cumulative (time, generation, generation + scoring)

    class Mark(transformers.TrainerCallback):
        def on_step_end(self, *a, **k):
            if cuda:  # the step's kernels finished, as the scripts' time/* count them
                torch.cuda.synchronize()
            marks.append((time.perf_counter(), gen.total, both.total if script == "grpo" else 0.0))

    trainer.add_callback(Mark())
    trainer.train()
    steps = [[b - a for a, b in zip(marks[i - 1], marks[i])] for i in range(2, len(marks))]  # warm-up dropped
    result = {"s/update": median([s[0] for s in steps]), "time/generation": median([s[1] for s in steps])}
    if cuda:
        result["perf/peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        result["perf/peak_memory_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    if script == "grpo":
        result["time/scoring"] = median([s[2] - s[1] for s in steps])
    result["perf/tokens_per_sec"] = prompts * gens * new / result["s/update"]  # responses run to the limit
    print(json.dumps(result))


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def head_child(spec):
    """Peak memory of one LM-head call and its backward over the memory already resident (MiB): ppo_llm's chunked
    lm_head_logprobs or the naive full-logits computation; no-grad, or training with the entropy logged (no gradient:
    --ent-coef 0) or in the loss (an entropy bonus), the backward into the hidden states and optionally into the
    head's weight, whose .grad buffer then exists beforehand (an optimizer step has made it). In fp32, on the GPU when
    there is one: there the memory is max_memory_allocated over memory_allocated before the call, on a CPU the peak
    RSS over the RSS before it."""
    sys.path.insert(0, ROOT)
    import ppo_llm

    tokens, H, V, grad, loss = spec["tokens"], spec["H"], spec["V"], spec["grad"], spec["loss"]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False, device=device).requires_grad_(grad == "hidden+weight")
    head.weight.grad = torch.zeros_like(head.weight) if grad == "hidden+weight" else None
    hidden = torch.randn(1, tokens, H, device=device, requires_grad=bool(grad))
    labels = torch.randint(V, (1, tokens), device=device)
    entropy_grad = loss == "log-probs + entropy"
    model = types.SimpleNamespace(config=types.SimpleNamespace(), get_output_embeddings=lambda: head)  # as an LM's

    def naive(hidden, model, labels, temperature, entropy_grad):  # TRL-style: full (B, T, V) logits
        logits = model.get_output_embeddings()(hidden) / temperature
        logprobs = logits.gather(-1, labels[..., None])[..., 0] - torch.logsumexp(logits, -1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
        return logprobs, entropy

    fn = ppo_llm.lm_head_logprobs if spec["impl"] == "chunked" else naive
    for x, y in [(hidden[:, :2], labels[:, :2]), (hidden, labels)]:  # warm-up on 2 tokens, then measured
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**20
        else:
            base = rss_mb()
        with torch.set_grad_enabled(bool(grad)):
            logprobs, entropy = fn(x, model, y, 1.0, entropy_grad=entropy_grad)
            if grad:
                (logprobs.sum() + (entropy.sum() if entropy_grad else 0)).backward()
        del logprobs, entropy
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(json.dumps({"peak_mb": peak - base}))


def head_benchmark(row_indices, V, token_counts):
    """The peak MiB of each of HEAD_ROWS[row_indices] at each of token_counts (the naive head at the first only: its
    training needs ~5 (tokens, V) fp32 tensors, 12 GiB at 4,096 tokens), each in a fresh subprocess, as many at a time
    as there are cores (a process's peak is its own)."""
    rows = [dict(zip(["impl", "loss", "grad", "H"], HEAD_ROWS[i]), peak_mb={}) for i in row_indices]
    measurements = [(row, tokens) for row in rows for tokens in token_counts[: 1 if row["impl"] == "naive" else None]]
    # a fixed mmap threshold: glibc's dynamic one keeps freed blocks of up to 32 MiB in its heap, which the RSS would
    # count as live (allocator memory, not tensors); every block over 128 KiB goes back when freed
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072"}

    def measure(measurement):
        row, tokens = measurement
        spec = {"kind": "head", "impl": row["impl"], "loss": row["loss"], "grad": row["grad"], "H": row["H"],
                "tokens": tokens, "V": V}  # fmt: skip
        done = subprocess.run([PY, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"error: the head measurement {spec} failed: {done.stderr.strip().splitlines()[-1]}")
        peak = json.loads(done.stdout.split("\n")[-2])["peak_mb"]
        label = f"{row['impl']}, {row['loss']}, {row['grad'] or '-'}, H {row['H']}"
        print(f"head: {label}, {tokens} tokens: {peak:.0f} MiB", flush=True)
        return peak

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        peaks = list(pool.map(measure, measurements))
    for (row, tokens), peak in zip(measurements, peaks):
        row["peak_mb"][str(tokens)] = peak
    return {"V": V, "chunk_mb": 2**24 * 4 / 2**20, "tokens": list(token_counts), "rows": rows}


def profile(shape="gpt2-124m", micro=8, new=64, repeats=3):
    """Seconds of one training micro-batch of the policy, split: trunk forward, head forward (log-probs + entropy,
    ppo_llm's lm_head_logprobs), head backward (recomputes the chunks), trunk backward; and of one AdamW step over
    its parameters, torch's per-parameter loop against fused. Medians over `repeats`."""
    import transformers

    sys.path.insert(0, ROOT)
    import ppo_llm

    policy = transformers.AutoModelForCausalLM.from_pretrained(build(shape)).train()
    ids = torch.randint(3, 1000, (micro, PROMPT_TOKENS + new))
    mask, times = torch.ones_like(ids), []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        hidden = ppo_llm.hidden_states(policy, ids, mask, PROMPT_TOKENS)
        t1 = time.perf_counter()
        leaf = hidden.detach().requires_grad_()
        logprobs, entropy = ppo_llm.lm_head_logprobs(leaf, policy, ids[:, PROMPT_TOKENS:], 1.0, entropy_grad=True)
        t2 = time.perf_counter()
        (logprobs.mean() + entropy.mean()).backward()
        t3 = time.perf_counter()
        hidden.backward(leaf.grad)
        t4 = time.perf_counter()
        policy.zero_grad(set_to_none=True)
        times.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3])
    keys = ["trunk forward", "head forward", "head backward", "trunk backward"]
    result = {k: median([t[i] for t in times[1:]]) for i, k in enumerate(keys)}
    for p in policy.parameters():
        p.grad = torch.randn_like(p)
    for name, kwargs in [("AdamW step, loop", {"foreach": False}), ("AdamW step, fused", {"fused": True})]:
        optimizer, steps = torch.optim.AdamW(policy.parameters(), lr=1e-5, **kwargs), []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            optimizer.step()
            steps.append(time.perf_counter() - t0)
        result[name] = median(steps[1:])
    return result


def estimate_gb(params, layers, hidden, vocab, seq, micro, batch, trained=1, frozen=1, checkpointing=False, bf16=True,
                kv_dim=None, cpu=False, lora=0, base_bytes=2):  # fmt: skip
    """Peak memory (GiB) of an update, before it runs: weights 4 B/param for every fp32 model (trained: policy,
    critic; frozen: reference, reward model), gradients 4 B and AdamW 8 B per trained param (+2 B of bf16 weight
    copies under autocast); activations of one micro-batch per trained trunk: ~16 hidden-sized tensors per token
    and layer (Korthikanti et al. 2022 without dropout, no stored attention scores with SDPA), 2 B each under bf16
    autocast, 4 B in fp32; with gradient checkpointing, each layer's input plus one layer's full set; the chunked
    head, the larger of five 2^24-logit fp32 chunks and three head-weight-sized fp32 gradients (the head benchmark's
    measurements); or, when larger, the generation batch's KV cache;
    on CPU ~0.7 GiB of libraries in the resident set.
    With LoRA (lora: the adapters' parameters of one trained model), each trained model's frozen base in its
    checkpoint dtype (base_bytes), 16 B per adapter parameter (fp32 weight, gradient, AdamW), the reference free (the
    base with its adapters off: pass frozen without it), the activations as above and no head-weight gradient, but the
    fp32 copy of the bf16 base's head that the chunked head holds from its forward through its backward."""
    act_bytes, tokens = (2 if bf16 else 4), micro * seq
    per_layer = 16 * hidden * act_bytes * tokens
    activations = tokens * hidden * act_bytes * layers + per_layer if checkpointing else per_layer * layers
    head = max(5 * 2**24 * 4, 3 * vocab * hidden * 4)
    kv_cache = 2 * layers * (kv_dim or hidden) * seq * batch * act_bytes
    persistent = 4 * params * (trained + frozen) + 8 * params * trained + (2 * params * trained if bf16 else 0)
    step = 4 * params * trained + trained * activations + head
    if lora:
        persistent = base_bytes * params * trained + 4 * params * frozen + 16 * lora * trained
        step = trained * activations + 5 * 2**24 * 4 + vocab * hidden * 4
    return (persistent + max(step, kv_cache) + (0.7 * 2**30 if cpu else 0)) / 2**30


# the hub commands of README.md and docs/: label, params, layers, hidden, vocab, kv dim, prompt + response tokens,
# micro-batch, generation batch, trained models, frozen models (in units of the policy's size)
HUB = [  # label: params, layers, hidden, vocab, kv dim, tokens per sequence, micro-batch, sequences, trained, frozen
    ("ppo_llm.py --model gpt2 (arithmetic: 128 x ~8+8 tokens, micro 64)", 124e6, 12, 768, 50257, None, 16, 64, 128,
     2, 1),
    ("ppo_llm.py --model gpt2 IMDB (128 x 8+24 tokens, micro 64, distilbert RM)", 124e6, 12, 768, 50257, None, 32, 64,
     128, 2, 1.55),
    ("grpo_llm.py Qwen2.5-0.5B, the GSM8K command (256 x ~200+512 tokens, micro 16)", 494e6, 24, 896, 151936, 128,
     712, 16, 256, 1, 0),
    ("grpo_llm.py Qwen2.5-1.5B, the same command", 1.54e9, 28, 1536, 151936, 256, 712, 16, 256, 1, 0),
]  # fmt: skip
# the CPU configs as estimator inputs (fp32): params, layers, hidden, vocab, kv dim, trained, frozen
MEASURED = {
    "gpt2-ppo": (124e6, 12, 768, 50257, None, 2, 2),
    "gpt2-grpo": (124e6, 12, 768, 50257, None, 1, 0),
    "qwen-vocab-ppo": (202e6, 12, 768, 151936, None, 2, 2),
    "qwen2-0.5b-ppo": (494e6, 24, 896, 151936, 128, 1, 1),
    "qwen2-0.5b-grpo": (494e6, 24, 896, 151936, 128, 1, 0),
    "tiny-grpo": (0.14e6, 2, 64, 512, None, 1, 0),
}


def hub_estimates():
    rows = {}
    for label, P, L, H, V, kv, seq, micro, batch, trained, frozen in HUB:
        settings = {"as given": (micro, False), "micro-batch / 4": (micro // 4, False), "+ ckpt": (micro, True),
                    "micro-batch / 4 + ckpt": (micro // 4, True)}  # fmt: skip
        rows[label] = {name: estimate_gb(P, L, H, V, seq, m, batch, trained, frozen, ck, kv_dim=kv)
                       for name, (m, ck) in settings.items()}  # fmt: skip
    return rows


# Common sizes, from Qwen2.5's configs: parameters, layers, hidden, vocabulary, KV dim, MLP width
SIZES = {
    "Qwen2.5-0.5B": (494e6, 24, 896, 151936, 128, 4864),
    "Qwen2.5-1.5B": (1.54e9, 28, 1536, 151936, 256, 8960),
    "Qwen2.5-7B": (7.62e9, 28, 3584, 152064, 512, 18944),
}
# each script with a reward function: (trained models, frozen fp32 models in full fine-tuning: the reference)
SCRIPTS = {"ppo_llm.py": (2, 1), "ppo_llm.py --critic head": (1, 1), "grpo_llm.py (beta 0)": (1, 0)}
WORKLOAD = (712, 16, 256)  # the GSM8K command's: tokens per sequence (~200 + 512), micro-batch, sequences per update


def lora_params(layers, hidden, kv_dim, mlp, r=16):
    """LoRA's parameters on every linear layer of a Llama/Qwen2 block, r (in + out) each: q, o (H -> H), k, v
    (H -> kv), gate, up (H -> mlp), down (mlp -> H)."""
    return r * layers * (9 * hidden + 2 * kv_dim + 3 * mlp)


def size_estimates():
    """estimate_gb of each script at each size, full and LoRA r 16, as given and with micro-batch 4 + ckpt."""
    seq, micro, batch = WORKLOAD
    rows = {}
    for size, (P, L, H, V, kv, mlp) in SIZES.items():
        for script, (trained, frozen) in SCRIPTS.items():
            cells = {}
            for lora in [0, lora_params(L, H, kv, mlp)]:
                for m, ckpt in [(micro, False), (4, True)]:
                    name = ("LoRA r 16" if lora else "full") + (", micro-batch 4 + ckpt" if ckpt else "")
                    fp32_frozen = 0 if lora else frozen  # with LoRA the reference is the base, adapters off
                    cells[name] = estimate_gb(
                        P, L, H, V, seq, m, batch, trained, fp32_frozen, ckpt, kv_dim=kv, lora=lora
                    )
            rows[f"{size} | {script}"] = cells
    return rows


def vllm_estimates(gpu_gib=80):
    """--vllm's engine at each size (GiB): its bf16 weights and a KV cache that holds the GSM8K command's whole rollout
    batch at once, 2 (K, V) x layers x KV dim x 2 B a token (a smaller cache runs fewer sequences at a time, and does
    not fail); the --vllm-gpu-memory-utilization that gives it that much of a GPU of gpu_gib, to 0.05 up (vLLM's own
    workspace, which it measures at its start, not counted); beside it grpo_llm.py's update peak (micro-batch 4 +
    ckpt), which the engine, asleep during the update, does not add to."""
    seq, _, batch = WORKLOAD
    rows = {}
    for size, (P, L, H, V, kv, mlp) in SIZES.items():
        weights, cache = 2 * P / 2**30, 2 * L * kv * seq * batch * 2 / 2**30
        full = estimate_gb(P, L, H, V, seq, 4, batch, 1, 0, True, kv_dim=kv)
        lora = estimate_gb(P, L, H, V, seq, 4, batch, 1, 0, True, kv_dim=kv, lora=lora_params(L, H, kv, mlp))
        share = math.ceil(20 * (weights + cache) / gpu_gib) / 20
        rows[size] = {"weights": weights, "KV cache": cache, "utilization": share, "full": full, "LoRA r 16": lora}
    return rows


def machine_name(device):
    """The GPU's name, or the CPU's model, cores and memory (also used by llm_speed.py and lora.py)."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {gib:.0f} GiB"


def table_row(label, who, m, trl_m, est):
    """One markdown row: the time split, tokens/s, peak GiB, the estimate and ours/TRL ratios."""
    if not m or "error" in m:
        return f"| {label} | {who} | {m['error'] if m else 'not installed'} |||||||||"
    scoring = m.get("time/scoring")
    training = m["s/update"] - m["time/generation"] - (scoring or 0)
    ratios = ["", ""]
    if est is not None and trl_m and "error" not in trl_m:
        ratios = [f"{m['s/update'] / trl_m['s/update']:.2f}",
                  f"{m['perf/peak_memory_mb'] / trl_m['perf/peak_memory_mb']:.2f}"]  # fmt: skip
    return (f"| {label} | {who} | {m['s/update']:.1f} | {m['time/generation']:.1f} | "
            f"{'-' if scoring is None else f'{scoring:.1f}'} | "
            f"{training:.1f}{'' if scoring is not None else ' (+ scoring)'} "
            f"| {m['perf/tokens_per_sec']:.1f} | {m['perf/peak_memory_mb'] / 1024:.2f} | "
            f"{'' if est is None else f'{est:.2f}'} | {ratios[0]} | {ratios[1]} |")  # fmt: skip


def main():
    args = tyro.cli(Args)
    if args.child:
        spec = json.loads(args.child)
        if spec["kind"] == "build":
            return build_child(spec["shape"], os.path.join(RUNS, "scale_models", spec["shape"]))
        return head_child(spec) if spec["kind"] == "head" else trl_child(spec)
    if args.table:
        for saved in saved_results(os.path.join(args.out_dir, "scale_c*.json")):  # scale_cpu, scale_cuda: not profiles
            print(write(args.out_dir, saved))
        return
    write_estimate(args.out_dir)
    if args.estimate:
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.profile:  # printed, and kept in scale_profile_<device>.json
        result = {"machine": machine_name(device), "command": "python benchmarks/scale.py --profile"} | profile()
        with open(os.path.join(args.out_dir, f"scale_profile_{device}.json"), "w") as f:
            json.dump(result, f, indent=1)
        return print(json.dumps(result))
    path = os.path.join(args.out_dir, f"scale_{device}.json")
    saved = {"device": device, "results": {}, "head": None}
    if os.path.exists(path):  # configs not run this time keep their last results
        with open(path) as f:
            saved = json.load(f)
    saved["torch"] = torch.__version__
    results = saved["results"]
    for name in args.runs:
        print(f"{name}: ours ...", flush=True)
        glibc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"}
        r = results[f"{name}, {GLIBC_NO_TRIM}" if glibc else name] = {  # the children inherit glibc's settings
            "ours": ours(name, args.updates),
            "updates": args.updates,
            "command": sys.argv[1:],
            "env": glibc,
            "machine": machine_name(device),
        }
        if args.trl:
            print(f"{name}: TRL ...", flush=True)
            r["trl"] = trl(name, args.updates)
        save(path, saved)  # after every config, so that a run cut short keeps what it measured
        write(args.out_dir, saved)
    if args.head:
        saved["head"] = head_benchmark(args.head_rows, args.head_vocab, args.head_tokens)
        saved["head"]["machine"] = machine_name(device)
    save(path, saved)
    print(write(args.out_dir, saved))


def write_estimate(out_dir):
    """scale_estimate.md: estimate_gb at the hub commands, as given, with a quarter of the micro-batch, with gradient
    checkpointing and with both."""
    hub = hub_estimates()
    cols = list(next(iter(hub.values())))
    lines = ["Estimated peak GPU memory (GiB; bf16 autocast, fp32 master weights, AdamW) at the hub commands, as given "
             "and with a quarter of the micro-batch; ckpt = --gradient-checkpointing. Command: "
             "`python benchmarks/scale.py --estimate`", "",
             f"| command | {' | '.join(cols)} |",
             "|---|" + "---|" * len(cols)]  # fmt: skip
    lines += [f"| {label} | " + " | ".join(f"{v:.1f}" for v in gb.values()) + " |" for label, gb in hub.items()]
    write_table("scale_estimate.md", "\n".join(lines), out_dir)
    sizes = size_estimates()
    cols = list(next(iter(sizes.values())))
    seq, micro, batch = WORKLOAD
    lines = [
        f"Estimated peak GPU memory (GiB) of one update at the GSM8K command's shape ({batch} sequences of ~{seq} "
        f"tokens, micro-batch {micro}, a reward function), bf16 autocast over fp32 weights, AdamW; LoRA r 16 on every "
        "linear layer of the trunk over a bf16 base; ckpt = --gradient-checkpointing. Command: "
        "`python benchmarks/scale.py --estimate`",
        "",
        f"| model | script | {' | '.join(cols)} |",
        "|---|---|" + "---|" * len(cols),
    ]
    lines += [f"| {label} | " + " | ".join(f"{v:.1f}" for v in gb.values()) + " |" for label, gb in sizes.items()]
    write_table("scale_estimate_sizes.md", "\n".join(lines), out_dir)
    lines = [
        f"--vllm's engine (GiB): bf16 weights, and a KV cache for the GSM8K command's whole rollout ({batch} sequences "
        f"of ~{seq} tokens); the --vllm-gpu-memory-utilization that holds both on an 80 GiB GPU; grpo_llm.py's update "
        "peak (micro-batch 4 + ckpt) beside it, which the sleeping engine does not add to. Command: "
        "`python benchmarks/scale.py --estimate`",
        "",
        "| model | engine weights | KV cache | --vllm-gpu-memory-utilization | update, full | update, LoRA r 16 |",
        "|---|---|---|---|---|---|",
    ]
    for size, r in vllm_estimates().items():
        cells = [f"{r['weights']:.1f}", f"{r['KV cache']:.1f}", f"{r['utilization']:.2f}", f"{r['full']:.1f}"]
        lines.append(f"| {size} | " + " | ".join(cells + [f"{r['LoRA r 16']:.1f}"]) + " |")
    write_table("scale_estimate_vllm.md", "\n".join(lines), out_dir)


def save(path, saved):
    """scale_<device>.json: every config measured so far, the head, the estimate at the hub commands."""
    for name, r in saved["results"].items():
        config = name.split(",")[0]  # without ", glibc keeps freed memory"
        shape, script, prompts, gens, new, micro, extra = CONFIGS[config]
        P, L, H, V, kv, trained, frozen = MEASURED[config]
        cuda = saved["device"] == "cuda"
        r["ours"]["estimate_gb"] = estimate_gb(P, L, H, V, PROMPT_TOKENS + new, micro, prompts * gens, trained,
                                               frozen, bf16=cuda, kv_dim=kv, cpu=not cuda)  # fmt: skip
    with open(path, "w") as f:
        json.dump(saved | {"hub_estimates_gb": hub_estimates()}, f, indent=1)


def write(out_dir, saved):
    """scale_<device>.md (when a config was measured) and scale_head_<device>.md (when the head was) in out_dir, from
    a scale_<device>.json's contents; returns the markdown."""
    device, results, head = saved["device"], saved["results"], saved["head"]
    precision, peak = ("bf16 autocast", "max_memory_allocated") if device == "cuda" else ("fp32", "the peak RSS")
    machines = ", and ".join(sorted({r["machine"] for r in results.values()}))
    lines = [f"Machine: {machines}, torch {saved['torch']}, {precision}. "
             "Command: `python benchmarks/scale.py --runs NAME --updates N`; seconds are medians over the N - 1 "
             f"updates after 1 of warm-up; peak memory is {peak} of the process.", "",
             "| config (prompts x generations x new tokens, micro-batch) | N | run | s/update | generation | scoring | "
             "training | tokens/s | peak GiB | estimate GiB | ours/TRL s/update | ours/TRL peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        shape, script, prompts, gens, new, micro, extra = CONFIGS[name.split(",")[0]]
        label = f"{name} ({prompts}x{gens}x{new}, {micro}{', ' + ' '.join(extra) if extra else ''}) | {r['updates']}"
        lines.append(table_row(label, "ours", r["ours"], r.get("trl"), r["ours"]["estimate_gb"]))
        if "trl" in r:
            lines.append(table_row(label, "TRL", r["trl"], None, None))
    tables = []
    if results:
        tables.append("\n".join(lines))
        write_table(f"scale_{device}.md", tables[-1], out_dir)
    if head:
        if device == "cuda":
            over = "over the memory allocated before it (MiB, max_memory_allocated)"
            allocator = ""
        else:
            over = "over the resident set (MiB)"
            allocator = "; glibc's mmap threshold fixed at 128 KiB"
        head_lines = [f"LM head: peak memory of one call and its backward {over}, V = {head['V']}, one chunk = "
                      f"{head['chunk_mb']:.0f} MiB of fp32 logits; the naive head holds the full (tokens, V) "
                      f"logits{allocator}. Machine: {head['machine']}, torch {saved['torch']}. "
                      "Command: `python benchmarks/scale.py --runs`", "",
                      "| head | the loss reads | gradient of | H | "
                      + " | ".join(f"{t:,} tokens" for t in head["tokens"]) + " |",
                      "|---|---|---|---|" + "---|" * len(head["tokens"])]  # fmt: skip
        for row in head["rows"]:
            peaks = [row["peak_mb"].get(str(t)) for t in head["tokens"]]
            head_lines.append(f"| {row['impl']} | {row['loss']} | {row['grad'] or '-'} | {row['H']} | "
                              + " | ".join("-" if p is None else f"{p:.0f}" for p in peaks) + " |")  # fmt: skip
        tables.append("\n".join(head_lines))
        write_table(f"scale_head_{device}.md", tables[-1], out_dir)
    return "\n\n".join(tables)


if __name__ == "__main__":
    main()
