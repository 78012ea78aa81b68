"""Every number a GPU can show, in one command that fits a machine at hand for minutes: the tests on CUDA, the speed of
both LLM scripts, GRPO beside TRL at real shapes, the LM head's memory, and the README's first command learning.

    python benchmarks/gpu.py OUT                        # a GPU machine with requirements.txt installed
    python benchmarks/gpu.py --wheels .whl OUT          # a bare one: first install what is missing from .whl
    python benchmarks/gpu.py --smoke OUT                # every part at toy size on the CPU, in under a minute
    python benchmarks/gpu.py --install-results OUT      # back here: OUT's results into benchmarks/results/, the docs'
                                                        # tables rebuilt from them by the table-only commands
    python benchmarks/gpu.py --table                    # measure nothing: gpu_cuda.md from gpu_cuda.json

The parts, each the repository's own commands run from its root as subprocesses, under a time budget (BUDGETS). A
part past its budget is stopped (SIGINT to its process group, on which pytest writes its report and the LLM scripts
save and exit, then SIGTERM and SIGKILL, GRACE seconds apart), noted as cut off, and the next part runs. One GPU: what
torchrun with NCCL and FSDP2 does on several is not measured (one GPU is world size 1; tests/test_ddp.py runs gloo).
1. setup: pip installs tyro and datasets at requirements.txt's versions from --wheels where they are missing (pip
   takes from the folder what the machine lacks of their requirements), TRL 1.16 into benchmarks/runs/trl116 where
   scale.py looks for it; then prints the versions it finds and checks that tyro and datasets import. Without them no
   other part can run: a set-up that fails or is cut off ends the run with one line.
2. tests: tests/test_families.py, test_lm_head.py and test_lora.py, a pytest run each (one cut off inside a script's
   main(), which takes SIGINT as a stop, loses its own report alone): the scripts' runs in them use the GPU by
   default, and TEST_DEVICE=cuda puts test_lm_head.py's own tensors on it.
3. speed: llm_speed.py --gpt2-shape: PPO and GRPO, seconds per update split into generation, scoring and
   optimisation, tokens/s, peak memory.
4. trl: scale.py at GPT-2-124M's and Qwen2-0.5B's shapes: ours and TRL's GRPOTrainer, seconds per update, peak
   memory, estimate_gb() beside it.
5. head: scale.py's LM-head benchmark at V = 151,936: chunked against full logits, 1,024 and 4,096 tokens.
6. learning: llm_learning.py --configs gpu: ppo_llm.py (the README's first command) for 100 updates.
7. vllm: vllm_speed.py in the vLLM venv (--vllm-python; docs/scaling.md has its GPU install): gpt2-grpo and gpt2-ppo
   with and without --vllm in bf16, seconds per update, the push, and vLLM's log-probs against the trainer's; its
   runs are sleep mode's one check (the engine asleep during each update). Last, with its own budget, so that a cut
   off harms no other part; skipped, and said so, where that venv is missing.

OUT gets three files, few enough for a machine that hands back a handful: summary.json and summary.md (each part's
commands, state, seconds, budget and result files, the end of the output of a part that did not finish; the machine,
the GPU, the versions) and results.tar.gz (results/: the result files, named as in benchmarks/results/; logs/: each
part's output). They are written again after every part, so that a run stopped from outside keeps what it measured.
--install-results copies the result data (.json, .csv) into benchmarks/results/ and runs the table-only commands,
which write every table from them into the docs. Before the set-up this file imports the standard library and torch
alone (the set-up never installs torch), so it uses argparse, not tyro.
"""

import argparse
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402

PY = sys.executable
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TRL_DIR = os.path.join(ROOT, "benchmarks", "runs", "trl116")
TRL = "trl==1.16.0"
# seconds on one H100, estimated: 475 in all, and 10 more for each part cut off, within 9 minutes
BUDGETS = {"setup": 25, "tests": 90, "speed": 45, "trl": 95, "head": 25, "learning": 75, "vllm": 120}
SMOKE_BUDGET = 60  # seconds for each part at toy size
SKIPPED = "skipped: no vLLM venv (--vllm-python)"  # the vllm part's state where that venv is missing
GRACE = 5  # seconds from SIGINT to SIGTERM, and from SIGTERM to SIGKILL
TESTS = ["tests/test_families.py", "tests/test_lm_head.py", "tests/test_lora.py"]
VERSIONS = ["torch", "transformers", "peft", "accelerate", "datasets", "tyro", "numpy", "pyarrow", "fsspec"]


def pinned(names):
    """name==version of each of names, as requirements.txt pins it."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = {line.split("==")[0]: line.split()[0] for line in f if "==" in line and not line.startswith("#")}
    return [pins[name] for name in names]


def setup_commands(wheels):
    """pip installs from the wheels folder what is missing, then tyro and datasets are imported; (commands, what was
    missing)."""
    missing = [name for name in ["tyro", "datasets"] if importlib.util.find_spec(name) is None]
    commands = []
    if missing and wheels:
        commands.append([PY, "-m", "pip", "install", "--no-index", "--find-links", wheels, *pinned(missing)])
    if not os.path.isdir(os.path.join(TRL_DIR, "trl")):
        missing.append("TRL")
        if wheels:
            pip = [PY, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", wheels, "--target", TRL_DIR]
            commands.append([*pip, TRL])
    commands.append([PY, "-c", "import datasets, tyro"])
    return commands, missing


def part_commands(part, smoke, work, vllm_python=None):
    """One part's commands, at toy size with smoke, and the environment variables they need besides."""
    results, logs = os.path.join(work, "results"), os.path.join(work, "logs")
    if part == "vllm":
        toy = ["--runs", "tiny-grpo", "--updates", "2", "--pushes", "1"] if smoke else []
        return [[vllm_python, "benchmarks/vllm_speed.py", "--out-dir", results, *toy]], {}
    if part == "tests":
        pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]  # a file at a time: a cut-off loses one report
        if smoke:
            return [
                [*pytest, f"--junitxml={logs}/tests-test_lm_head.xml", "tests/test_lm_head.py", "-k", "autocast"]
            ], {}
        reports = [f"--junitxml={logs}/tests-{os.path.basename(test)[:-3]}.xml" for test in TESTS]
        return [[*pytest, report, test] for report, test in zip(reports, TESTS)], {"TEST_DEVICE": "cuda"}
    if part == "speed":
        speed = [PY, "benchmarks/llm_speed.py", "--out-dir", results]
        if smoke:
            toy = ["--batch-size", "8", "--micro-batch-size", "4", "--max-new-tokens", "2", "--updates", "1"]
            return [[*speed, *toy, "--warmup", "0"]], {}
        return [[*speed, "--gpt2-shape"]], {}
    scale = [PY, "benchmarks/scale.py", "--out-dir", results]
    if part == "trl":
        configs = ["tiny-grpo"] if smoke else ["gpt2-grpo", "qwen2-0.5b-grpo"]
        return [[*scale, "--no-head", "--runs", *configs]], {}
    if part == "head":
        toy = ["--head-vocab", "512", "--head-tokens", "16", "--head-rows", "3", "8"] if smoke else []
        return [[*scale, "--no-trl", *toy, "--runs"]], {}
    learning = [PY, "benchmarks/llm_learning.py", "--configs", "gpu", "--seeds", "1", "--jobs", "1"]
    learning += ["--runs-dir", os.path.join(work, "runs"), "--out-dir", results]
    if smoke:
        learning += ["--total-steps", "1"]
    return [learning], {}


def stop(process):
    """SIGINT to the process group of a part's command (pytest writes its report), then SIGTERM and SIGKILL to what is
    left of it, GRACE seconds apart."""
    for signum in [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        for _ in range(GRACE * 10):
            process.poll()  # reaps the leader, so that only live processes keep the group
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
    process.wait()


def run_part(commands, env, budget, log_path, keep_going=False):
    """The commands one after the other, each in a process group of its own, until one fails (keep_going: all, failed
    or not) or the budget is spent: "ok", "failed (exit N)" or "cut off"."""
    start, state = time.monotonic(), "ok"
    with open(log_path, "w") as log:
        for command in commands:
            log.write("$ " + " ".join(command) + "\n")
            log.flush()
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # fmt: skip
            try:
                code = process.wait(timeout=max(0.0, budget - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                stop(process)
                log.write(f"\ncut off: past its budget of {budget:g} s\n")
                return "cut off"
            except KeyboardInterrupt:  # the part's processes are in another group: Ctrl-C does not reach them
                stop(process)
                raise
            if code:
                state = f"failed (exit {code})"
            if code and not keep_going:
                break
    return state


def junit_counts(paths):
    """The counts of pytest's junit XML reports (those written), summed, and the names of the tests that failed."""
    paths = [path for path in paths if os.path.exists(path)]
    if not paths:
        return None
    counts, failed = dict.fromkeys(["tests", "failures", "errors", "skipped"], 0), []
    for path in paths:
        suite = ElementTree.parse(path).getroot().find("testsuite")
        counts = {key: count + int(suite.get(key)) for key, count in counts.items()}
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    return counts | {"failed": failed}


def files(folder):
    """{path relative to folder: modification time} of every file under it."""
    found = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, folder)] = os.path.getmtime(path)
    return found


def shown(command, env, work):
    """A command as a reader would type it: the environment it needs, python, paths from the repository root."""
    text = " ".join(["python" if word == PY else word for word in command])
    text = text.replace(work, "WORK").replace(ROOT + os.sep, "")
    return " ".join([f"{key}={value}" for key, value in env.items()] + [text])


def machine(smoke):
    """The GPU (the CPU, for a smoke run), the CPU cores, Python and the platform."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    info["device"] = f"the CPU ({platform.machine()})"
    if not smoke:
        import torch

        gpu = torch.cuda.get_device_properties(0)
        info["device"] = f"{gpu.name}, {gpu.total_memory / 2**30:.0f} GiB"
    return info


def versions():
    """The versions of the packages the parts use, TRL's in benchmarks/runs/trl116."""
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    trl = next(importlib.metadata.distributions(name="trl", path=[TRL_DIR]), None)
    versions["trl"] = trl.version if trl else "not installed"
    return versions


def table(summary):
    """The summary as markdown: gpu_<device>.md in the docs, summary.md in OUT."""
    versions = ", ".join(f"{name} {version}" for name, version in summary["versions"].items())
    budget = sum(part["budget"] for part in summary["parts"].values())
    lines = [
        f"`{summary['command']}` on {summary['machine']['device']}, {summary['machine']['cpus']} CPU cores, Python "
        f"{summary['machine']['python']}, {versions}; {summary['date']}: {summary['seconds']:.0f} s of {budget:g} "
        "budgeted. WORK: a temporary folder; results/ in it is OUT's results.tar.gz. One GPU: torchrun with NCCL and "
        "FSDP2 over several is not measured here.",
        "",
        "| part | commands | state | seconds | budget | result files |",
        "|---|---|---|---|---|---|",
    ]
    for name, part in summary["parts"].items():
        state = part["state"]
        if part.get("tests"):
            counts = part["tests"]
            passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
            state += f": {passed} passed, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
        if part.get("installed"):
            state += f"; missing before: {' '.join(part['installed'])}"
        commands = "<br>".join(f"`{command}`" for command in part["commands"])
        lines.append(f"| {name} | {commands} | {state} | {part['seconds']:.0f} | {part['budget']:g} | "
                     f"{', '.join(part['wrote'])} |")  # fmt: skip
    for name, part in summary["parts"].items():
        for test in (part.get("tests") or {}).get("failed", []):
            lines.append(f"\n{name}: failed `{test}`")
        if part["state"] not in ("ok", SKIPPED):
            lines += ["", f"The end of {name}'s output:", "", "```", *part["tail"], "```"]
    return "\n".join(lines)


def write_out(out, work, summary):
    """summary.json, summary.md and results.tar.gz (results/ and logs/ of the work folder, and the log of each run of
    the learning part) in out."""
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(table(summary) + "\n")
    with tarfile.open(os.path.join(out, "results.tar.gz"), "w:gz") as tar:
        for folder in ["results", "logs"]:
            tar.add(os.path.join(work, folder), arcname=folder)
        for path in sorted(glob.glob(os.path.join(work, "runs", "*.log"))):  # llm_learning.py's: <config>_<seed>.log
            tar.add(path, arcname=os.path.join("logs", os.path.basename(path)))


def measure(out, parts, budgets, wheels, smoke, vllm_python=None):
    """Each of parts in order, into out; the vllm part with vllm_python, skipped where it does not exist."""
    os.makedirs(out, exist_ok=True)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if smoke:  # on the CPU even where there is a GPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    summary = {"command": " ".join(["python benchmarks/gpu.py", *sys.argv[1:]]), "smoke": smoke,
               "device": "cpu" if smoke else "cuda", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": machine(smoke), "seconds": 0.0, "parts": {}}  # fmt: skip
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        for folder in ["results", "logs", "runs"]:
            os.makedirs(os.path.join(work, folder))
        for name in parts:
            if name == "setup":
                commands, missing = setup_commands(wheels)
                part_env = {}
            else:
                commands, part_env = part_commands(name, smoke, work, vllm_python)
            print(f"== {name} (budget {budgets[name]:g} s)", flush=True)
            before = files(os.path.join(work, "results"))
            log_path = os.path.join(work, "logs", f"{name}.log")
            part_start = time.monotonic()
            if name == "vllm" and not os.path.isfile(vllm_python):
                with open(log_path, "w") as log:
                    log.write(f"skipped: no {vllm_python} (--vllm-python: the vLLM venv's python)\n")
                state = SKIPPED
            else:
                state = run_part(commands, env | part_env, budgets[name], log_path, keep_going=name == "tests")
            after = files(os.path.join(work, "results"))
            with open(log_path) as f:
                tail = f.read().splitlines()[-15:]
            part = {"commands": [shown(command, part_env, work) for command in commands], "state": state,
                    "seconds": time.monotonic() - part_start, "budget": budgets[name],
                    "wrote": sorted(path for path, mtime in after.items() if before.get(path) != mtime),
                    "tail": tail if state not in ("ok", SKIPPED) else []}  # fmt: skip
            if name == "setup":
                part["installed"] = missing
            if name == "tests":
                part["tests"] = junit_counts(sorted(glob.glob(os.path.join(work, "logs", "tests-*.xml"))))
            summary["parts"][name] = part
            summary["seconds"] = time.monotonic() - start
            summary["versions"] = versions()
            print(f"   {state} in {part['seconds']:.0f} s", flush=True)
            write_out(out, work, summary)
            if name == "setup":  # what it finds; without tyro and datasets no other part can run
                print(
                    "   " + ", ".join(f"{name} {version}" for name, version in summary["versions"].items()), flush=True
                )
            if name == "setup" and state != "ok":
                last = (tail or ["no output"])[-1]
                raise SystemExit(f"error: the set-up {state} ({last}), so no part can run: {out}/summary.md has why")
    print(table(summary))


def install(source, results=RESULTS):
    """A GPU run's result data from source (an OUT folder) into results, then every table written from it."""
    with open(os.path.join(source, "summary.json")) as f:
        summary = json.load(f)
    if summary["smoke"]:
        raise SystemExit(f"error: --install-results {source}: a --smoke run; only a GPU run's results are installed")
    with tarfile.open(os.path.join(source, "results.tar.gz")) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.startswith("results/") and member.name.endswith((".json", ".csv")):
                path = os.path.join(results, os.path.relpath(member.name, "results"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with tar.extractfile(member) as data, open(path, "wb") as f:
                    shutil.copyfileobj(data, f)
                print(f"{member.name} -> {os.path.relpath(path)}")
    with open(os.path.join(results, f"gpu_{summary['device']}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    commands = [["benchmarks/llm_speed.py", "--table"], ["benchmarks/scale.py", "--table"]]
    if os.path.exists(os.path.join(results, "vllm_cuda.json")):
        commands.append(["benchmarks/vllm_speed.py", "--table"])
    if os.path.exists(os.path.join(results, "llm_curves", "gpu-ppo.csv")):
        commands.append(["benchmarks/llm_learning.py", "--no-run", "--configs", "gpu"])
    for command in commands:
        subprocess.run([PY, *command, "--out-dir", results], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    for summary in saved_results(os.path.join(results, "gpu_*.json")):
        write_table(f"gpu_{summary['device']}.md", table(summary), results)


def part_names(text):
    """PART,PART of --parts."""
    names = text.split(",")
    for name in names:
        if name not in BUDGETS:
            raise argparse.ArgumentTypeError(f"{name}: not one of {', '.join(BUDGETS)}")
    return names


def budget_pair(text):
    """PART=SECONDS of --budget."""
    part, _, seconds = text.partition("=")
    if part not in BUDGETS:
        raise argparse.ArgumentTypeError(f"{text}: PART is one of {', '.join(BUDGETS)}")
    try:
        return part, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: SECONDS is a number") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="the output folder: summary.json, summary.md, results.tar.gz")
    parser.add_argument("--wheels", help="install what is missing (tyro, datasets, TRL) from this folder of wheels")
    parser.add_argument("--smoke", action="store_true", help="every part at toy size on the CPU, in under a minute")
    parser.add_argument("--parts", type=part_names, default=list(BUDGETS), metavar="PART,PART",
                        help=f"only these parts, of {','.join(BUDGETS)}")  # fmt: skip
    parser.add_argument("--budget", action="append", type=budget_pair, default=[], metavar="PART=SECONDS",
                        help="another budget for a part (repeatable)")  # fmt: skip
    parser.add_argument("--install-results", metavar="OUT", help="copy OUT's results into benchmarks/results/ and "
                        "rebuild the docs' tables from them (measures nothing)")  # fmt: skip
    parser.add_argument("--table", action="store_true", help="measure nothing: gpu_cuda.md from gpu_cuda.json")
    parser.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"),
                        help="the vLLM venv's python, for the vllm part (default: .venv-vllm/bin/python)")  # fmt: skip
    args = parser.parse_args()
    # the parts' processes start with Python's SIGINT handler (stop() sends SIGINT first), also where this process
    # started with SIGINT ignored, as a shell's background job does: an ignored signal stays ignored across exec
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.table:
        for summary in saved_results(os.path.join(RESULTS, "gpu_*.json")):
            write_table(f"gpu_{summary['device']}.md", table(summary), RESULTS)
        return
    if args.install_results:
        return install(args.install_results)
    if args.out is None:
        raise SystemExit("error: OUT: the output folder is missing (python benchmarks/gpu.py [--smoke] OUT)")
    if args.wheels and not os.path.isdir(args.wheels):
        raise SystemExit(f"error: --wheels {args.wheels}: not a folder")
    if not args.smoke:
        import torch  # the parts import it anyway; only here, a smoke run need not wait for it

        if not torch.cuda.is_available():
            raise SystemExit("error: no GPU here: gpu.py measures one (--smoke runs every part at toy size on the CPU)")
    budgets = {part: SMOKE_BUDGET if args.smoke else seconds for part, seconds in BUDGETS.items()}
    budgets |= dict(args.budget)
    wheels = None
    if args.wheels:
        wheels = os.path.abspath(args.wheels)
    measure(os.path.abspath(args.out), args.parts, budgets, wheels, args.smoke, os.path.abspath(args.vllm_python))


if __name__ == "__main__":
    main()
