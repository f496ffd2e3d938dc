"""The distilled draft for the embedded SmolLM2-135M-Instruct, as an ordinary HF LlamaForCausalLM.

Only what the target cannot rebuild ships in `weights/` (its decoder layers and final norm, fp16;
`eval/train_draft.py` makes them): the token embeddings and the tied lm_head are the target's own,
taken at load (shared, not copied, when the dtypes agree). The result is a plain transformers
model, so the engine wraps it as `ModelDrafter(Model(draft))` and HF assisted generation takes
the very same object as `assistant_model`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specfork.errors import SpecforkError

WEIGHTS = Path(__file__).resolve().parent / "weights"
FINGERPRINT_ROWS = [0, 1, 2, 100, 1000, 10000, 30000, 49151]
# Output rows the engine's draft keeps (plus the request's own tokens): the target's most frequent
# outputs in the draft's training data (weights/vocab.json). Measured with eval/tune_drafting.py
# (results/tune_drafting.json, default mix, 3 paths): 1.20x our greedy at 8192 rows against
# 1.11x with all 49152, tau 1.88 against 1.87. 8192 rather than 2048 or 4096 came from earlier
# runs of the same script whose output was not saved (the retrained draft's more varied data
# puts only 94% of target tokens in the top 4096).
DRAFT_VOCAB = 8192


def check_draft_vocab(k: int) -> None:
    """Output rows the engine's draft keeps: a count >= 0 (0: the whole vocabulary)."""
    if not isinstance(k, int) or k < 0:
        raise SpecforkError(f"draft_vocab must be an integer >= 0 (0: every row), got {k}")


class DraftWeightsMissing(SpecforkError):
    """The shipped draft files are not where the loader looks."""


class DraftTargetMismatch(SpecforkError):
    """The target passed in is not the model the draft was distilled from."""


def fingerprint(embed: torch.Tensor) -> list[float]:
    """Norms of a few fixed embedding rows: cheap, dtype-robust identity of a target."""
    return [round(float(x), 4) for x in embed.detach()[FINGERPRINT_ROWS].float().norm(dim=-1)]


def load_trained_draft(target_hf, dtype: torch.dtype | None = None,
                       weights_dir: str | Path = WEIGHTS):
    """HF LlamaForCausalLM (eval mode, on the target's device) = shipped layers + target's
    embeddings. `dtype` defaults to fp32; any other dtype copies the embeddings once."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    wd = Path(weights_dir)
    files = [wd / "config.json", wd / "model.safetensors", wd / "train_info.json"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DraftWeightsMissing(f"trained draft files missing: {', '.join(missing)}; rebuild "
                                  "them with `python eval/train_draft.py all`")
    info = json.loads(files[2].read_text())
    embed = target_hf.get_input_embeddings().weight
    cfg = LlamaConfig.from_dict(json.loads(files[0].read_text()))
    if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size) or \
            not torch.allclose(torch.tensor(fingerprint(embed)),
                               torch.tensor(info["embed_check"]), rtol=1e-2, atol=1e-3):
        raise DraftTargetMismatch(f"the draft in {wd} was distilled from {info['target']}; the "
                                  f"target given has other embeddings {tuple(embed.shape)}")
    dtype = dtype or torch.float32
    cfg.dtype = dtype
    with torch.device(embed.device):
        draft = LlamaForCausalLM(cfg).to(dtype)
    state = load_file(str(files[1]), device=str(embed.device))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    left = [k for k in missing if k not in ("model.embed_tokens.weight", "lm_head.weight")]
    if left or unexpected:
        raise DraftWeightsMissing(f"{files[1]} does not match {files[0]}: missing {left}, "
                                  f"unexpected {unexpected}")
    shared = embed if embed.dtype == dtype else torch.nn.Parameter(embed.detach().to(dtype),
                                                                   requires_grad=False)
    draft.model.embed_tokens.weight = shared
    draft.lm_head.weight = shared                # tied, as in the target
    draft.model.layers.requires_grad_(False)   # not the shared embeddings: they are the target's
    draft.model.norm.requires_grad_(False)
    draft.generation_config = target_hf.generation_config
    return draft.eval()


def load_vocab(k: int, weights_dir: str | Path = WEIGHTS) -> torch.Tensor:
    """The `k` token ids the target emitted most often in the draft's training data
    (`eval/train_draft.py vocab`), most frequent first."""
    if k <= 0:
        raise SpecforkError(f"draft vocabulary size must be positive, got {k}")
    f = Path(weights_dir) / "vocab.json"
    if not f.is_file():
        raise DraftWeightsMissing(f"draft vocabulary ranking missing: {f}; rebuild it with "
                                  "`python eval/train_draft.py vocab`")
    return torch.tensor(json.loads(f.read_text())["ids"][:k], dtype=torch.long)
