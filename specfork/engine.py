"""The engine: what every decoding loop over one target shares (the model, its tokenizer, one
KV tree, the EOS set) and the checks a request passes before it touches the KV tree.

`SpecDecoder`, beam search, sessions and MCTS all run on an `Engine`, so none of them borrows
another's internals, and each rule (chat template, token-id range, context limit, EOS, pool
size) is written once.
"""
from __future__ import annotations

from specfork.errors import SpecforkError
from specfork.kv_tree import KVTree, blocks_for
from specfork.model import Model

DEFAULT_KV_TOKENS = 8192           # KV pool size when none is given (capped at the context)


def check_prompt(prompt) -> None:
    """A prompt must hold something: empty or whitespace-only text, or no token ids, is an error."""
    if (isinstance(prompt, str) and not prompt.strip()) or len(prompt) == 0:
        raise SpecforkError("the prompt is empty")


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SpecforkError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def eos_ids(model: Model, tokenizer=None, given: list[int] | None = None) -> set[int]:
    """EOS ids: those given, else the generation config's (one id or a list, as Llama 3 has),
    else the tokenizer's; empty when none is known."""
    eos = model.hf.generation_config.eos_token_id if given is None else given
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))


class Engine:
    """One target, its tokenizer and one KV tree, shared by every loop that decodes on them.

    `forks`/`fork_tokens` reserve pool room beyond `max_kv_tokens` for that many live forks of
    a request's branch, each appending up to `fork_tokens` (draft paths under verification)."""

    def __init__(self, model: Model, tokenizer=None, max_kv_tokens: int | None = None,
                 block_size: int | None = None, eos_token_ids: list[int] | None = None,
                 forks: int = 0, fork_tokens: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.context_len = model.max_positions
        self.max_kv_tokens = max_kv_tokens or min(self.context_len, DEFAULT_KV_TOKENS)
        bs = block_size or model.block_size
        self.kv = KVTree(model.make_pool(
            num_blocks=blocks_for(self.max_kv_tokens, bs, forks, fork_tokens), block_size=bs))
        self.eos = eos_ids(model, tokenizer, eos_token_ids)

    @property
    def pool(self):
        return self.kv.pool

    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        """Token ids of a prompt: text through the chat template (unless `raw` or the tokenizer
        has none), ids as given; both checked."""
        check_prompt(prompt)
        if not isinstance(prompt, str) or self.tokenizer is None:
            ids = [int(t) for t in prompt]
        elif not raw and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True,
                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        check_prompt(ids)
        check_token_ids(ids, self.model.vocab_size)
        return list(ids)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """The prompt and every new token must fit the model's positions and the KV pool."""
        limit = min(self.context_len, self.max_kv_tokens)
        if prompt_len + max_new_tokens > limit:
            raise SpecforkError(f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens "
                                f"exceeds the context of {limit} tokens")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
