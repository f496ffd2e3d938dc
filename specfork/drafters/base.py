"""The drafter protocol: propose candidate paths after the context; observe what was accepted.

A drafter never touches the target's cache. Deterministic drafters (n-gram lookup, greedy or
top-k model drafts, EAGLE trees) give `q=None`, read by the verifiers as one-hot at the
proposed token. A tree drafter (EAGLE) has `tree_tokens`, its own node budget: it proposes its
tree as root-to-leaf paths and does not share the path budget of the others.
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
        """The context after this step's accepted tokens (lets a drafter roll its own cache).

        A drafter that reads the target's hidden states names the layers in `features` (a
        tuple of layer indices; L = the final norm's output) and is called as
        `observe(context, features)` instead, with `features [k, F]` the target's at positions
        len(context)-1-k .. len(context)-2: after the prompt's prefill, and after each verify
        step for the accepted path's nodes (the root included)."""

    def end(self) -> None:
        """The request is over: free every per-request resource."""

    def spawn(self) -> "Drafter":
        """Another drafter like this one for a concurrent request (shared weights, its own
        per-request state and KV tree)."""
