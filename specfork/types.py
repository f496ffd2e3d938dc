"""What flows between the stages: a request's sampling settings (set where a request starts) and
a drafter's proposal (read by the token tree and the verifiers). Both live here, upstream of
every stage, so no stage imports from another one upstream of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class GenerateOutput:
    """One request's result: the new tokens (and text), the prompt's ids, and measured stats."""
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    stats: dict = field(default_factory=dict)
