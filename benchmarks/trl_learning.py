"""grpo_llm.py beside TRL's GRPOTrainer (TRL 1.16) on the trace and calculator tasks, and beside its DistillationTrainer
on on-policy distillation, each as a new user would run it (CPU, fp32).

Both train assets/sums-sft on assets/sums/train.jsonl with the gsm8k reward (grpo_llm.py's own function; TRL calls
it through a wrapper), at the same configuration:

    grpo_llm.py (its defaults, llm_learning.py's trace flags)   TRL 1.16 GRPOConfig
    --prompts-per-update 8 --num-generations 8                   per_device_train_batch_size=64, num_generations=8
    learning rate 1e-4 (the default under 50M parameters)        learning_rate=1e-4, lr_scheduler_type="constant"
    AdamW (fused), eps 1e-5, weight decay 0                      adam_epsilon=1e-5 (optim and weight decay: defaults)
    --beta 0, --epsilon 0.2, --loss-type grpo, μ = 1             beta=0.0, epsilon=0.2, loss_type="grpo"
    64 new tokens (the checkpoint's), temperature 1              max_completion_length=64, temperature=1.0
    fp32 on the CPU                                              bf16=False, gradient_checkpointing=False, use_cpu

and the defaults of each otherwise (group-scaled advantages, grad-norm clip 1.0, top-k 0, top-p 1 in both). Each run
has one torch thread, two run at a time. Every --eval-every updates each saves its policy (ours by going on with
--resume: the same run as one in a go), and `grpo_llm.py --eval-only` scores every saved policy on the 256 held-out
problems of assets/sums/test.jsonl at temperature 1, with the run's seed.

TRL runs in a subprocess: TRL 1.16 as requirements-dev.txt installs it, or from benchmarks/runs/trl116, put on
PYTHONPATH for TRL's runs alone when it is there:

    pip install --no-deps --target benchmarks/runs/trl116 trl==1.16.0 accelerate psutil

`--trl stock` is TRL as installed. `--trl fixed` adds THIS BENCHMARK'S PATCH, NOT PART OF TRL (position_ids_from_mask
below): TRL 1.16's training forward (GRPOTrainer._get_per_token_logps_and_entropies) passes no position_ids, so with
left-padded prompts a model with absolute positions (GPT-2, as here) scores each completion at other positions than
generate() sampled it at; the patch gives that forward the position ids of the attention mask, as generate() uses.
`--part logprobs` measures the difference on one batch: TRL's per-token log-probs without and with the patch (and
grpo_llm.py's) against the log-probs the tokens were sampled with.

The calculator task (--task calc) trains assets/calc-sft on assets/calc/train.jsonl with the arithmetic reward
(grpo_llm.py's, on the last turn's text, "" for a response that ends on a call or a tool's result, as grpo_llm.py
scores it), at the same configuration but for:

    grpo_llm.py --tools calculator (llm_learning.py's calc)      TRL 1.16: GRPOTrainer(tools=[grpo_llm.calculator])
    prompts through the chat template with the tools             prompts as [{"role": "user", "content": ...}]
    --max-tool-calls 4                                           max_tool_calling_iterations=4
    96 new tokens (the checkpoint's), tool tokens included       max_completion_length=96 (tool tokens included)

and every TRL run there needs THIS BENCHMARK'S PATCH generate_within_context (below): after a tool result TRL asks
generate() for max_completion_length new tokens again, past the 128 positions of assets/calc-sft (a generate() whose
longest row has not ended by position 128 stops the run with an IndexError). Evaluation is
grpo_llm.py --eval-only --tools calculator on the 256 problems of assets/calc/test.jsonl, which also gives the
held-out calls per response (eval/tools/call_frequency).

On-policy distillation (--task distill) trains assets/arith-student from assets/arith-teacher (assets/README.md) on the
prompts of assets/arith/train.jsonl with TRL 1.16's DistillationTrainer, on-policy by construction (the student samples
every completion; GKDTrainer, in trl.experimental, warns that lmbda=1 at temperature 1 is what DistillationTrainer
does), at:

    grpo_llm.py --model assets/arith-student --teacher ...     TRL 1.16 DistillationConfig
    --prompts-per-update 8 --num-generations 8                  per_device_train_batch_size=64 (one completion each)
    each token's advantage -(log pi - log pi_teacher)           beta=1.0: the reverse KL, over the whole vocabulary
    learning rate 1e-4, AdamW eps 1e-5, weight decay 0          learning_rate=1e-4, constant, adam_epsilon=1e-5
    8 new tokens (the checkpoint's), temperature 1              max_completion_length=8, temperature=1.0
    fp32 on the CPU                                             bf16=False, gradient_checkpointing=False, use_cpu

TRL's loss calls the student's and the teacher's backbones without position ids, so `--trl fixed` gives both of them
those of the attention mask (position_ids_from_mask on each backbone). Evaluation is grpo_llm.py --eval-only of each
saved policy without the teacher, and of the teacher once a seed.

The guessing game (--task guess) trains assets/guess-sft on assets/guess/train.jsonl in assets/guess.py's
GuessingGame, the same class unchanged in both, its get_reward() the only reward:

    grpo_llm.py --environment assets/guess.py:GuessingGame     TRL 1.16: GRPOTrainer(environment_factory=GuessingGame)
    (no --reward-fn: get_reward is the reward)                   reward_funcs=None (the environment owns the reward)
    the row's prompt (one user message) and its secret column    the same rows: reset(**row) reads the secret
    --max-tool-calls 8                                           max_tool_calling_iterations=8
    129 new tokens (the checkpoint's), tool tokens included      max_completion_length=129 (tool tokens included)

and the rest as on the calculator task, generate_within_context included. Evaluation is grpo_llm.py --eval-only
--environment assets/guess.py:GuessingGame --max-tool-calls 8 on the 248 games of assets/guess/test.jsonl: success
(eval/accuracy, a won game) and guesses per game (eval/tools/call_frequency).

    python benchmarks/trl_learning.py                       # ours, TRL stock and fixed: 2 seeds x 200 updates
    python benchmarks/trl_learning.py --part logprobs       # the log-probs of one batch
    python benchmarks/trl_learning.py --part table          # measure nothing: the tables and figure from the .json
    python benchmarks/trl_learning.py --task calc --trl fixed --seeds 1 --updates 100   # the calculator task
    python benchmarks/trl_learning.py --task calc --part table                         # its table from its .json
    python benchmarks/trl_learning.py --task distill --updates 400 --eval-every 50     # on-policy distillation
    python benchmarks/trl_learning.py --task guess --trl fixed --seeds 1 --updates 60 --eval-every 20   # the game

Results: benchmarks/results/trl_learning.json (each run's accuracy at each saved update and seconds per update),
trl_learning.md (also into the docs pages that quote it, benchmarks/docs_tables.py), trl_learning.png, and
trl_logprobs.json and trl_logprobs.md; for --task calc, trl_calc.json and trl_calc.md; for --task distill,
trl_distill.json and trl_distill.md; for --task guess, trl_guess.json and trl_guess.md. --part table without its .json
says so and writes nothing.
"""

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402
from llm_learning import CALC, GUESS, STUDENT, TEACHER, TRACE  # noqa: E402
from scale import machine_name  # noqa: E402

import grpo_llm  # noqa: E402

BISECTION_GUESSES = 129 / 31  # assets/guess.py: the fewest guesses on average any strategy can
TRL_DIR = os.path.join(ROOT, "benchmarks", "runs", "trl116")
MODEL, TRAIN = "assets/sums-sft", "assets/sums/train.jsonl"
# Each task: grpo_llm.py's flags (llm_learning.py's), those of its evaluation (without --model), its results' name, the
# completion length (the checkpoint's). Distillation is evaluated without the teacher: the student alone answers.
TASKS = {
    "trace": {"flags": TRACE, "eval": TRACE[2:], "name": "trl_learning", "tokens": 64},
    "calc": {
        "flags": [*CALC, "--tools", "calculator"],
        "eval": [*CALC[2:], "--tools", "calculator"],
        "name": "trl_calc",
        "tokens": 96,
    },
    "distill": {"flags": ["--model", STUDENT, "--teacher", TEACHER], "eval": [], "name": "trl_distill", "tokens": 8},
    "guess": {
        "flags": [*GUESS, "--environment", "assets/guess.py:GuessingGame"],
        "eval": [*GUESS[2:], "--environment", "assets/guess.py:GuessingGame"],
        "name": "trl_guess",
        "tokens": 129,
    },
}
NAMES = {
    "ours": "ours (`grpo_llm.py`)",
    "stock": "TRL 1.16 GRPOTrainer, as installed",
    "fixed": "TRL 1.16 GRPOTrainer + position ids from the mask (this benchmark's patch)",
}
CALC_NAMES = {  # on the calculator task every TRL run needs generate_within_context (below)
    "ours": "ours (`grpo_llm.py --tools calculator`)",
    "stock": "TRL 1.16 GRPOTrainer, `tools=[calculator]`, + generate() within the context (this benchmark's patch)",
    "fixed": "TRL 1.16 GRPOTrainer, `tools=[calculator]`, + generate() within the context and position ids from the "
    "mask (this benchmark's patches)",
}
GUESS_NAMES = {  # the same class, assets/guess.py's GuessingGame, unchanged in both
    "ours": "ours (`grpo_llm.py --environment assets/guess.py:GuessingGame`)",
    "stock": "TRL 1.16 GRPOTrainer, `environment_factory=GuessingGame`, + generate() within the context (this "
    "benchmark's patch)",
    "fixed": "TRL 1.16 GRPOTrainer, `environment_factory=GuessingGame`, + generate() within the context and position "
    "ids from the mask (this benchmark's patches)",
}
DISTILL_NAMES = {
    "ours": "ours (`grpo_llm.py --teacher`)",
    "stock": "TRL 1.16 DistillationTrainer, `beta=1` (reverse KL), on-policy, as installed",
    "fixed": "TRL 1.16 DistillationTrainer, `beta=1`, + position ids from the mask (this benchmark's patch)",
}


@dataclass
class Args:
    task: Literal["trace", "calc", "distill", "guess"] = "trace"
    """trace: assets/sums-sft, gsm8k reward; calc: assets/calc-sft, the calculator (TRL's tools=), arithmetic reward;
    distill: on-policy distillation of assets/arith-student from assets/arith-teacher (TRL's DistillationTrainer);
    guess: assets/guess-sft in assets/guess.py's GuessingGame (TRL's environment_factory=), the game's get_reward"""
    part: Literal["learning", "logprobs", "table"] = "learning"
    """learning: train and evaluate the runs, then the table; logprobs: one batch's log-probs; table: measure nothing"""
    trl: tuple[Literal["stock", "fixed"], ...] = ("stock", "fixed")
    """the TRL runs: as installed (stock), and with this benchmark's position-ids patch (fixed)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    updates: int = 200
    """optimizer steps of each run (one batch of 8 prompts x 8 completions each)"""
    eval_every: int = 25
    """save and evaluate every N updates"""
    jobs: int = 2
    """runs at a time (each uses one torch thread)"""
    runs_dir: str = os.path.join(ROOT, "benchmarks", "runs", "trl_learning")
    out_dir: str = os.path.join(ROOT, "benchmarks", "results")
    child: str | None = None
    """internal: one TRL run (a JSON spec) in this process"""


# ---- TRL, in the child process


def gsm8k(completions, answer, **columns):
    """grpo_llm.py's gsm8k reward, called as TRL calls a reward function: 1 when the final numbers agree."""
    return grpo_llm.REWARD_FNS["gsm8k"](completions, answer)


def arithmetic(completions, answer, **columns):
    """grpo_llm.py's arithmetic reward, called as TRL calls a reward function with tools=: on the text of the last
    turn, and on "" where that turn is a tool's result or a call (grpo_llm.py scores both as no answer)."""
    texts = []
    for messages in completions:
        last = messages[-1]
        if last["role"] != "assistant" or last.get("tool_calls"):
            texts.append("")
        else:
            texts.append(last["content"])
    return grpo_llm.REWARD_FNS["arithmetic"](texts, answer)


def generate_within_context(model):
    """THIS BENCHMARK'S PATCH, NOT TRL: generate() asks for no more new tokens than the model has positions left.

    After a tool result TRL 1.16's loop asks generate() for the full max_completion_length again (and cuts the
    completion to it afterwards): past assets/calc-sft's 128 positions, so a generate() whose longest row has not
    ended by position 128 stops the run (IndexError in GPT-2's position embedding). The patch caps each generate() at
    the positions left after its longest input, as grpo_llm.py's rollout() gives each generate() the room of the
    longest response still going; what TRL keeps of a completion is unchanged."""
    generate = model.generate

    def within_context(*args, **kwargs):
        room = model.config.max_position_embeddings - kwargs["input_ids"].shape[1]
        asked = kwargs["generation_config"].max_new_tokens
        return generate(*args, **kwargs, max_new_tokens=min(asked, room))

    model.generate = within_context


def position_ids_from_mask(model):
    """THIS BENCHMARK'S PATCH, NOT TRL: a call of `model` without position_ids gets those of its attention mask.

    generate() numbers a left-padded prompt's tokens from its first real one; TRL 1.16's training forward passes no
    position_ids, so GPT-2 numbers them from the first pad. With the patch the training forward scores each token at
    the position it was sampled at (generate() passes position_ids itself: unchanged)."""

    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = grpo_llm.position_ids(kwargs["attention_mask"].long())
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def guessing_game():
    """assets/guess.py's GuessingGame class, unchanged, as grpo_llm.py --environment loads it."""
    spec = importlib.util.spec_from_file_location("guess", os.path.join(ROOT, "assets", "guess.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GuessingGame


def trl_config(out, seed, updates, save_every, tokens):
    """What both of TRL's trainers are given here (the module docstring's mapping): 64 completions an update, AdamW at
    1e-4 constant with eps 1e-5, `tokens` new tokens at temperature 1, fp32 on the CPU, the policy saved every
    save_every updates, no logger."""
    return dict(
        output_dir=out,
        per_device_train_batch_size=64,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        adam_epsilon=1e-5,
        max_completion_length=tokens,
        temperature=1.0,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        max_steps=updates,
        seed=seed,
        save_strategy="steps",
        save_steps=save_every,
        save_only_model=True,
        logging_steps=1,
        report_to=[],
    )


def trl_trainer(out, seed, updates, save_every, task="trace"):
    """GRPOTrainer on the task at grpo_llm.py's configuration (the module docstring's mapping)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    flags = TASKS[task]["flags"]
    model, train = flags[flags.index("--model") + 1], flags[flags.index("--dataset") + 1]
    with open(os.path.join(ROOT, train)) as f:
        rows = [json.loads(line) for line in f]
    if task == "calc":  # a chat, rendered with the tools, as grpo_llm.py renders a prompt under --tools
        prompts = [[{"role": "user", "content": r["prompt"]}] for r in rows]
        extra, reward, calls = {"tools": [grpo_llm.calculator]}, arithmetic, {"max_tool_calling_iterations": 4}
    elif task == "guess":  # the environment owns the reward (get_reward): no reward function
        prompts = [r["prompt"] for r in rows]
        extra, reward, calls = {"environment_factory": guessing_game()}, None, {"max_tool_calling_iterations": 8}
    else:
        prompts, extra, reward, calls = [r["question"] for r in rows], {}, gsm8k, {}
    if task == "guess":  # reset(**row) reads the row's secret
        columns = [{"prompt": p, "secret": r["secret"]} for p, r in zip(prompts, rows)]
    else:
        columns = [{"prompt": p, "answer": r["answer"]} for p, r in zip(prompts, rows)]
    dataset = datasets.Dataset.from_list(columns)
    common = trl_config(out, seed, updates, save_every, TASKS[task]["tokens"])
    config = GRPOConfig(**common, num_generations=8, beta=0.0, epsilon=0.2, loss_type="grpo", **calls)
    path = os.path.join(ROOT, model)
    return GRPOTrainer(model=path, reward_funcs=reward, args=config, train_dataset=dataset, **extra)


def trl_distill_trainer(out, seed, updates, save_every):
    """DistillationTrainer on the embedded pair at grpo_llm.py --teacher's configuration (the module docstring's
    mapping): the student samples one completion of each of 64 prompts, and the loss is the reverse KL to the teacher
    (beta=1) over the whole vocabulary at each of its tokens."""
    import datasets
    from trl import DistillationConfig, DistillationTrainer

    with open(os.path.join(ROOT, "assets/arith/train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    config = DistillationConfig(**trl_config(out, seed, updates, save_every, TASKS["distill"]["tokens"]), beta=1.0)
    student, teacher = os.path.join(ROOT, STUDENT), os.path.join(ROOT, TEACHER)
    return DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset)


def trl_child(spec):
    """One TRL run: a checkpoint every save_every steps in spec["out"], the seconds of every step in times.json."""
    import transformers

    torch.set_num_threads(1)
    if spec["task"] == "distill":
        trainer = trl_distill_trainer(spec["out"], spec["seed"], spec["updates"], spec["save_every"])
    else:
        trainer = trl_trainer(spec["out"], spec["seed"], spec["updates"], spec["save_every"], spec["task"])
    if spec["kind"] == "fixed" and spec["task"] == "distill":  # its loss calls both backbones, not the LM heads
        position_ids_from_mask(trainer.model.base_model)
        position_ids_from_mask(trainer.teacher_model.base_model)
    elif spec["kind"] == "fixed":
        position_ids_from_mask(trainer.model)
    if spec["task"] in ("calc", "guess"):  # TRL asks each turn's generate() for the whole budget again
        generate_within_context(trainer.model)
    marks = [time.perf_counter()]

    class Mark(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            marks.append(time.perf_counter())

    trainer.add_callback(Mark())
    trainer.train()
    with open(os.path.join(spec["out"], "times.json"), "w") as f:
        json.dump({"s_per_update": np.diff(marks).tolist()}, f)


def logprobs_child(spec):
    """One batch, 32 prompts x 8 completions sampled with TRL's generation config: the sampled tokens' log-probs at
    sampling, from TRL's training forward as installed and with the patch, and from grpo_llm.py's training forward."""
    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    trainer = trl_trainer(spec["out"], spec["seed"], 1, 1)
    model, tokenizer = trainer.model.eval(), trainer.processing_class
    with open(os.path.join(ROOT, TRAIN)) as f:
        prompts = [json.loads(line)["question"] for line in f][:32]
    enc = tokenizer([p for p in prompts for _ in range(8)], padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc, generation_config=trainer.generation_config, output_logits=True, return_dict_in_generate=True
        )
    completions = out.sequences[:, enc.input_ids.shape[1] :]  # (B, C)
    is_eos = torch.isin(completions, torch.tensor(trainer.eos_token_ids))
    mask = (is_eos.cumsum(1) - is_eos.long()) == 0  # up to and with the first EOS, as TRL masks
    sampled = torch.stack(out.logits, 1).log_softmax(-1).gather(-1, completions[..., None])[..., 0]  # T = 1
    input_ids = torch.cat([enc.input_ids, completions], 1)
    attention_mask = torch.cat([enc.attention_mask, mask.long()], 1)
    C = completions.shape[1]
    logps = {}
    with torch.no_grad():
        logps["stock"] = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, C)[0]
        position_ids_from_mask(model)
        logps["fixed"] = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, C)[0]
        hidden = grpo_llm.hidden_states(model, input_ids, attention_mask, enc.input_ids.shape[1])
        logps["ours"] = grpo_llm.lm_head_logprobs(hidden, model, completions, 1.0)[0]
    padded = (enc.attention_mask[:, 0] == 0)[:, None] & mask  # the tokens of completions whose prompt was padded
    result = {"tokens": int(mask.sum()), "tokens_of_padded_prompts": int(padded.sum()), "completions": len(mask)}
    result["padded_prompts"] = int((enc.attention_mask[:, 0] == 0).sum())
    for name, lp in logps.items():
        error = (lp - sampled).abs()
        result[name] = {"mean": error[mask].mean().item(), "max": error[mask].max().item()}
        result[name]["mean_padded"] = error[padded].mean().item() if padded.any() else None
        result[name]["mean_unpadded"] = error[mask & ~padded].mean().item() if (mask & ~padded).any() else None
    print(json.dumps(result))


def ours_child(spec):
    """grpo_llm.py on the task, stopped every save_every updates and gone on with --resume (the same run as one
    in a go), each stop's policy/ copied to checkpoint-<update>/; the wall time of each update in times.json."""
    run_root, run_dir, seconds = os.path.join(spec["out"], "run"), None, []
    for update in range(spec["save_every"], spec["updates"] + 1, spec["save_every"]):
        if update == spec["save_every"]:
            flags = [*TASKS[spec["task"]]["flags"], "--seed", str(spec["seed"]), "--output-dir", run_root]
            flags += ["--eval-every", "0", "--sample-every", "0", "--save-every", "0"]
        else:
            flags = ["--resume", run_dir]
        subprocess.run([sys.executable, "grpo_llm.py", *flags, "--total-steps", str(update)], cwd=ROOT, check=True)
        (run_dir,) = [os.path.join(run_root, name) for name in os.listdir(run_root)]
        shutil.copytree(os.path.join(run_dir, "policy"), os.path.join(spec["out"], f"checkpoint-{update}"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        elapsed = [json.loads(line)["time/elapsed"] for line in f]
    for i, t in enumerate(elapsed):  # time/elapsed counts from each (re)start: the first update of a segment from 0
        seconds.append(t - elapsed[i - 1] if i % spec["save_every"] else t)
    with open(os.path.join(spec["out"], "times.json"), "w") as f:
        json.dump({"s_per_update": seconds}, f)


# ---- the parent: runs, evaluation, table and figure


def run_dir(args, kind, seed):
    """A run's directory: <kind>-<seed> for the trace task, calc-<kind>-<seed> for the calculator."""
    if args.task == "trace":
        return os.path.join(args.runs_dir, f"{kind}-{seed}")
    return os.path.join(args.runs_dir, f"{args.task}-{kind}-{seed}")


def start(args, kind, seed):
    """One run (kind: ours, stock or fixed) as a child process of this script; TRL's on PYTHONPATH for TRL only."""
    out = run_dir(args, kind, seed)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    spec = {"kind": kind, "seed": seed, "updates": args.updates, "save_every": args.eval_every, "out": out}
    spec["task"] = args.task
    env = os.environ | ({"PYTHONPATH": TRL_DIR} if kind != "ours" else {})
    log = open(os.path.join(out, "log.txt"), "w")
    print(f"running {kind} seed {seed} (log: {log.name})", flush=True)
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log


def evaluate(model, seed, task):
    """grpo_llm.py --eval-only of one policy with the task's flags and the run's seed: its metrics."""
    flags = [*TASKS[task]["eval"], "--model", model, "--eval-only", "--seed", str(seed)]
    flags += ["--max-new-tokens", str(TASKS[task]["tokens"])]
    with contextlib.redirect_stdout(io.StringIO()):
        return grpo_llm.main(grpo_llm.parse_args(flags))


def learning(args):
    """Every run, --jobs at a time (ours beside stock TRL first), then every saved policy evaluated: the results."""
    if args.trl and not os.path.isdir(TRL_DIR) and importlib.util.find_spec("trl") is None:
        where = os.path.relpath(TRL_DIR, ROOT)
        install = f"pip install --no-deps --target {where} trl==1.16.0 accelerate psutil"
        raise SystemExit(f"error: --trl needs TRL 1.16 in {where}: {install}")
    jobs = [(kind, seed) for seed in args.seeds for kind in ["ours", *args.trl]]
    jobs.sort(key=lambda job: job[0] == "fixed")  # stable: ours and stock TRL of each seed side by side, then fixed
    running = []
    while jobs or running:
        while jobs and len(running) < args.jobs:
            kind, seed = jobs.pop(0)
            running.append((kind, seed, *start(args, kind, seed)))
        done = [r for r in running if r[2].poll() is not None]
        for kind, seed, process, log in done:
            log.close()
            running.remove((kind, seed, process, log))
            if process.returncode:
                raise SystemExit(
                    f"error: the {kind} run of seed {seed} failed (exit code {process.returncode}): {log.name}"
                )
        time.sleep(1)
    os.chdir(ROOT)  # the tasks' flags name files under the repository root
    results = {"machine": machine_name("cpu"), "torch": torch.__version__, "args": vars(args), "runs": {}}
    updates = list(range(0, args.updates + 1, args.eval_every))
    flags = TASKS[args.task]["flags"]
    sft = os.path.join(ROOT, flags[flags.index("--model") + 1])
    start_metrics = {seed: evaluate(sft, seed, args.task) for seed in args.seeds}  # update 0: the SFT policy
    if args.task == "distill":  # the teacher's own held-out accuracy, by the same evaluation, what the student nears
        results["teacher"] = [
            evaluate(os.path.join(ROOT, TEACHER), seed, args.task)["eval/accuracy"] for seed in args.seeds
        ]
    for kind in ["ours", *args.trl]:
        for seed in args.seeds:
            out = run_dir(args, kind, seed)
            with open(os.path.join(out, "times.json")) as f:
                seconds = json.load(f)["s_per_update"]
            metrics = [start_metrics[seed]]
            for update in updates[1:]:
                metrics.append(evaluate(os.path.join(out, f"checkpoint-{update}"), seed, args.task))
                accuracy = metrics[-1]["eval/accuracy"]
                print(f"{kind} seed {seed} update {update}: held-out accuracy {accuracy:.3f}", flush=True)
            results["runs"][f"{kind}-{seed}"] = {
                "kind": kind,
                "seed": seed,
                "updates": updates,
                "accuracy": [m["eval/accuracy"] for m in metrics],
                "s_per_update": seconds,
            }
            if args.task in ("calc", "guess"):  # held-out tool calls per response (guesses per game)
                results["runs"][f"{kind}-{seed}"]["calls"] = [m["eval/tools/call_frequency"] for m in metrics]
    return results


def mean_and_each(values):
    """'mean (each, seed by seed)', two decimals."""
    return f"{np.mean(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"


def table(results, out_dir):
    """trl_learning.md and trl_learning.png from the results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    kinds = [kind for kind in NAMES if any(r["kind"] == kind for r in runs.values())]
    updates = next(iter(runs.values()))["updates"]
    shown = [u for u in updates if u % 50 == 0]
    header = "| run | seeds | " + " | ".join(f"update {u}" for u in shown) + " | s / update |"
    lines = [
        "Held-out accuracy (`grpo_llm.py --eval-only` of each saved policy: the 256 problems of "
        "assets/sums/test.jsonl at temperature 1), mean and (each seed); seconds per update: the median over every "
        f"update of every seed, wall clock of the training loop. Machine: {results['machine']}, torch "
        f"{results['torch']}, fp32, one torch thread a run, two at a time (ours beside stock TRL, seed by seed, then "
        "the two patched runs). Command: "
        "`python benchmarks/trl_learning.py`",
        "",
        header,
        "|---|---|" + "---|" * (len(shown) + 1),
    ]
    for kind in kinds:
        mine = [r for r in runs.values() if r["kind"] == kind]
        cells = []
        for u in shown:
            values = [r["accuracy"][r["updates"].index(u)] for r in mine]
            cells.append(mean_and_each(values))
        seconds = np.median([s for r in mine for s in r["s_per_update"]])
        lines.append(f"| {NAMES[kind]} | {len(mine)} | {' | '.join(cells)} | {seconds:.2f} |")
    write_table("trl_learning.md", "\n".join(lines), out_dir)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, color in zip(kinds, ["C0", "C3", "C2"]):
        mine = [r for r in runs.values() if r["kind"] == kind]
        for r in mine:
            ax.plot(r["updates"], r["accuracy"], color=color, alpha=0.35, lw=1)
        ax.plot(updates, np.mean([r["accuracy"] for r in mine], 0), color=color, lw=2, label=NAMES[kind])
    ax.set(xlabel="updates (8 prompts x 8 completions each)", ylabel="held-out accuracy (grpo_llm.py --eval-only)")
    ax.set_title("GRPO on the trace task: ours and TRL 1.16 at the same configuration (CPU, fp32)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "trl_learning.png"), dpi=90)
    return "\n".join(lines)


def calc_table(results, out_dir):
    """trl_calc.md from the results of the calculator task."""
    runs = results["runs"]
    kinds = [kind for kind in CALC_NAMES if any(r["kind"] == kind for r in runs.values())]
    updates = next(iter(runs.values()))["updates"]
    header = "| run | seeds | accuracy, " + " | ".join(f"update {u}" for u in updates)
    header += f" | calls per response, update 0 | update {updates[-1]} | s / update |"
    lines = [
        "Held-out accuracy (`grpo_llm.py --eval-only` of each saved policy with `--tools calculator`: the 256 problems "
        "of assets/calc/test.jsonl at temperature 1 through the tool loop), mean and (each seed); calls per response: "
        "its `eval/tools/call_frequency`; seconds per update: the median over every update of every seed, wall clock "
        f"of the training loop. Machine: {results['machine']}, torch {results['torch']}, fp32, one torch thread a "
        f"run, {results['args']['jobs']} at a time on 2 cores shared with other work. Command: "
        f"`python benchmarks/trl_learning.py --task calc --trl {' '.join(results['args']['trl'])} --seeds "
        f"{' '.join(map(str, results['args']['seeds']))} --updates {results['args']['updates']} --eval-every "
        f"{results['args']['eval_every']}`",
        "",
        header,
        "|---|---|" + "---|" * (len(updates) + 3),
    ]
    for kind in kinds:
        mine = [r for r in runs.values() if r["kind"] == kind]
        cells = []
        for key, indices in [("accuracy", range(len(updates))), ("calls", [0, len(updates) - 1])]:
            for i in indices:
                values = [r[key][i] for r in mine]
                cells.append(mean_and_each(values))
        seconds = np.median([s for r in mine for s in r["s_per_update"]])
        lines.append(f"| {CALC_NAMES[kind]} | {len(mine)} | {' | '.join(cells)} | {seconds:.2f} |")
    write_table("trl_calc.md", "\n".join(lines), out_dir)
    return "\n".join(lines)


def guess_table(results, out_dir):
    """trl_guess.md from the results of the guessing game: held-out success and guesses per game at every saved
    update, seconds per update, each against the optimum (bisection's 4.16 guesses)."""
    runs, a = results["runs"], results["args"]
    kinds = [kind for kind in GUESS_NAMES if any(r["kind"] == kind for r in runs.values())]
    updates = next(iter(runs.values()))["updates"]
    shown = " | ".join(f"update {u}" for u in updates) + " | s / update |"
    lines = [
        "The same class, assets/guess.py's GuessingGame unchanged, in both: `grpo_llm.py --environment "
        "assets/guess.py:GuessingGame --max-tool-calls 8` and TRL 1.16's `GRPOTrainer(environment_factory="
        "GuessingGame, max_tool_calling_iterations=8, max_completion_length=129)` without a reward function (the "
        "game's get_reward is the reward), from assets/guess-sft at the same configuration (8 prompts x 8 "
        "completions an update, learning rate 1e-4, beta 0; benchmarks.md#trl_learningpy has the mapping). Held-out: "
        "`grpo_llm.py --eval-only` of each saved policy with the same environment, the 248 games of "
        "assets/guess/test.jsonl at temperature 1; success: `eval/accuracy` (get_reward() > 0: a won game); guesses: "
        f"`eval/tools/call_frequency` (bisection: {BISECTION_GUESSES:.2f}); mean and (each seed). Seconds per update: "
        "the median over every update of every seed, wall clock of the training loop. Machine: "
        f"{results['machine']}, torch {results['torch']}, fp32, one torch thread a run, {a['jobs']} at a time on 2 "
        "cores shared with other work. Command: `python benchmarks/trl_learning.py --task guess --trl "
        f"{' '.join(a['trl'])} --seeds {' '.join(map(str, a['seeds']))} --updates {a['updates']} --eval-every "
        f"{a['eval_every']}`",
        "",
        "| run | seeds | success, " + " | ".join(f"update {u}" for u in updates) + " | guesses, " + shown,
        "|---|---|" + "---|" * (2 * len(updates) + 1),
    ]
    for kind in kinds:
        mine = [r for r in runs.values() if r["kind"] == kind]
        cells = [mean_and_each([r[key][i] for r in mine]) for key in ("accuracy", "calls") for i in range(len(updates))]
        seconds = np.median([s for r in mine for s in r["s_per_update"]])
        lines.append(f"| {GUESS_NAMES[kind]} | {len(mine)} | {' | '.join(cells)} | {seconds:.2f} |")
    write_table("trl_guess.md", "\n".join(lines), out_dir)
    return "\n".join(lines)


def distill_table(results, out_dir):
    """trl_distill.md from the results of the distillation task."""
    runs, a = results["runs"], results["args"]
    kinds = [kind for kind in DISTILL_NAMES if any(r["kind"] == kind for r in runs.values())]
    updates = next(iter(runs.values()))["updates"]
    lines = [
        f"{STUDENT} distilled on-policy from {TEACHER} (reverse KL), ours and TRL 1.16's at the same configuration "
        "(benchmarks.md#trl_learningpy has the mapping), 64 completions an update in both: ours 8 prompts x 8, TRL "
        "64 prompts x 1 (DistillationTrainer samples one completion a prompt). Held-out accuracy (`grpo_llm.py "
        "--eval-only` of each saved policy: the 256 problems of assets/arith/test.jsonl at temperature 1), mean and "
        f"(each seed); the teacher's own by the same evaluation: {mean_and_each(results['teacher'])}. Seconds per "
        "update: the median over every update of every seed, wall clock of the training loop. Machine: "
        f"{results['machine']}, torch {results['torch']}, fp32, one torch thread a run, {a['jobs']} at a time on 2 "
        "cores shared with other work. Command: `python benchmarks/trl_learning.py --task distill --seeds "
        f"{' '.join(map(str, a['seeds']))} --updates {a['updates']} --eval-every {a['eval_every']}`",
        "",
        "| run | seeds | " + " | ".join(f"update {u}" for u in updates) + " | s / update |",
        "|---|---|" + "---|" * (len(updates) + 1),
    ]
    for kind in kinds:
        mine = [r for r in runs.values() if r["kind"] == kind]
        cells = [mean_and_each([r["accuracy"][i] for r in mine]) for i in range(len(updates))]
        seconds = np.median([s for r in mine for s in r["s_per_update"]])
        lines.append(f"| {DISTILL_NAMES[kind]} | {len(mine)} | {' | '.join(cells)} | {seconds:.2f} |")
    write_table("trl_distill.md", "\n".join(lines), out_dir)
    return "\n".join(lines)


def logprobs(args):
    """The log-probs of one batch (logprobs_child, in TRL's environment): trl_logprobs.json and trl_logprobs.md."""
    out = os.path.join(args.runs_dir, "logprobs")
    os.makedirs(out, exist_ok=True)
    spec = json.dumps({"kind": "logprobs", "seed": args.seeds[0], "out": out})
    env = os.environ | {"PYTHONPATH": TRL_DIR}
    done = subprocess.run(
        [sys.executable, __file__, "--child", spec], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"error: the log-probs child failed: {done.stderr.strip().splitlines()[-1]}")
    result = json.loads(done.stdout.strip().splitlines()[-1]) | {"seed": args.seeds[0]}
    with open(os.path.join(args.out_dir, "trl_logprobs.json"), "w") as f:
        json.dump(result, f, indent=1)
    return logprobs_table(result, args.out_dir)


def logprobs_table(result, out_dir):
    """trl_logprobs.md from the measurement."""
    lines = [
        f"One batch of assets/sums-sft on the first 32 prompts of {TRAIN}, 8 completions each, sampled by TRL 1.16's "
        f"generation config (seed {result['seed']}): {result['tokens']} completion tokens, "
        f"{result['tokens_of_padded_prompts']} of them in the {result['padded_prompts']} completions whose prompt was "
        "left-padded. |log p - log p at sampling| in nats per token. Command: "
        "`python benchmarks/trl_learning.py --part logprobs`",
        "",
        "| training forward | mean | mean, padded prompts | mean, unpadded prompts | max |",
        "|---|---|---|---|---|",
    ]
    labels = {
        "stock": "TRL 1.16 `_get_per_token_logps_and_entropies`, as installed",
        "fixed": "the same with position ids from the mask (this benchmark's patch)",
        "ours": "grpo_llm.py `hidden_states` + `lm_head_logprobs`",
    }
    for name, label in labels.items():
        r = result[name]
        values = [r["mean"], r["mean_padded"], r["mean_unpadded"], r["max"]]
        cells = ["-" if v is None else f"{v:.2g}" for v in values]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    write_table("trl_logprobs.md", "\n".join(lines), out_dir)
    return "\n".join(lines)


def main():
    args = tyro.cli(Args)
    if args.child:
        spec = json.loads(args.child)
        children = {"ours": ours_child, "stock": trl_child, "fixed": trl_child, "logprobs": logprobs_child}
        return children[spec["kind"]](spec)
    path = os.path.join(args.out_dir, TASKS[args.task]["name"] + ".json")
    tables = {"trace": table, "calc": calc_table, "distill": distill_table, "guess": guess_table}
    if args.task != "trace" and args.part == "logprobs":
        raise SystemExit(f"error: --part logprobs measures the trace task (got --task {args.task})")
    if args.part == "logprobs":
        return print(logprobs(args))
    if args.part == "table" and args.task != "trace":
        (results,) = saved_results(path, "--part table")
        return print(tables[args.task](results, args.out_dir))
    if args.part == "table":  # without its results a table would lose its rows: say so and write nothing
        parts = {"trl_learning.json": "", "trl_logprobs.json": " --part logprobs"}
        for name, part in parts.items():
            if not os.path.exists(os.path.join(args.out_dir, name)):
                raise SystemExit(
                    f"error: --part table: {os.path.relpath(os.path.join(args.out_dir, name))} does not exist: measure "
                    f"first (python benchmarks/trl_learning.py{part})"
                )
        with open(os.path.join(args.out_dir, "trl_logprobs.json")) as f:
            print(logprobs_table(json.load(f), args.out_dir))
        with open(path) as f:
            return print(table(json.load(f), args.out_dir))
    results = learning(args)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(tables[args.task](results, args.out_dir))


if __name__ == "__main__":
    main()
