"""The README's two set-up commands: CI runs the test command, with the linters before its tests, and the requirements
are split so that the first command installs what the scripts need and the second adds the tools."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    run_cmd, test_cmd = re.search(r"```bash\n(.*?)\n```", read("README.md"), re.S).group(1).splitlines()
    assert run_cmd.endswith("pip install -r requirements.txt && python ppo_llm.py")
    assert test_cmd.endswith("pip install -r requirements-dev.txt && python -m pytest -q")
    install, tests = test_cmd.split(" && python -m pytest")
    ci = read(".ci/run").splitlines()
    run = [line for line in ci if line.startswith(f"python -m pytest{tests} --e2e")]  # and the tests marked e2e
    assert install in ci and len(run) == 1  # with the linters between them
    assert ci.index("ruff check .") < ci.index(run[0]) and ci.index("ruff format --check .") < ci.index(run[0])


def requirement_names(name):
    return {re.split(r"[=<>\[ ]", line)[0] for line in read(name).splitlines() if line[:1].isalpha()}


def test_requirements_split():
    runtime, dev = requirement_names("requirements.txt"), requirement_names("requirements-dev.txt")
    assert {"torch", "transformers", "tyro", "gymnasium", "tensorboard", "wandb"} <= runtime
    assert "-r requirements.txt" in read("requirements-dev.txt").splitlines()
    assert {"pytest", "ruff", "matplotlib"} <= dev and not {"pytest", "ruff", "matplotlib"} & runtime
    assert 'requires-python = ">=3.11"' in read("pyproject.toml")


def test_readme_is_a_front_page_linking_every_docs_page_and_no_link_is_broken():
    readme = read("README.md")
    assert len(readme.split()) <= 1500
    pages = sorted(name for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", readme))
    assert {f"docs/{name}" for name in pages} <= linked
    for page in ["README.md"] + [f"docs/{name}" for name in pages]:
        for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):  # [text](target) and ![alt](target)
            path = target.split("#")[0]
            if path and "://" not in path and not path.startswith("mailto:"):
                assert os.path.exists(os.path.join(ROOT, os.path.dirname(page), path)), f"{page}: {target}"


def test_readme_line_counts_are_the_files():
    rows = re.findall(r"^\| \[`(\w+\.py)`\]\(\w+\.py\) \| (\d+) \|", read("README.md"), re.M)
    assert {name for name, _ in rows} == {"reinforce.py", "ppo_classic.py", "ppo_llm.py", "grpo_llm.py"}
    for name, lines in rows:
        assert int(lines) == len(read(name).splitlines()), name
