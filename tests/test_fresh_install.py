"""What a new user does first, from the repo root: nothing in the checkout shadows an installed
package, the README's library example runs, and the public API is importable from the top."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _run_in_root(code: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """`python -c code` with the repo root as working directory, so the checkout is on sys.path
    first, as in a REPL, a notebook or `python -m pytest` started there."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_no_top_level_folder_shadows_an_installed_package():
    """Every importable top-level folder but specfork would hide a same-named installed package
    (transformers imports Hugging Face's `kernels`)."""
    importable = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    assert importable == ["specfork"]
    r = _run_in_root("import kernels; print(kernels.__file__)")
    assert r.returncode == 0, r.stderr
    assert not Path(r.stdout.strip()).resolve().is_relative_to(ROOT), r.stdout


def test_subpackages_are_real_packages():
    r = _run_in_root("import specfork.kernels.tree_attention, specfork.drafters.registry, "
                     "specfork.verifiers.sampling, specfork; print(specfork.__file__)")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == ROOT / "specfork" / "__init__.py"
    assert "package-dir" not in (ROOT / "pyproject.toml").read_text()


def test_public_api_from_the_top():
    r = _run_in_root("import sys, specfork; assert 'torch' not in sys.modules; "
                     "from specfork import SpecDecoder, GenerateOutput; "
                     "print(SpecDecoder.__module__, GenerateOutput.__module__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["specfork.decoder", "specfork.types"]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_library_example_runs_from_the_repo_root():
    code = readme_example()
    assert "from specfork import SpecDecoder" in code
    r = _run_in_root(code, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines and lines[-1].split()[-1] == "0", r.stdout     # no KV block leaked


def test_top_k_zero_or_none_is_no_top_k():
    """As in Hugging Face `generate`: top_k=0 and None both switch top-k off."""
    from specfork import SpecDecoder
    from specfork.errors import SpecforkError
    from specfork.model import Model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    dec = SpecDecoder(Model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()),
                      None, eos_token_ids=[], max_kv_tokens=128)
    runs = {k: dec.generate([1, 2, 3], max_new_tokens=24, temperature=1.0, top_k=k, seed=7)
            for k in (None, 0, 1)}
    assert runs[0].token_ids == runs[None].token_ids
    assert runs[1].token_ids != runs[None].token_ids           # top-1 is greedy: it differs
    assert runs[1].token_ids == dec.generate([1, 2, 3], max_new_tokens=24).token_ids
    with pytest.raises(SpecforkError, match="top_k must be an integer >= 0"):
        dec.generate([1, 2, 3], max_new_tokens=4, temperature=1.0, top_k=-1)
