"""Turn a drafter spec like "ngram" or "model:ID,ngram" into drafter objects."""
from __future__ import annotations

from specfork.errors import SpecforkError

# The default drafter mix per target (aliases); others fall back to n-gram lookup. The embedded
# target: n-gram lookup first (free when the context repeats itself), the shipped trained draft
# takes the paths n-gram leaves unused (SpecDecoder passes an unused share on).
DEFAULTS = {"smollm2-135m": "ngram,trained"}


def make_drafters(spec: str | None, target: str, model, drafts: int,
                  min_conf: float | None = None, draft_vocab: int | None = None,
                  draft_len: int = 4) -> list:
    """`min_conf` (None: the model drafter's default) sets when model-draft paths stop;
    `draft_vocab` how many output rows the trained draft keeps (None: its default, 0: all).
    Model drafters get KV room for `drafts` paths of `draft_len` tokens."""
    from specfork.drafters.model_drafter import MIN_CONF, check_min_conf
    min_conf = MIN_CONF if min_conf is None else min_conf
    check_min_conf(min_conf)
    spec = spec or DEFAULTS.get(target.lower(), "ngram")
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        kind, _, arg = item.partition(":")
        if kind == "ngram":
            from specfork.drafters.ngram import NgramDrafter
            out.append(NgramDrafter())
        elif kind == "model":
            if not arg:
                raise SpecforkError("drafter 'model' needs a model: model:ID_OR_PATH")
            from specfork.drafters.model_drafter import ModelDrafter
            out.append(ModelDrafter.load(arg, target_model=model, min_conf=min_conf,
                                         max_paths=drafts, max_len=draft_len))
        elif kind == "trained":
            out.append(trained_drafter(model, min_conf, draft_vocab, drafts, draft_len))
        else:
            raise SpecforkError(f"unknown drafter '{kind}' (use ngram, trained or "
                                "model:ID_OR_PATH)")
    if not out:
        raise SpecforkError(f"empty drafter spec '{spec}'")
    return out


def trained_drafter(model, min_conf: float | None = None, draft_vocab: int | None = None,
                    max_paths: int = 8, max_len: int = 16):
    """The shipped distilled draft of the embedded target; fp16 on CPU, where it is cheapest;
    its output layer keeps the `draft_vocab` (None: DRAFT_VOCAB; 0: every) most frequent
    target tokens plus the request's own."""
    import torch

    from specfork.drafters.model_drafter import MIN_CONF, ModelDrafter
    from specfork.drafters.trained_draft import DRAFT_VOCAB, load_trained_draft, load_vocab
    from specfork.model import Model
    if draft_vocab is not None and draft_vocab < 0:
        raise SpecforkError(f"draft vocabulary size must be >= 0, got {draft_vocab}")
    k = DRAFT_VOCAB if draft_vocab is None else draft_vocab
    dt = torch.float16 if model.device.type == "cpu" else model.dtype
    return ModelDrafter(Model(load_trained_draft(model.hf, dtype=dt)), name="trained",
                        min_conf=MIN_CONF if min_conf is None else min_conf,
                        vocab=load_vocab(k) if k else None,
                        max_paths=max_paths, max_len=max_len)
