"""--environment: TRL's environment_factory contract in both LLM scripts (an instance an episode, reset with its row,
its public methods the tools, get_reward the episode's total) and ours beyond it, each turn's reward (turn_rewards),
which PPO puts on the turn's last token for its critic to credit. The episodes are the calculator task's scripted turns
(tests/test_tools.py), played through an environment the tests write, whose tool is named calculator."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import untimed_metrics
from test_tools import SCRIPT, WRAPPER, calc, scripted  # noqa: F401  calc: the fixture

import grpo_llm
import ppo_llm

DESK = '''
import asyncio, json, os, signal


def note(*event):  # the tests read what happened, in order, from DESK_LOG
    with open(os.environ["DESK_LOG"], "a") as f:
        f.write(json.dumps([os.getpid(), *event]) + "\\n")


class Desk:
    """A calculator that remembers its episode: a call that gives the row's answer earns its turn 0.5, any other
    -0.25; the episode's total is the turns' rewards, plus 1 once the answer has been given."""

    made = 0

    def __init__(self):
        Desk.made += 1
        self.number, self.turn_rewards, self.row = Desk.made, [], None
        note("made", self.number)

    def reset(self, **row):
        if row["prompt"] == os.environ.get("DESK_BAD_ROW"):
            raise ValueError("no desk for this one")
        self.row, self.given, self.turn_rewards = row, False, []
        note("reset", self.number, row["prompt"])

    def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: the expression, as 37*85
        """
        note("call", self.number, expression)
        if os.environ.get("DESK_SIGTERM") == expression:
            os.kill(os.getpid(), signal.SIGTERM)
        value = eval(expression, {})
        self.given = self.given or str(value) == self.row["answer"]
        self.turn_rewards.append(0.5 if str(value) == self.row["answer"] else -0.25)
        return value  # an int: str()'d, as TRL does

    def get_reward(self) -> float:
        return sum(self.turn_rewards) + float(self.given)


class AsyncDesk(Desk):
    async def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression, awaited.

        Args:
            expression: the expression, as 37*85
        """
        await asyncio.sleep(0)
        return Desk.calculator(self, expression)


class NoReset:
    def step(self, x: int) -> str:
        """A step.

        Args:
            x: a number
        """
        return str(x)


SEVERAL = {"desk": Desk}
'''
RECORD = '''
import json, os


def record(completions, prompts, answer, environments, **columns):
    """arithmetic's scores; to DESK_LOG: each episode's instance and the row it was reset with."""
    with open(os.environ["DESK_LOG"], "a") as f:
        f.write(json.dumps([os.getpid(), "scored", [e.number for e in environments], prompts,
                            [e.row["prompt"] for e in environments]]) + "\\n")
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


@pytest.fixture
def desk(tmp_path, monkeypatch):
    (tmp_path / "desk.py").write_text(DESK)
    (tmp_path / "record.py").write_text(RECORD)
    monkeypatch.setenv("DESK_LOG", str(tmp_path / "desk.log"))
    return {"env": f"{tmp_path / 'desk.py'}:Desk", "record": f"{tmp_path / 'record.py'}:record"} | {
        "file": str(tmp_path / "desk.py"),
        "log": tmp_path / "desk.log",
    }


def events(desk):
    return [json.loads(line) for line in open(desk["log"])] if desk["log"].exists() else []


def desk_run(script, calc, desk, tmp_path, monkeypatch, **kwargs):  # noqa: F811  calc: the fixture
    """main() on the 4 scripted problems through the Desk environment, each turn after a real generate()."""
    monkeypatch.setenv("SCRIPTED_TOKENIZER", calc["policy"])
    scripted(monkeypatch, sample=True)
    defaults = dict(
        model=calc["policy"], dataset=calc["train"], environment=desk["env"], max_tool_calls=1, total_steps=2,
        prompts_per_update=4, micro_batch_size=2, max_new_tokens=160, eval_every=2, sample_every=1, num_samples=4,
        learning_rate=0.0, output_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    if script is ppo_llm:
        defaults |= dict(num_mini_batches=2, kl_coef=0.0)
    return script.main(script.Args(**(defaults | kwargs)))


def test_turn_rewards_on_each_turns_last_token_are_credited_by_gae():
    # a 3-turn episode: turn 1 (2 tokens), a tool's result (mask 0), turn 2 (2 tokens), a result, turn 3 (1 token).
    # Turn 1 earned 0.5 and turn 2 -0.25, on their last tokens; the rest of the score, 1.0, on the last. gamma 1,
    # lam 0.5, V = 0.1 0.2 _ 0.3 0.4 _ 0.5; from the end, delta_t = r_t + V_t' - V_t (t' the next policy token):
    #   t6: 1.0 - 0.5 = 0.5                                    A6 = 0.5
    #   t4: -0.25 + 0.5 - 0.4 = -0.15                          A4 = -0.15 + 0.5 * 0.5 = 0.1
    #   t3: 0 + 0.4 - 0.3 = 0.1                                A3 = 0.1 + 0.5 * 0.1 = 0.15
    #   t1: 0.5 + 0.3 - 0.2 = 0.6                              A1 = 0.6 + 0.5 * 0.15 = 0.675
    #   t0: 0 + 0.2 - 0.1 = 0.1                                A0 = 0.1 + 0.5 * 0.675 = 0.4375
    # The same 1.25 summed on the last token gives turn 1's last token 0.26875 (A6 = 0.75, A4 = 0.475, A3 = 0.3375,
    # A1 = 0.1 + 0.5 * 0.3375): per-turn rewards move the credit to the turn that earned it
    mask = torch.tensor([[1.0, 1, 0, 1, 1, 0, 1]])
    values = torch.tensor([[0.1, 0.2, 0.0, 0.3, 0.4, 0.0, 0.5]])
    per_turn = torch.tensor([[0.0, 0.5, 0, 0, -0.25, 0, 1.0]])
    advantages, returns = ppo_llm.compute_gae(per_turn, values, mask, 1.0, 0.5)
    assert torch.allclose(advantages, torch.tensor([[0.4375, 0.675, 0, 0.15, 0.1, 0, 0.5]]))
    assert torch.allclose(returns, torch.tensor([[0.5375, 0.875, 0, 0.45, 0.5, 0, 1.0]]))
    summed, _ = ppo_llm.compute_gae(torch.tensor([[0.0, 0, 0, 0, 0, 0, 1.25]]), values, mask, 1.0, 0.5)
    assert torch.allclose(summed, torch.tensor([[0.234375, 0.26875, 0, 0.3375, 0.475, 0, 0.75]]))


def test_ppo_puts_each_turns_reward_on_its_last_token_and_the_rest_at_the_end(calc, desk, tmp_path, monkeypatch):  # noqa: F811
    # 6*7: a call that gives 42 (turn 1 earns 0.5), then the answer 42: get_reward 0.5 + 1 = 1.5, arithmetic's 1, the
    # score 2.5, of which 2.0 goes on the last token (KL 0: lr 0, --kl-coef 0). 5*5 answers 24 directly: no turn
    # reward, get_reward 0, arithmetic 0. The metrics name the environment and count its turns
    seen, real = [], ppo_llm.compute_gae
    monkeypatch.setattr(ppo_llm, "compute_gae", lambda r, v, m, *a: seen.append((r, m)) or real(r, v, m, *a))
    run_dir = desk_run(ppo_llm, calc, desk, tmp_path, monkeypatch, reward_fn=desk["record"], max_tool_calls=1)
    tok = ppo_llm.AutoTokenizer.from_pretrained(calc["policy"])
    call_length = len(tok(SCRIPT["6*7"][0]).input_ids) + 1  # and its EOS; 9*9's call is as long
    for rewards, mask in seen:  # each update has the 4 problems
        rests = []
        for row, token_mask in zip(rewards, mask):
            nonzero = {i: round(v, 6) for i, v in enumerate(row.tolist()) if v}
            if nonzero.get(call_length - 1) == 0.5:  # a call that gave the answer: its turn's reward, on its last token
                assert len(nonzero) == 2 and int(token_mask.nonzero().max()) in nonzero
                rests.append(nonzero[int(token_mask.nonzero().max())])
        assert sorted(rests) == [1.0, 2.0]  # 9*9, cut off on its 2nd call: 0 + 1.5 - 0.5; 6*7: 1 + 1.5 - 0.5
    metrics = untimed_metrics(run_dir)
    # get_reward: 6*7 1.5; 5*5 (no call) 0; 2*3 (a malformed call, which never reaches the Desk) 0; 9*9 (a call giving
    # 81, 0.5, then cut off on its second) 0.5 + 1 = 1.5: the mean 0.75. Turns: 2 + 1 + 2 + 2 over 4
    assert [m["rewards/Desk/mean"] for m in metrics[1:]] == [0.75, 0.75] and metrics[1]["tools/mean_turns"] == 1.75
    assert metrics[0]["eval/accuracy"] == 0.5 and "eval/mean_reward" in metrics[0]


def test_every_episode_has_its_own_instance_reset_with_its_row(calc, desk, tmp_path, monkeypatch):  # noqa: F811
    # GRPO, 2 prompts x G 2 a batch: 4 instances made once and pooled across updates and evaluation; before every
    # rollout each is reset with its own row (a group's two with the same one); the reward function gets each
    # episode's instance (environments=), reset with that episode's row, and each instance serves one episode at once
    desk_run(grpo_llm, calc, desk, tmp_path, monkeypatch, reward_fn=(desk["record"],), prompts_per_update=2,
             num_generations=2, eval_every=0)  # fmt: skip
    log = events(desk)
    assert [e[2] for e in log if e[1] == "made"] == [1, 2, 3, 4]  # the first made by load_environment, to check it
    scored = [e for e in log if e[1] == "scored"]
    assert len(scored) == 2
    for _, _, numbers, prompts, reset_with in scored:
        assert sorted(numbers) == [1, 2, 3, 4] and prompts == reset_with  # distinct, each reset with its row
        assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # a group shares its row
    for start in [i for i, e in enumerate(log) if e[1] == "reset" and e[2] == 1]:  # each rollout: 4 resets first
        assert [e[1] for e in log[start : start + 4]] == ["reset"] * 4


def test_rewards_without_a_reward_function_and_the_refusals(desk, capsys):
    # get_reward alone is the reward; a reward function named beside it adds one more source (GRPO's weights count
    # the functions only); a class that cannot be a TRL environment is refused in one line, before any model loads
    args = ppo_llm.Args(environment=desk["env"])
    tools, environment = ppo_llm.load_environment(args)
    assert list(tools) == ["calculator"] and environment.scores and len(environment.pool) == 1
    (get_reward,) = ppo_llm.load_reward_fns(args, environment)
    environment.pool[0].turn_rewards = [0.5, -0.25]
    environment.pool[0].given = True
    assert get_reward(["x"], [{}], ["x"], environment.pool) == [1.25]  # 0.5 - 0.25 + 1
    assert len(ppo_llm.load_reward_fns(ppo_llm.Args(environment=desk["env"], reward_fn="arithmetic"), environment)) == 2
    for name in ["NoReset", "SEVERAL", "Missing"]:  # no reset; a dict of several (TRL's, by a column); no such name
        with pytest.raises(SystemExit, match=f"^error: --environment {re.escape(desk['file'])}:{name}"):
            ppo_llm.load_environment(ppo_llm.Args(environment=f"{desk['file']}:{name}"))
    why = "is not a class with a reset(**row) method (TRL's environment_factory; a dict of several: not yet)"
    with pytest.raises(SystemExit, match=re.escape(why)):
        ppo_llm.load_environment(ppo_llm.Args(environment=f"{desk['file']}:SEVERAL"))
    no_reward = f"{desk['file']}:NoReward"
    with open(desk["file"], "a") as f:
        f.write("\n\nclass NoReward(Desk):\n    get_reward = None\n")
    _, environment = ppo_llm.load_environment(ppo_llm.Args(environment=no_reward))
    with pytest.raises(SystemExit, match="has no get_reward and no --reward-fn is given: nothing scores its episodes"):
        ppo_llm.load_reward_fns(ppo_llm.Args(environment=no_reward), environment)
    with pytest.raises(SystemExit, match="scores with get_reward: use --reward-fn beside it, not --reward-model"):
        ppo_llm.load_reward_fns(ppo_llm.Args(environment=desk["env"], reward_model="rm"), environment_with_reward(desk))


def test_eval_only_scores_held_out_episodes_with_get_reward(calc, desk, tmp_path, monkeypatch):  # noqa: F811
    # no --reward-fn needed: the environment's get_reward scores the held-out episodes, as in training
    result = desk_run(grpo_llm, calc, desk, tmp_path, monkeypatch, eval_only=True, eval_size=4)
    assert result["eval/accuracy"] == 0.5 and "eval/mean_reward" in result


def environment_with_reward(desk):
    return ppo_llm.load_environment(ppo_llm.Args(environment=desk["env"]))[1]


@pytest.mark.parametrize("value, why", [(None, "None"), (float("nan"), "nan"), ("1.0", "'1.0'")])
def test_a_get_reward_with_no_number_or_past_its_timeout_is_one_line(desk, value, why):
    environment = environment_with_reward(desk)
    get_reward = ppo_llm.load_reward_fns(ppo_llm.Args(environment=desk["env"], reward_timeout=0.5), environment)[0]
    environment.pool[0].get_reward = lambda: value
    source = f"--environment {desk['env']}'s get_reward()"
    with pytest.raises(
        SystemExit, match=f"^error: {re.escape(source)} scored 1 of 1 completions with no finite number .*{why}"
    ):
        get_reward(["x"], [{}], ["x"], environment.pool)
    environment.pool[0].get_reward = lambda: __import__("time").sleep(30)
    with pytest.raises(ppo_llm.TimedOut, match="'s get_reward ran past 0.5 s"):
        get_reward(["x"], [{}], ["x"], environment.pool)


def test_a_tool_method_that_raises_times_out_or_is_async_is_a_call_the_policy_reads(desk):
    # the environment's methods are tools as --tools' functions are: an error or --tool-timeout is a failed call
    # whose error the policy reads; an async one is awaited; an int result is str()'d
    from test_tools import compact_tokenizer

    tok = compact_tokenizer()
    _, environment = ppo_llm.load_environment(ppo_llm.Args(environment=f"{desk['file']}:AsyncDesk"))
    instance = environment.pool[0]
    instance.reset(prompt="6*7", answer="42")
    call = {"function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
    bad = {"function": {"name": "calculator", "arguments": {"expression": "6/0"}}}
    ids, failed, messages = ppo_llm.run_tools(tok, ppo_llm.environment_tools(instance), [call, bad], 5, [1], 1000)
    assert failed == 1 and [m["content"] for m in messages] == [
        "42",
        "{'error': 'ZeroDivisionError: division by zero'}",
    ]
    assert instance.turn_rewards == [0.5]
    instance.calculator = lambda expression: __import__("time").sleep(30)  # past --tool-timeout 0.5: a failed call
    _, failed, messages = ppo_llm.run_tools(tok, {"calculator": instance.calculator}, [call], 0.5, [1], 1000)
    assert failed == 1 and messages[0]["content"] == "{'error': 'TimedOut: tool calculator ran past 0.5 s'}"


def test_a_reset_that_raises_stops_the_run_in_one_line_with_its_checkpoint(calc, desk, tmp_path, monkeypatch, capsys):  # noqa: F811
    # the rows come in a seeded order; 2*3's reset raises, and a run stops where it first meets it, as after any error
    monkeypatch.setenv("DESK_BAD_ROW", "2*3")
    with pytest.raises(SystemExit) as stop:
        desk_run(ppo_llm, calc, desk, tmp_path, monkeypatch, prompts_per_update=2, total_steps=4, eval_every=0)
    (run_dir,) = (tmp_path / "runs").iterdir()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    why = f"error: --environment {desk['env']}: reset() raised on the row {{'prompt': '2*3', 'answer': '6'}}"
    assert stop.value.code == 1 and f"({why} (ValueError: no desk for this one))" in line, line
    assert "the state after update" in line and os.path.isdir(run_dir / "checkpoint")


def test_a_stop_in_the_middle_of_an_episode_cuts_it_off_and_the_resume_resets_afresh(calc, desk, tmp_path, monkeypatch):  # noqa: F811
    # SIGTERM inside update 2's 6*7 call (6*7 comes there in this seed's order): the episode is cut off, the update
    # logs nothing, the state after update 1 is saved; the resume plays update 2 again, each episode reset first
    monkeypatch.setenv("DESK_SIGTERM", "6*7")
    with pytest.raises(SystemExit) as stop:
        desk_run(ppo_llm, calc, desk, tmp_path, monkeypatch, prompts_per_update=2, total_steps=2, eval_every=0)
    assert stop.value.code == 128 + signal.SIGTERM
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [m["update"] for m in untimed_metrics(run_dir)] == [1]
    monkeypatch.delenv("DESK_SIGTERM")
    stopped_at = len(events(desk))
    assert ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir)])) == str(run_dir)
    resumed = [e[1] for e in events(desk)[stopped_at:] if e[1] in ("reset", "call")]
    assert resumed[:2] == ["reset", "reset"] and [m["update"] for m in untimed_metrics(run_dir)] == [1, 2]


@pytest.mark.e2e
def test_two_ranks_each_play_their_own_rows_episodes(calc, desk, tmp_path):  # noqa: F811
    # and distil from a teacher, sharded under torchrun as a reward model is: here the student itself, whose reverse
    # KL is then 0 on both ranks
    tests = os.path.dirname(os.path.abspath(__file__))
    wrapper = tmp_path / "scripted.py"
    wrapper.write_text(WRAPPER.format(tests=tests, root=os.path.dirname(tests)))
    flags = ["--model", calc["policy"], "--dataset", calc["train"], "--environment", desk["env"], "--max-tool-calls"]
    flags += ["1", "--prompts-per-update", "4", "--num-mini-batches", "1", "--max-new-tokens", "160"]
    flags += [
        "--eval-every",
        "0",
        "--total-steps",
        "1",
        "--output-dir",
        str(tmp_path / "runs"),
        "--teacher",
        calc["policy"],
    ]
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "SCRIPTED_TOKENIZER": calc["policy"]}
    done = subprocess.run([*torchrun, str(wrapper), "ppo_llm.py", *flags], env=env, timeout=300, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    log = events(desk)
    pids = {e[0] for e in log}
    assert len(pids) == 2  # each rank its own instances, 1 checked + 2 episodes' (the first reused)
    for pid in pids:
        assert [e[2] for e in log if e[0] == pid and e[1] == "made"] == [1, 2]
        assert len([e for e in log if e[0] == pid and e[1] == "reset"]) == 2
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert untimed_metrics(run_dir)[0]["distill/reverse_kl"] == 0.0


def test_the_docs_example_environment_runs_as_written(tmp_path):
    # docs/grpo_llm.md's Counter: reset appends to the user's message, each increment is a turn rewarded -0.1, and
    # get_reward is their sum plus 1 at the target: 2 + 3 = 5 in two turns, -0.1 - 0.1 + 1 = 0.8
    from test_docs import block

    code = block(
        "grpo_llm.md",
        "# my_game.py                 python grpo_llm.py --environment my_game.py:Counter --model ... --dataset ...",
    )
    (tmp_path / "my_game.py").write_text(code)
    tools, environment = ppo_llm.load_environment(ppo_llm.Args(environment=f"{tmp_path / 'my_game.py'}:Counter"))
    counter = environment.pool[0]
    assert list(tools) == ["increment"] and counter.reset(prompt="count", target="5") == " Count to 5."
    assert [counter.increment(2), counter.increment(7)] == ["2", "5"]
    assert counter.get_reward() == pytest.approx(0.8)


def test_a_teacher_grades_the_policys_tokens_of_an_episode_never_a_tools(calc, desk, tmp_path, monkeypatch):  # noqa: F811
    # --teacher with an environment: another random model with the calc policy's tokenizer grades each token the
    # policy sampled; a tool's result (mask 0) gets no reward, and the reverse KL is logged
    torch.manual_seed(1)
    teacher = ppo_llm.AutoModelForCausalLM.from_pretrained(calc["policy"])
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.02)
    teacher.save_pretrained(tmp_path / "teacher")
    ppo_llm.AutoTokenizer.from_pretrained(calc["policy"]).save_pretrained(tmp_path / "teacher")
    seen, real = [], ppo_llm.compute_gae
    monkeypatch.setattr(ppo_llm, "compute_gae", lambda r, v, m, *a: seen.append((r, m)) or real(r, v, m, *a))
    run_dir = desk_run(ppo_llm, calc, desk, tmp_path, monkeypatch, teacher=str(tmp_path / "teacher"), kl_coef=0.1,
                       total_steps=1, eval_every=0)  # fmt: skip
    ((rewards, mask),) = seen
    assert (rewards[mask == 0] == 0).all() and (rewards[mask == 1] != 0).all()
    assert untimed_metrics(run_dir)[0]["distill/reverse_kl"] != 0
