"""Shared fixtures: the embedded model is loaded once per test session."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.manual_seed(0)
EVAL = Path(__file__).resolve().parents[1] / "eval"
sys.path.insert(0, str(EVAL))                    # benchmark helpers (prompts) live in eval/


@pytest.fixture(scope="session")
def smol():
    """(HF model, tokenizer, our Model) for the embedded SmolLM2-135M-Instruct."""
    from specfork.model import Model
    from specfork.loader import load_hf
    hf, tok = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    return hf, tok, Model(hf)


@pytest.fixture(scope="session")
def mt_prompts():
    from prompts import load_prompts
    return load_prompts("mtbench")


@pytest.fixture(scope="session")
def he_prompts():
    from prompts import load_prompts
    return load_prompts("humaneval")
