"""eval/train_eagle.py end to end at toy size on the real embedded target: self-written
requests (Magpie), bf16 generation with captured features, training-time test under bf16
autocast, and a head the engine loads as a published EAGLE-3 checkpoint and speculates with,
token-identical to plain greedy."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_train_eagle_tiny_end_to_end(tmp_path):
    data, out = tmp_path / "gen.pt", tmp_path / "head"
    args = ["all", "--threads", "2", "--data", str(data), "--out", str(out), "--prompts", "6",
            "--seqs", "6", "--batch", "3", "--max-new", "12", "--max-prompt", "64",
            "--steps", "3", "--batch-tokens", "96", "--draft-vocab", "512",
            "--intermediate", "64", "--negatives", "32", "--val-frac", "0.34",
            "--train-dtype", "bfloat16", "--dtype", "bfloat16", "--self-prompts", "3",
            "--self-max", "48", "--self-minutes", "3"]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "train_eagle.py"), *args],
                       capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads((out / "train_info.json").read_text())
    assert info["train"]["steps"] == 3 and info["capture"] == [2, 15, 27]
    assert info["data"]["sequences"] == 6 and info["draft_vocab"]["size"] == 512
    assert "--train-dtype bfloat16" in info["command"]
    written = json.loads(data.with_suffix(".prompts.json").read_text())["prompts"]
    assert 1 <= len(written) <= 3 and info["data"]["kinds"].get("self") == len(written)
    assert all(len(t) >= 12 for t in written)

    from specfork.decoder import SpecDecoder
    spec = SpecDecoder.from_pretrained(drafts=1, drafter=f"eagle3:{out}", adaptive=False)
    plain = SpecDecoder(spec.model, spec.tokenizer)
    ids = spec.encode("List three uses of a hash map.")
    got = spec.generate(ids, max_new_tokens=16)
    assert got.token_ids == plain.generate(ids, max_new_tokens=16).token_ids
    assert got.stats["draft_tokens_proposed"] > 0 and got.stats["kv_blocks_leaked"] == 0


def test_lr_schedule_ends_with_the_time_budget():
    """Warmup, then cosine over steps or time, whichever ends first: a run whose host slows
    down decays its rate to zero by the budget instead of overrunning it."""
    sys.path.insert(0, str(ROOT / "eval"))
    from train_eagle import lr_factor
    assert lr_factor(0, 1000, 0.0, 10) == pytest.approx(0.1)
    assert lr_factor(9, 1000, 0.0, 10) == pytest.approx(1.0, abs=1e-3)
    assert lr_factor(500, 1000, 0.0, 10) == pytest.approx(0.5)          # half the steps
    assert lr_factor(100, 1000, 0.5, 10) == pytest.approx(0.5)          # half the time
    assert lr_factor(100, 1000, 1.0, 10) == 0.0 == lr_factor(1000, 1000, 0.1, 10)
