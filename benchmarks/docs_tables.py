"""The docs quote benchmark tables between markers, and each benchmark script writes its table through write_table(),
so the table a page shows is always the one its script wrote last from its result files, never a copy by hand:

    <!-- table: llm_learning.md -->
    (replaced by benchmarks/results/llm_learning.md on every write)
    <!-- end table -->
"""

import glob
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_table(name, text, results_dir=os.path.join(ROOT, "benchmarks", "results")):
    """Write `text` to results_dir/name, then into every page of docs/ and README.md that quotes `name`."""
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, name), "w") as f:
        f.write(text.rstrip("\n") + "\n")
    if os.path.abspath(results_dir) != os.path.join(ROOT, "benchmarks", "results"):
        return  # a run into another directory (a test, a trial) leaves the docs alone
    block = re.compile(rf"(<!-- table: {re.escape(name)} -->\n).*?(<!-- end table -->)", re.S)
    for page in glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")]:
        with open(page) as f:
            old = f.read()
        new = block.sub(lambda m: m.group(1) + text.rstrip("\n") + "\n" + m.group(2), old)
        if new != old:
            with open(page, "w") as f:
                f.write(new)


def saved_results(pattern, flag="--table"):
    """The JSON results of a table-only command (`pattern`: a path or a glob), or one line saying there are none."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise SystemExit(f"error: {flag}: {os.path.relpath(pattern)} does not exist: measure first (without {flag})")
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    return results
