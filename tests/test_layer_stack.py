"""The decoder-layer loop as one compiled op (`specfork/kernels/layer_stack.cpp`): the same bits
as the Python loop it replaces, in every weight format, for decode steps, ROWS verify trees,
batches of requests and captured features; and it does run where it should."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_model, tree_and_steps
from specfork.kernels import slot_attention as op

pytestmark = pytest.mark.skipif(not op.available(16), reason="the CPU ops are not built here")


def _decode(m, steps: int = 6, capture=None):
    """Prefill 40 random tokens, then `steps` decode steps: (logits per step, features per
    step, the pool's keys and values)."""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 96, (40,), generator=g)
    pool = m.make_pool(num_blocks=64)
    kv = KVTree(pool)
    B = kv.new_branch()
    s = kv.append(B, 40)
    m.forward(prompt, torch.arange(40), pool, AttnMeta.prefill(m, s[:0], s))
    logits, feats = [], []
    for i in range(steps):
        meta = AttnMeta.prefill(m, kv.slots(B), kv.append(B, 1))
        out = m.forward(torch.tensor([7 + i]), torch.tensor([40 + i]), pool, meta,
                        capture=capture)
        lg, ft = out if capture is not None else (out, None)
        logits.append(lg)
        feats.append(ft)
    return logits, feats, pool.k.clone(), pool.v.clone()


def _runs(monkeypatch):
    """Counts the forwards that went through the op."""
    from specfork.model import Model
    calls = []
    plan = Model._stack_weights
    monkeypatch.setattr(Model, "_stack_weights", lambda self, rows: calls.append(rows)
                        or plan(self, rows))
    return calls


def _equal(a, b):
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a is None and b is None or torch.equal(a, b)


def _low(fmt: str) -> int:
    """Low-bit models get head size 32 (hidden 128): their small ops then run fused."""
    return 128 if fmt in ("int8", "int4") else 64


@pytest.mark.parametrize("fmt,hidden", [("float32", 64), ("bfloat16", 64), ("bfloat16", 128),
                                        ("int8", 128), ("int4", 128), ("int4", 64)])
def test_decode_steps_match_the_python_loop_bit_for_bit(monkeypatch, fmt, hidden):
    """Logits, captured features (EAGLE-3's three layers and EAGLE-1's final norm) and the K/V
    written, op against loop; under the low-bit formats with head size 32 the fused small ops
    on both sides, with head size 16 torch's."""
    from specfork.weights import native
    m = tiny_model(fmt, hidden=hidden)
    assert m.fused_ops == (hidden == 128 and fmt != "float32" and native())
    calls = _runs(monkeypatch)
    on = _decode(m, capture=(0, 1, 2))
    # under a low-bit format the prompt's rows attend row by row too: the op takes them
    want = ([40] if m.rows_exact else []) + [1] * 6
    assert calls == want
    monkeypatch.setenv("SPECFORK_LAYER_STACK", "0")
    off = _decode(m, capture=(0, 1, 2))
    assert calls == want                          # the loop: no op call
    assert _equal(on, off)
    assert not _equal(on[0], _decode(tiny_model(fmt, hidden=96))[0])     # not vacuous


@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_a_float16_kv_pool_runs_through_the_op_as_the_loop(monkeypatch, fmt):
    """`--kv-cache float16`: the compiled loop rounds each new K/V row to the pool's float16
    as the Python loop's codec does, and both read it back through the slot op: the same
    logits and stored K/V, bit for bit, every decode step in the op."""
    from specfork.attention import uses_slot_op
    m = tiny_model(fmt, kv_cache="float16", hidden=_low(fmt))
    assert uses_slot_op(m) and m.rows_exact
    calls = _runs(monkeypatch)
    on = _decode(m)
    assert calls == [40] + [1] * 6 and on[2].dtype == torch.float16
    monkeypatch.setenv("SPECFORK_LAYER_STACK", "0")
    assert _equal(on, _decode(m))
    fp32 = tiny_model(fmt, kv_cache="float32", hidden=_low(fmt))
    assert not _equal(on[0], _decode(fp32)[0])                           # fp32 K/V differs


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_rows_trees_match_the_python_loop_and_the_decode_steps(monkeypatch, fmt):
    """A ROWS verify tree over two CoW forks (a node written twice) through the op equals the
    loop, and its rows equal the decode steps at their positions (the low-bit exactness
    contract), with the op on both sides."""
    calls = _runs(monkeypatch)
    on = tree_and_steps(tiny_model(fmt, hidden=_low(fmt)), P=60)
    assert 4 in calls and calls.count(1) == 3
    monkeypatch.setenv("SPECFORK_LAYER_STACK", "0")
    off = tree_and_steps(tiny_model(fmt, hidden=_low(fmt)), P=60)
    assert _equal(on, off)
    tree, steps, tree_k, step_k = on
    assert torch.equal(tree[:3], torch.cat(steps)) and torch.equal(tree_k, step_k)


def test_a_batch_of_requests_goes_through_the_op_and_matches_each_alone(monkeypatch):
    """Four requests decoding together run one op call per step and emit, token for token,
    what each emits alone through the Python loop."""
    from specfork.decoder import SpecDecoder
    m = tiny_model("int4", hidden=_low("int4"))
    dec = SpecDecoder(m, None, eos_token_ids=[], max_kv_tokens=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (9 + 4 * i,), generator=g).tolist() for i in range(4)]
    monkeypatch.setenv("SPECFORK_LAYER_STACK", "0")
    alone = [dec.generate(p, max_new_tokens=16).token_ids for p in prompts]
    monkeypatch.delenv("SPECFORK_LAYER_STACK")
    calls = _runs(monkeypatch)
    reqs = [dec.request(p, 16)[0] for p in prompts]
    dec.engine.run(reqs)
    assert [r.out for r in reqs] == alone
    assert calls.count(4) >= 10
    assert dec.pool.used_blocks == 0
