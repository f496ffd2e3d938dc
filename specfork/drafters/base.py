"""The drafter protocol: propose candidate paths after the context; observe what was accepted.

A drafter never touches the target's cache. Deterministic drafters (n-gram lookup, greedy or
top-k model drafts) give `q=None`, read by the verifiers as one-hot at the proposed token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    """Target sampling settings; drafters that sample must draw q under the same warping."""
    temperature: float = 0.0         # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DraftPath:
    tokens: list[int]                      # continuation after the context (not incl. it)
    q: torch.Tensor | None = None          # [len(tokens), V] draft distribution per token
    drafter: str = ""                      # who proposed it (for per-drafter stats)
    meta: dict = field(default_factory=dict)


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
