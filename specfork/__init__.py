"""specfork: speculative decoding and tree search on a copy-on-write KV tree.

The public API, importable from the top: `from specfork import SpecDecoder, GenerateOutput`.
Names load on first use, so `import specfork` (and the CLI's --help) does not pull in torch.
"""
__version__ = "0.1.0"

_API = {
    "SpecDecoder": "specfork.decoder",
    "GenerateOutput": "specfork.types",
    "SamplingParams": "specfork.types",
    "Engine": "specfork.engine",
    "Session": "specfork.session",
    "beam_search": "specfork.search",
    "mcts": "specfork.mcts",
    "SpecforkError": "specfork.errors",
}
__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        import importlib
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'specfork' has no attribute {name!r}")
