"""eval/train_eagle.py end to end at toy size on the real embedded target: generation with
captured features, training-time test under bf16 autocast, and a head the engine loads as a
published EAGLE-3 checkpoint and speculates with, token-identical to plain greedy."""
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
            "--train-dtype", "bfloat16"]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "train_eagle.py"), *args],
                       capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads((out / "train_info.json").read_text())
    assert info["train"]["steps"] == 3 and info["capture"] == [2, 15, 27]
    assert info["data"]["sequences"] == 6 and info["draft_vocab"]["size"] == 512
    assert "--train-dtype bfloat16" in info["command"]

    from specfork.decoder import SpecDecoder
    spec = SpecDecoder.from_pretrained(drafts=1, drafter=f"eagle3:{out}", adaptive=False)
    plain = SpecDecoder(spec.model, spec.tokenizer)
    ids = spec.encode("List three uses of a hash map.")
    got = spec.generate(ids, max_new_tokens=16)
    assert got.token_ids == plain.generate(ids, max_new_tokens=16).token_ids
    assert got.stats["draft_tokens_proposed"] > 0 and got.stats["kv_blocks_leaked"] == 0
