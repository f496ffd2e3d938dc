"""Turn a drafter spec like "ngram" or "model:ID,ngram" into drafter objects."""
from __future__ import annotations

from specfork.errors import SpecforkError

# The default drafter mix per target (aliases); others fall back to n-gram lookup. The embedded
# target: n-gram lookup first (free when the context repeats itself), the shipped trained draft
# takes the paths n-gram leaves unused (SpecDecoder passes an unused share on).
DEFAULTS = {"smollm2-135m": "ngram,trained"}


MAX_PATHS = MAX_DRAFT_LEN = 64       # beyond these a verify tree outgrows any useful budget
DRAFT_LEN = 4                        # default longest draft path


def parse_spec(spec: str | None, target: str) -> list[tuple[str, str]]:
    """"ngram,model:ID" -> [("ngram", ""), ("model", "ID")]; None: the target's default mix."""
    spec = spec or DEFAULTS.get(target.lower(), "ngram")
    items = [s.strip().partition(":")[::2] for s in spec.split(",") if s.strip()]
    for kind, arg in items:
        if kind not in ("ngram", "model", "trained", "eagle", "eagle3"):
            raise SpecforkError(f"unknown drafter '{kind}' (use ngram, trained, eagle, "
                                "model:ID_OR_PATH, eagle:PATH or eagle3:PATH)")
        if kind in ("model", "eagle3") and not arg:
            what = "model:ID_OR_PATH" if kind == "model" else "eagle3:PATH"
            raise SpecforkError(f"drafter '{kind}' needs a checkpoint: {what}")
    if not items:
        raise SpecforkError(f"empty drafter spec '{spec}'")
    return items


def check_drafting(drafts: int, draft_len: int, spec: str | None = None, target: str = "",
                   min_conf: float | None = None, draft_vocab: int | None = None,
                   tree: tuple[int, int, int] | None = None) -> None:
    """Every drafting option, checked before any weights load (the CLI relies on it).
    `tree`: (tree_topk, tree_depth, draft_tokens) of EAGLE drafters."""
    from specfork.drafters.eagle import check_tree
    from specfork.drafters.model_drafter import check_min_conf
    from specfork.drafters.trained_draft import check_draft_vocab
    if tree is not None:
        check_tree(*tree)
    if not isinstance(drafts, int) or not 0 <= drafts <= MAX_PATHS:
        raise SpecforkError(f"drafts must be in [0, {MAX_PATHS}], got {drafts}")
    if not isinstance(draft_len, int) or not 1 <= draft_len <= MAX_DRAFT_LEN:
        raise SpecforkError(f"draft_len must be in [1, {MAX_DRAFT_LEN}], got {draft_len}")
    if min_conf is not None:
        check_min_conf(min_conf)
    if draft_vocab is not None:
        check_draft_vocab(draft_vocab)
    if drafts:
        parse_spec(spec, target)


def make_drafters(spec: str | None, target: str, model, drafts: int,
                  min_conf: float | None = None, draft_vocab: int | None = None,
                  draft_len: int = 4, tree: tuple[int, int, int] | None = None,
                  max_kv_tokens: int | None = None) -> list:
    """`min_conf` (None: the model drafter's default) sets when model-draft paths stop;
    `draft_vocab` how many output rows the trained draft keeps (None: its default, 0: all);
    `tree` the EAGLE tree's (top-k, depth, nodes), None: the defaults.
    Model drafters get KV room for `drafts` paths of `draft_len` tokens."""
    from specfork.drafters import eagle
    from specfork.engine import DEFAULT_KV_TOKENS
    tree = tree or eagle.tree_shape()
    max_kv_tokens = max_kv_tokens or DEFAULT_KV_TOKENS
    check_drafting(drafts, draft_len, spec, target, min_conf, draft_vocab, tree)
    out = []
    for kind, arg in parse_spec(spec, target):
        if kind in ("eagle", "eagle3"):
            arch = eagle.EAGLE3 if kind == "eagle3" else eagle.EAGLE1
            head = (eagle.load_shipped(model) if kind == "eagle" and not arg else
                    eagle.load_eagle(arg, model, arch))
            name = "eagle" if not arg else f"{kind}:{arg}"
            out.append(eagle.EagleDrafter(head, name, *tree, max_kv_tokens=max_kv_tokens))
        elif kind == "ngram":
            from specfork.drafters.ngram import NgramDrafter
            out.append(NgramDrafter())
        elif kind == "model":
            from specfork.drafters.model_drafter import MIN_CONF, ModelDrafter
            out.append(ModelDrafter.load(arg, target_model=model,
                                         min_conf=MIN_CONF if min_conf is None else min_conf,
                                         max_paths=drafts, max_len=draft_len))
        else:
            out.append(trained_drafter(model, min_conf, draft_vocab, drafts, draft_len))
    return out


def trained_drafter(model, min_conf: float | None = None, draft_vocab: int | None = None,
                    max_paths: int = 8, max_len: int = 16):
    """The shipped distilled draft of the embedded target (`trained_model`). Its output layer
    keeps the `draft_vocab` (None: DRAFT_VOCAB; 0: every) most frequent target tokens plus the
    request's own."""
    from specfork.drafters.model_drafter import MIN_CONF, ModelDrafter
    from specfork.drafters.trained_draft import DRAFT_VOCAB, load_vocab
    k = DRAFT_VOCAB if draft_vocab is None else draft_vocab
    return ModelDrafter(trained_model(model), name="trained",
                        min_conf=MIN_CONF if min_conf is None else min_conf,
                        vocab=load_vocab(k) if k else None,
                        max_paths=max_paths, max_len=max_len)


def trained_model(model, fmt: str = "auto"):
    """The trained draft as a `Model` beside the target `model`. `fmt` auto: on a CPU where
    specfork's low-bit kernel runs, int4 weights (8-bit activations) whatever the target's
    format: a draft only proposes, so its rounding moves acceptance, never the output, and its
    layers then run as one compiled op, a draft step costing a fraction of what float16
    weights through torch's matmuls cost (eval/tune_drafting.py, results/tune_draft_format*.json);
    elsewhere float16 on a CPU, the target's dtype on a GPU. Or float16 / bfloat16 / int4."""
    import torch

    from specfork.drafters.trained_draft import load_trained_draft
    from specfork.model import Model
    from specfork.weights import native
    cpu = model.device.type == "cpu"
    if fmt == "auto":
        fmt = "int4" if cpu and native() else "float16" if cpu else str(model.dtype)[6:]
    if fmt == "int4":
        return Model(load_trained_draft(model.hf, dtype=torch.float32), weights="int4")
    return Model(load_trained_draft(model.hf, dtype=getattr(torch, fmt)))
