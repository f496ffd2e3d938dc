"""specfork: speculative decoding and tree search on a copy-on-write KV tree."""
__version__ = "0.1.0"
