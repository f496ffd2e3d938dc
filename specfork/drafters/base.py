"""The drafter protocol: propose candidate paths after the context; observe what was accepted.

A drafter never touches the target's cache. Deterministic drafters (n-gram lookup, greedy or
top-k model drafts) give `q=None`, read by the verifiers as one-hot at the proposed token.
"""
from __future__ import annotations

from typing import Protocol

from specfork.types import DraftPath, SamplingParams


class Drafter(Protocol):
    name: str

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts with these prompt tokens."""

    def propose(self, context: list[int], num_paths: int, max_len: int,
                sampling: SamplingParams) -> list[DraftPath]:
        """Up to `num_paths` paths of at most `max_len` tokens continuing `context`
        (prompt + everything emitted so far, last token included)."""

    def observe(self, context: list[int]) -> None:
        """The context after this step's accepted tokens (lets a drafter roll its own cache)."""

    def end(self) -> None:
        """The request is over: free every per-request resource."""
