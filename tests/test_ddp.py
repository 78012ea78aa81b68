"""Sharded data parallel under torchrun (FSDP2), on CPU with gloo: one update on 2 ranks is the one-process update over
the union of their batches, and `torchrun --nproc_per_node 2` runs each LLM script end to end."""

import ast
import copy
import inspect
import json
import os
import signal
import subprocess
import sys
import types
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import contents, saved_weights, untimed_metrics
from test_families import families  # noqa: F401 (a fixture)
from test_stops import flip_byte
from torch.distributed.tensor import DTensor
from transformers import AutoModel, AutoModelForCausalLM

import grpo_llm
import ppo_llm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "assets", "arith-sft")
CPU = torch.device("cpu")
B, Q, R = 8, 4, 6  # the union batch: 2 ranks x 4 sequences, micro-batches of 2


def union_batch():
    """A rollout batch of the union: random tokens, responses of 1 to 6 real tokens, old and reference log-probs,
    per-token advantages, values and returns, and a GRPO loss mask whose first micro-batch on rank 1 is empty."""
    g = torch.Generator().manual_seed(0)
    qr = torch.randint(3, 14, (B, Q + R), generator=g)
    mask = (torch.arange(R)[None] < torch.tensor([1, 6, 3, 6, 2, 5, 6, 4])[:, None]).float()
    loss_mask = mask * torch.tensor([1, 1, 1, 0, 0, 0, 1, 1.0])[:, None]
    batch = dict(query_responses=qr, attention_mask=torch.cat([torch.ones(B, Q), mask], 1).long(),
                 responses=qr[:, Q:], mask=mask, loss_mask=loss_mask, entropy_mask=torch.ones(B, R),
                 old_logprobs=-3 * torch.rand(B, R, generator=g),
                 ref_logprobs=-3 * torch.rand(B, R, generator=g), values=torch.randn(B, R, generator=g),
                 advantages=torch.randn(B, R, generator=g), returns=torch.randn(B, R, generator=g))  # fmt: skip
    return batch | dict(prompt_width=Q)


def ppo_models(critic):
    torch.manual_seed(0)
    policy = ppo_llm.load_model(AutoModelForCausalLM, SFT, "--model")
    critic_model = ppo_llm.load_model(AutoModel, SFT, "--model") if critic == "separate" else None
    value_head = torch.nn.Linear(policy.config.hidden_size, 1)  # random, so that the critic gets a gradient
    if dist.is_initialized():  # under torchrun: sharded (FSDP2), each rank's shards of rank 0's weights
        policy = ppo_llm.place(policy, CPU)
        if critic_model is not None:
            critic_model = ppo_llm.place(critic_model, CPU)
        value_head = ppo_llm.place(value_head, CPU)
    return [policy, critic_model, value_head]


def update(case, r):
    """One optimizer step of `case` on the rollout r, through the scripts' own accumulate_gradients and optimizer_step
    (which averages the gradients over the ranks); returns the gradients the step used, the weights after it and the
    logged loss stats, pooled over the ranks."""
    script, variant = case
    if script == "ppo":
        models = ppo_models(variant)
        args = types.SimpleNamespace(micro_batch_size=2, temperature=1.0, cast_lm_head_to_fp32=True, cliprange=0.2,
                                     cliprange_value=0.2, vf_coef=0.1, ent_coef=0.01, critic=variant)  # fmt: skip
        micro_batches = torch.arange(r["mask"].shape[0]).split(2)
        stats = ppo_llm.accumulate_gradients(*models, r, micro_batches, args, nullcontext())
        stats = {k: ppo_llm.global_mean([s[k] for s in stats]) for k in stats[0]}
    else:
        torch.manual_seed(0)
        models = [grpo_llm.load_model(AutoModelForCausalLM, SFT, "--model")]
        loss = dict(lora_r=4, loss_type="grpo") if variant == "lora" else dict(loss_type=variant)  # a frozen base
        args = grpo_llm.Args(micro_batch_size=2, epsilon_high=0.28, beta=0.04, max_new_tokens=R, **loss)
        if args.lora_r:
            models = [grpo_llm.add_lora(models[0], args)]
        if dist.is_initialized():
            models = [grpo_llm.place(models[0], CPU)]
        micro_batches = torch.arange(r["mask"].shape[0]).split(2)
        loss, stats = grpo_llm.accumulate_gradients(models[0], r, micro_batches, args, nullcontext())
        stats = {k: grpo_llm.global_mean([s[k] for s in stats]) for k in stats[0]} | {
            "loss": grpo_llm.global_mean([loss])
        }
    params = [p for m in models if m is not None for p in m.parameters() if p.requires_grad]
    optimizer, grads = torch.optim.AdamW(params, lr=1e-3, eps=1e-5, fused=True), []
    step = optimizer.step
    optimizer.step = lambda: grads.extend(whole(p.grad) for p in params) or step()  # the gradients it steps with
    ppo_llm.optimizer_step(optimizer, params, 0.5)
    return grads, [whole(p.detach()) for p in params], stats


def whole(x):
    """A tensor, or the whole of a sharded one (every rank calls it: it gathers the shards)."""
    return x.full_tensor() if isinstance(x, DTensor) else x.clone()


CASES = [
    ("ppo", "separate"),
    ("ppo", "head"),
    ("grpo", "grpo"),
    ("grpo", "dapo"),
    ("grpo", "dr_grpo"),
    ("grpo", "cispo"),
    ("grpo", "sapo"),
    ("grpo", "lora"),
]


def worker(rank, world, init_file):
    torch.set_num_threads(1)
    full = union_batch()
    expected = {case: update(case, full) for case in CASES}  # one process, the whole batch
    rewards = full["values"][:, 0]
    whitened = ppo_llm.masked_whiten(full["advantages"], full["mask"])
    group_advantages = grpo_llm.group_advantages(rewards, 2, "batch")[0]
    entropy_mask = grpo_llm.high_entropy_mask(full["advantages"], full["loss_mask"], 0.2)  # random "entropies"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ppo_llm.TORCHRUN.append(True)  # as setup() records torchrun's world, which these helpers then reduce over
    grpo_llm.TORCHRUN.append(True)
    mine = slice(rank * B // world, (rank + 1) * B // world)
    r = {k: v[mine] if torch.is_tensor(v) else v for k, v in full.items()}
    for case in CASES:
        grads, weights, stats = update(case, r)
        for got, want in zip(grads, expected[case][0]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7, msg=lambda m: f"{case} gradient: {m}")
        for got, want in zip(weights, expected[case][1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} weights: {m}")
        for key, want in expected[case][2].items():
            assert abs(stats[key] - want) < 1e-5 * (1 + abs(want)), (case, key, stats[key], want)
    # the batch statistics: whitening, score normalisation, GRPO's batch std, the top-entropy quantile, the metrics
    torch.testing.assert_close(ppo_llm.masked_whiten(r["advantages"], r["mask"]), whitened[mine])
    scores = (rewards - rewards.mean()) * torch.rsqrt(rewards.var() + 1e-8)  # the union's, Bessel (detail 13)
    ended = torch.ones(len(rewards), dtype=torch.bool)
    torch.testing.assert_close(ppo_llm.normalize_scores(rewards[mine], ended[mine], True, None, None), scores[mine])
    torch.testing.assert_close(grpo_llm.group_advantages(rewards[mine], 2, "batch")[0], group_advantages[mine])
    torch.testing.assert_close(grpo_llm.high_entropy_mask(r["advantages"], r["loss_mask"], 0.2), entropy_mask[mine])
    metrics = {"update": 3, "mean": float(rank), "n": rank + 1, "lo": rank + 5.0, "hi": rank + 0.5}
    collectives, all_gather = [], dist.all_gather
    dist.all_gather = lambda *args, **kwargs: collectives.append(1) or all_gather(*args, **kwargs)
    metrics = ppo_llm.global_metrics(metrics, {"n": "sum", "lo": "min", "hi": "max"})
    dist.all_gather = all_gather
    assert metrics == {"update": 3, "mean": 0.5, "n": 3, "lo": 5.0, "hi": 1.5}, metrics
    assert len(collectives) == 1 and type(metrics["n"]) is int  # one gather for every metric, their types kept
    # generation sharded: the policy gathered once (one all-gather per FSDP unit, none per token), the tokens of the
    # unsharded model, and ranks that stop at different lengths do not wait for each other
    prompts = full["query_responses"][mine, :Q]
    settings = dict(max_new_tokens=3 + 2 * rank, do_sample=True, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(rank)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(SFT).generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), **settings
        )
    policy = ppo_llm.place(ppo_llm.load_model(AutoModelForCausalLM, SFT, "--model"), CPU)
    gathers, all_gather = [], dist.all_gather_single
    dist.all_gather_single = lambda *args, **kwargs: gathers.append(1) or all_gather(*args, **kwargs)
    torch.manual_seed(rank)
    with torch.no_grad(), ppo_llm.unsharded(policy):
        got = policy.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), **settings)
    dist.all_gather_single = all_gather
    units = sum(isinstance(m, ppo_llm.FSDPModule) for m in policy.modules())
    assert torch.equal(got, want) and len(gathers) == units == policy.config.n_layer + 1, (len(gathers), units)

    # an error on rank 1 alone (its reward function's): every rank raises at the same point, to stop and save together
    def score():
        if rank == 1:
            raise ValueError("an odd completion")
        return [1.0]

    with pytest.raises(ppo_llm.EveryRank) as stop:
        ppo_llm.on_every_rank(score)
    assert str(stop.value) == ("an odd completion" if rank == 1 else "another rank's error")
    assert isinstance(stop.value.__cause__, ValueError) == (rank == 1)
    assert ppo_llm.on_every_rank(lambda: [2.0]) == [2.0]
    # SIGTERM seen by rank 1 alone (it only appends to STOP): both ranks stop at the same check, together
    ppo_llm.STOP.extend([signal.SIGTERM] if rank == 1 else [])
    with pytest.raises(KeyboardInterrupt, match="SIGTERM" if rank == 1 else "another rank's signal"):
        ppo_llm.stop_if_signalled()
    ppo_llm.STOP.clear()
    dist.destroy_process_group()
    # FSDP's device mesh holds the process group past destroy_process_group() (the models and DTensor's caches keep the
    # mesh), and gloo's threads live on with it; Python's finalisation can race them and abort a worker whose checks
    # all passed. So a finished worker leaves without it (the scripts' own exits: benchmarks/torchrun_stress.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.e2e
def test_two_ranks_update_equals_one_process_on_the_union_batch(tmp_path):
    # PPO (separate critic, head) and GRPO (each loss type; rank 1 has a micro-batch with no loss token: a zero
    # gradient, and NaN stats that global_mean leaves out), gloo
    mp.spawn(worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2)


GLOO_THREADS_AFTER_DESTROY = """
import os, sys, tempfile
import {script}
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])  # imports torch._dynamo, as the scripts' optimizer does
dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
names = []
for thread in os.listdir("/proc/self/task"):
    try:
        names.append(open(f"/proc/self/task/{{thread}}/comm").read().strip())
    except ProcessLookupError:  # a thread that ended after the listing (gloo's, ending): not left
        pass
print([name for name in names if "gloo" in name])
"""


@pytest.mark.e2e
def test_destroy_process_group_ends_gloos_threads():
    # torch.distributed.nn.functional's defaults (group=group.WORLD) hold the process group when that module is first
    # imported after init_process_group (torch._dynamo imports it, and an optimizer imports torch._dynamo): then
    # destroy_process_group() leaves gloo's threads running, and one that needs the GIL while Python finalises aborts
    # the process ("terminate called without an active exception") after a finished run. The scripts import it first.
    for module, threads_left in [("json", True), ("ppo_llm", False)]:  # json: nothing imported
        code = GLOO_THREADS_AFTER_DESTROY.format(script=module)
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert ("pt_gloo_runloop" in p.stdout.splitlines()[-1]) == threads_left, (module, p.stdout)
    # grpo_llm.py imports it as ppo_llm.py does, at its top, before any code runs (a process of its own: ~5 s more)
    top = ast.parse(inspect.getsource(grpo_llm)).body
    assert "import torch.distributed.nn" in [ast.unparse(node) for node in top if isinstance(node, ast.Import)]


def torchrun(*args, processes=2, ok=True):
    """torchrun with 2 processes, which must exit 0 (ok), or not; the finished process."""
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node"]
    p = subprocess.run([*command, str(processes), *args], cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"},
                       timeout=300, capture_output=True, text=True)  # fmt: skip
    assert (p.returncode == 0) == ok, p.stderr[-3000:]
    return p


@pytest.mark.e2e
def test_torchrun_two_processes_end_to_end_and_resume(tmp_path):
    # one launch per script: one run directory, one saved policy that one process loads, one metrics line per update
    # (rank 0's only); GRPO with LoRA under bf16 autocast (its base frozen and sharded, the reference) saves the
    # adapter and the merged model, and one process resumes it. Then PPO's 2 updates resumed to 3 log what 3 in one go
    # log (timings and memory aside): each update seeds every rank from (seed, update, rank), so a resumed rank samples
    # what it would have. Evaluations of 20 prompts in batches of 4: 3 batches on rank 0, 2 on rank 1, which samples
    # once more, uncounted, so that both gather the policy as often
    common = ["--eval-every", "2", "--eval-size", "20", "--sample-every", "1", "--micro-batch-size", "4"]
    ppo = ["ppo_llm.py", "--prompts-per-update", "8", "--num-mini-batches", "1", *common]
    grpo = ["grpo_llm.py", "--prompts-per-update", "4", "--num-generations", "2", *common]
    grpo += ["--lora-r", "4", "--beta", "0.1", "--learning-rate", "1e-2", "--save-merged", "--mixed-precision", "bf16"]
    for name, command in [("ppo", ppo), ("grpo", grpo)]:
        torchrun(*command, "--total-steps", "2", "--output-dir", tmp_path / name)
        (run_dir,) = (tmp_path / name).iterdir()
        lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        assert [m["update"] for m in lines] == [0, 1, 2]
        assert lines[-1]["episode"] == 16  # 8 sequences an update, counted over both ranks
        for m in lines[0], lines[2]:  # 20 prompts, each counted once: a whole number of them right
            assert abs(m["eval/accuracy"] * 20 - round(m["eval/accuracy"] * 20)) < 1e-9, m
        saved = saved_weights(run_dir, "policy")
        policy = AutoModelForCausalLM.from_pretrained(run_dir / "policy")  # a LoRA run's: transformers loads the base
        for key, value in saved.items():  # the gathered weights, as the checkpoint holds them
            assert torch.equal(policy.state_dict()[key.removeprefix("base_model.model.")], value)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "policy" / "merged")
    assert merged.num_parameters() == policy.num_parameters() - sum(v.numel() for v in saved.values())
    assert grpo_llm.main(grpo_llm.parse_args(["--resume", str(run_dir), "--total-steps", "3"])) == str(run_dir)
    assert [m["update"] for m in untimed_metrics(run_dir)] == [0, 1, 2, 3]  # two processes, then one
    # --eval-only, 20 prompts x 4 greedy samples in batches of 3 a rank (27: rank 1 samples once more, uncounted): each
    # prompt counted once, as in one process
    evaluation = ["--eval-only", "--eval-size", "20", "--eval-num-generations", "4", "--eval-temperature", "0"]
    out = torchrun("ppo_llm.py", *evaluation, "--prompts-per-update", "6", "--num-mini-batches", "1").stdout
    one = ppo_llm.main(ppo_llm.parse_args([*evaluation, "--prompts-per-update", "4"]))
    table = out[out.index("20 held-out prompts, 4 samples each, greedy:") :].splitlines()
    assert table[0].endswith("greedy:") and f"held-out accuracy {one['eval/accuracy']:.3f}" in table[1]
    assert [line.split() for line in table[2:]] == [[k.removeprefix("eval/"), f"{v:.3f}"] for k, v in one.items()][2:]

    ((split,),) = [list((tmp_path / "ppo").iterdir())]
    # each rank hashed the shard it wrote, rank 0 the rest; a byte flipped in rank 1's shard, which rank 1 verifies,
    # is refused by name on every rank (one all-reduce), in rank 0's line
    shard = split / "checkpoint" / "__1_0.distcp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json", "policy/model.safetensors"} <= set(
        json.load(open(split / "checkpoint" / "checksums.json"))
    )
    flip_byte(shard)
    refused = torchrun("ppo_llm.py", "--resume", split, "--total-steps", "3", ok=False)
    assert refused.stderr.count(f"error: --resume {split}: {shard} is damaged or missing") >= 1
    flip_byte(shard)
    os.rename(shard, f"{shard}.gone")  # missing: refused by name alike (it was rank 1's FileNotFoundError alone)
    refused = torchrun("ppo_llm.py", "--resume", split, "--total-steps", "3", ok=False)
    assert refused.stderr.count(f"error: --resume {split}: {shard} is damaged or missing") >= 1
    os.rename(f"{shard}.gone", shard)
    torchrun("ppo_llm.py", "--resume", split, "--total-steps", "3")
    torchrun(*ppo, "--total-steps", "3", "--output-dir", tmp_path / "whole")
    ((whole,),) = [list((tmp_path / "whole").iterdir())]
    assert [m["update"] for m in untimed_metrics(split)] == [0, 1, 2, 3]
    assert untimed_metrics(split) == untimed_metrics(whole)


def test_process_group_waits_an_hour_for_rank_0(monkeypatch):
    # NCCL's default timeout is 10 minutes (gloo's 30), and rank 0 alone checks a model's logits or merges LoRA's
    # adapters while the others wait in a collective: at 7B or 70B that can take longer
    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise RuntimeError("recorded")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="recorded"):
        ppo_llm.setup(ppo_llm.Args(cuda=False))
    assert seen["backend"] == "gloo" and seen["timeout"].total_seconds() == 3600 and seen["device_id"] is None


def test_args_json_holds_the_flags_as_given_so_a_resume_derives_the_rest(tmp_path):
    # --micro-batch-size as given (64), not the cap this launch derived from its share of the prompts (12): a run
    # resumed on another number of processes derives it from its own share (the end-to-end run above goes from 2 to 1)
    flags = dict(prompts_per_update=12, num_mini_batches=1, eval_every=0, sample_every=0, total_steps=1)
    run_dir = ppo_llm.main(ppo_llm.Args(**flags, output_dir=str(tmp_path)))
    assert json.load(open(os.path.join(run_dir, "args.json")))["micro_batch_size"] == 64


@pytest.mark.e2e
def test_a_refusal_under_torchrun_is_one_line_once_and_torchruns_report_gives_it():
    # every rank refuses 3 processes for 8 prompts: rank 0 alone prints the line, and each rank's error file makes it
    # torchrun's report (not error_file <N/A>)
    p = torchrun("ppo_llm.py", "--prompts-per-update", "8", processes=3, ok=False)
    message = "error: 3 processes must divide --prompts-per-update"
    assert [line for line in p.stderr.splitlines() if line.startswith("error")] == [message]
    assert f"traceback : {message}" in p.stderr and "<N/A>" not in p.stderr


@pytest.mark.e2e
def test_a_resume_beside_a_live_run_refuses_on_every_rank(tmp_path):
    # this process owns a run directory, as a live run does; a 2-process torchrun --resume on it: rank 0 finds the
    # lock taken, every rank refuses (rank 0 alone prints the line, which torchrun's report gives), nothing changes
    flags = dict(total_steps=1, prompts_per_update=4, eval_every=0, sample_every=0, output_dir=str(tmp_path))
    run_dir = ppo_llm.main(ppo_llm.Args(**flags))
    ppo_llm.own_run(ppo_llm.Args(resume=run_dir), 0)
    try:
        files = contents(run_dir)
        p = torchrun("ppo_llm.py", "--resume", run_dir, "--total-steps", "2", ok=False)
        now = contents(run_dir)
    finally:
        ppo_llm.LOCK.close()
    message = f"error: {run_dir} is in use by process {os.getpid()} on {os.uname().nodename} (one process at a time)"
    assert [line for line in p.stderr.splitlines() if line.startswith("error")] == [message]
    assert f"traceback : {message}" in p.stderr and now == files


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_processes_must_divide_the_prompts(script):
    with pytest.raises(SystemExit) as e:
        script.check_args(script.Args(prompts_per_update=8), 3)  # torchrun --nproc_per_node 3
    assert str(e.value) == "error: 3 processes must divide --prompts-per-update"


def family_outputs(args):
    """Every model the scripts load for `args` (policy, reference, reward model, critic, value head), through their
    own loading, and each one's output on fixed ids (whole on every rank, as the one-process model's)."""
    cpu = torch.device("cpu")
    tokenizer, policy, reward_model, rm_tokenizer = ppo_llm.load_models(args, cpu)
    critic, value_head = ppo_llm.build_value_model(args, cpu, policy, tokenizer, reward_model, rm_tokenizer)
    ref_policy = policy if args.lora_r else ppo_llm.frozen_copy(policy, cpu, bf16=False)  # as main() makes it
    models = {"policy": policy, "ref_policy": ref_policy, "critic": critic}
    models["reward_model"] = reward_model
    ids = torch.arange(3, 13)[None] % len(tokenizer)
    outputs = {"eos_ids": torch.tensor(policy.generation_config.eos_token_id)}
    with torch.no_grad():
        for name, model in models.items():
            if model is None:
                continue
            with ppo_llm.unsharded(model):
                out = model(input_ids=ids)
            outputs[name] = out.logits if hasattr(out, "logits") else out.last_hidden_state
        with ppo_llm.unsharded(value_head):
            outputs["value_head"] = value_head(torch.ones(1, value_head.in_features))
    return outputs


BF16_GAP = 0.005  # nats: measured 0.0011 (the Llama below, 2 ranks, torch 2.13 on a CPU)


def bf16_logprobs(path):
    """The response log-probs of the union batch under bf16 autocast, with the script's --mixed-precision bf16."""
    args = ppo_llm.Args(model=path, max_new_tokens=4, mixed_precision="bf16")
    tokenizer, policy, *_ = ppo_llm.load_models(args, torch.device("cpu"))
    if dist.is_initialized():
        with ppo_llm.unsharded(policy):  # the gathered copy
            assert policy.get_output_embeddings().weight.dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), ppo_llm.unsharded(policy):
        _, logprobs, _ = ppo_llm.policy_forward(policy, union_batch(), torch.arange(B), args)
    return logprobs


FAMILIES = {  # the test's families, each with models that exercise one loading path
    "gpt2": dict(reward_model="rm"),  # tied embeddings; a reward model, and the critic from it (same tokenizer)
    "llama": dict(lora_r=4),  # rotary (inv_freq, in no state dict), its own generation_config; LoRA on a frozen base
    "qwen2": dict(),  # saved in bf16, 30 spare embedding rows, a [PAD] added
    "gemma2": dict(critic="head"),  # bf16, soft-capped logits, tied embeddings
}


def family_worker(rank, world, init_file, paths):
    torch.set_num_threads(1)
    arguments = {
        family: ppo_llm.Args(model=paths[family], max_new_tokens=4, mixed_precision="no", **flags)
        for family, flags in FAMILIES.items()
    }
    for args in arguments.values():
        if args.reward_model:
            args.reward_model = paths[args.reward_model]
    expected = {family: family_outputs(copy.deepcopy(args)) for family, args in arguments.items()}
    want_bf16 = bf16_logprobs(paths["llama"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ppo_llm.TORCHRUN.append(True)  # as setup() records torchrun's world, which these helpers then reduce over
    grpo_llm.TORCHRUN.append(True)
    # rank 1 reads no weights: its models are built on the meta device, and rank 0 sends it its shards
    skeleton = ppo_llm.load_model(AutoModelForCausalLM, paths["llama"], "--model")
    assert {p.device.type for p in skeleton.parameters()} == ({"cpu"} if rank == 0 else {"meta"})
    for family, args in arguments.items():
        got = family_outputs(copy.deepcopy(args))
        assert got.keys() == expected[family].keys(), (family, got.keys())
        for name, want in expected[family].items():
            # equal: 0 apart, but the reward model's score (7e-9, fp32 rounding)
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-7, msg=lambda m: f"{family} {name}: {m}")
    # bf16 autocast: FSDP gathers bf16 copies of the fp32 shards, on which generation and the forwards run; the
    # log-probs against one process's under the same autocast (fp32 weights, bf16 matmuls): close, not equal
    got = bf16_logprobs(paths["llama"])
    gap = (got - want_bf16).abs().max().item()
    assert 0 < gap < BF16_GAP, gap
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as worker() does


@pytest.mark.e2e
def test_two_ranks_load_every_model_as_one_process_does(families, tmp_path):  # noqa: F811
    mp.spawn(family_worker, args=(2, str(tmp_path / "rendezvous"), families), nprocs=2)
