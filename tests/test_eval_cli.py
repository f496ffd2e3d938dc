"""The eval scripts as a user runs them: bad input is one line on stderr and exit status 2,
checked before any model loads."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("script,args,needle", [
    ("eval_draft", ["--n", "0"], "--n must be > 0"),
    ("tune_drafting", ["notjson"], "is not JSON"),
    ("tune_drafting", ['{"mix": "ngram"}'], "need keys"),
    ("tune_drafting", ['{"mix": "beam", "paths": 3, "len": 4, "conf": 0.3}'], "mix of ngram"),
    ("mcts_search", ["--branching", "0"], "--branching must be > 0"),
    ("mcts_search", ["--prompt", "999"], "--prompt must be in 0..79"),
    ("train_draft", ["gen", "--batch", "0"], "--batch must be > 0"),
    ("train_draft", ["train", "--data", "/no/such/data.pt"], "No such file"),
    ("run_table", ["--beams", "0"], "--beams must be positive"),
])
def test_bad_input_is_one_line(script, args, needle):
    p = subprocess.run([sys.executable, str(ROOT / "eval" / f"{script}.py"), *args],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert needle in lines[-1], p.stderr
    assert lines[-1].startswith(script)
    if script != "run_table":                        # argparse's error prints its usage first
        assert len(lines) == 1, p.stderr
