"""Verifiers: greedy on hand-built logits; sampling checked for losslessness.

The losslessness tests decode the first two tokens after a context with a toy Markov "target"
over V=5 tokens (p(x1) = P[ROOT], p(x2 | x1) = P[x1]) while drafters propose from their own
tables, and chi-square test the empirical first token and (first, second) token against the
target. A step that emits only one token is followed by a second step rooted at it, exactly
as the decoder runs. A verifier with a broken residual must fail the same test.
"""
import itertools
import math

import pytest
import torch

import specfork.verifiers.sampling as vs
from specfork.types import DraftPath, SamplingParams
from specfork.sampling import probs_from_logits
from specfork.token_tree import TokenTree
from specfork.verifiers.greedy import verify_greedy
from specfork.verifiers.sampling import residual, verify_sampling

V, ROOT, TRIALS = 5, 0, 16_000


def markov(seed: int, sharp: float) -> torch.Tensor:
    """[V, V] row-stochastic table, row = previous token."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=g, dtype=torch.float64) * sharp).softmax(-1)


P = markov(0, 1.0)                       # target
Q1, Q2 = markov(1, 1.5), markov(2, 0.7)  # two sampled drafters, far from P
DET1 = markov(3, 1.0).argmax(-1)         # deterministic drafters: next token per previous token
DET2 = (P.argmax(-1) + 1) % V


# -- greedy ---------------------------------------------------------------------------------
def onehot_logits(tree: TokenTree, best: dict[int, int]) -> torch.Tensor:
    logits = torch.zeros(len(tree), V)
    for u, tok in best.items():
        logits[u, tok] = 3.0
    return logits


def test_greedy_follows_argmax_and_emits_bonus():
    tree = TokenTree.build(0, [DraftPath([1, 2, 3]), DraftPath([1, 4]), DraftPath([2])], 10)
    # nodes: 0 root, 1:'1', 2:'2'(under 1), 3:'3', 4:'4'(under 1), 5:'2'(under root)
    assert verify_greedy(tree, onehot_logits(tree, {0: 1, 1: 4, 4: 0})) == ([0, 1, 4], 0)
    assert verify_greedy(tree, onehot_logits(tree, {0: 1, 1: 2, 2: 3, 3: 4})) == ([0, 1, 2, 3], 4)
    assert verify_greedy(tree, onehot_logits(tree, {0: 2, 5: 2})) == ([0, 5], 2)
    assert verify_greedy(tree, onehot_logits(tree, {0: 3})) == ([0], 3)


def test_greedy_ties_take_the_first_max_like_hf():
    tree = TokenTree.build(0, [DraftPath([4]), DraftPath([2])], 10)
    logits = torch.zeros(len(tree), V)
    logits[0, [2, 4]] = 1.0                   # tie between two drafted children: 2 wins
    assert verify_greedy(tree, logits) == ([0, 2], 0)
    logits[0, 1] = 1.0                        # undrafted 1 ties first: nothing accepted
    assert verify_greedy(tree, logits) == ([0], 1)


def test_sampling_at_temperature_zero_is_greedy():
    tree = TokenTree.build(0, [DraftPath([1, 2], torch.full((2, V), 0.2), "s")], 10)
    logits = onehot_logits(tree, {0: 1, 1: 3})
    assert verify_sampling(tree, logits, SamplingParams(temperature=0.0)) == ([0, 1], 3)


# -- sampling: edge cases -------------------------------------------------------------------
def test_residual_subtracts_q_and_reports_empty():
    p = torch.tensor([0.5, 0.3, 0.2])
    torch.testing.assert_close(residual(p, torch.tensor([0.2, 0.6, 0.2]), 1),
                               torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    assert residual(p, p.clone(), 0) is None


def test_proposal_with_zero_q_is_never_accepted_and_leaves_p_alone():
    q = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0]])
    tree = TokenTree.build(0, [DraftPath([1], q, "bad")], 10)
    logits = torch.full((2, V), -30.0)
    logits[:, 1] = 0.0                                    # target: almost surely token 1
    sp = SamplingParams(temperature=1.0, generator=torch.Generator().manual_seed(0))
    for _ in range(20):
        assert verify_sampling(tree, logits, sp) == ([0], 1)


def test_empty_residual_falls_back_to_p():
    q = (P[ROOT] * 2).float()[None]                      # a broken q with mass 2: p - q <= 0
    tree = TokenTree.build(ROOT, [DraftPath([3], q, "x"), DraftPath([4], q, "x")], 10)
    logits = P.log().float()[tree.tokens]
    sp = SamplingParams(temperature=1.0, generator=torch.Generator().manual_seed(0))
    for _ in range(50):
        path, nxt = verify_sampling(tree, logits, sp)
        assert 0 <= nxt < V and path in ([0], [0, 1], [0, 2])


# -- sampling: losslessness -----------------------------------------------------------------
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells the target gives 0 must stay empty."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "sampled a token the target never emits"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = counts.sum() * probs / probs.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(counts.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))   # chi2 survival function


class Drafts:
    """Draft paths drawn in bulk, `chunk` steps per root token at a time (drafting step by step
    in python would dominate the runtime); every draw is used once, so steps are independent.
    spec: (kind, table, name, n_paths, length); kind 's' samples from table, 'd' follows it."""

    def __init__(self, spec, g: torch.Generator, chunk: int = 2048):
        self.spec, self.g, self.chunk = spec, g, chunk
        self.pools: list[list] = [[] for _ in range(V)]
        self.used = [chunk] * V

    def draw(self, root: int) -> list:
        pool = []
        for kind, table, name, n, length in self.spec:
            last, toks, rows = torch.full((self.chunk, n), root), [], []
            for _ in range(length):
                if kind == "s":
                    rows.append(table[last].float())                         # [C, n, V]
                    u = torch.rand(self.chunk, n, 1, generator=self.g)       # inverse CDF
                    last = (rows[-1].cumsum(-1) < u).sum(-1).clamp(max=V - 1)
                else:
                    last = table[last]
                toks.append(last)
            q = torch.stack(rows, 2) if rows else None                       # [C, n, L, V]
            pool.append((name, n, torch.stack(toks, 2).tolist(), q))         # [C][n][L]
        return pool

    def take(self, root: int) -> list[DraftPath]:
        if self.used[root] == self.chunk:
            self.pools[root], self.used[root] = self.draw(root), 0
        i = self.used[root]
        self.used[root] += 1
        return [DraftPath(toks[i][j], None if q is None else q[i, j], name)
                for name, n, toks, q in self.pools[root] for j in range(n)]


def joint_counts(spec, budget, sp, trials=TRIALS) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first two generated tokens over `trials` decodes, and the target joint."""
    logp = P.log().float()
    target = probs_from_logits(logp, sp.temperature, sp.top_k, sp.top_p).double()  # [V, V]
    drafts = Drafts(spec, sp.generator)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        out = [ROOT]
        while len(out) < 3:                            # one speculative step at a time
            tree = TokenTree.build(out[-1], drafts.take(out[-1]), budget)
            path, nxt = verify_sampling(tree, logp[tree.tokens], sp)
            out += tree.tokens[path[1:]].tolist() + [nxt]
        counts[out[1], out[2]] += 1
    return counts, target[ROOT][:, None] * target


SCENARIOS = {
    "iid_sampled": ([("s", Q1, "q1", 3, 3)], 64, {}),
    "two_drafters": ([("s", Q1, "q1", 2, 2), ("s", Q2, "q2", 2, 3)], 64, {}),
    "deterministic": ([("d", DET1, "d1", 1, 3), ("d", DET2, "d2", 1, 2)], 64, {}),
    "mixed_warped": ([("d", DET2, "d2", 1, 2), ("s", Q1, "q1", 2, 2), ("s", Q2, "q2", 1, 3)], 64,
                     dict(temperature=0.8, top_k=4)),
    "budget_cut": ([("s", Q1, "q1", 4, 3)], 3, {}),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_sampling_is_lossless(name):
    spec, budget, warp = SCENARIOS[name]
    sp = SamplingParams(**{"temperature": 1.0, **warp},
                        generator=torch.Generator().manual_seed(1234))
    counts, target = joint_counts(spec, budget, sp)
    assert chi2_pvalue(counts.sum(1), target.sum(1)) > 0.01      # first token
    assert chi2_pvalue(counts, target) > 0.01                    # (first, second) token


def test_chi2_catches_a_residual_that_does_not_subtract_q(monkeypatch):
    monkeypatch.setattr(vs, "residual", lambda p, q, x: p)
    sp = SamplingParams(temperature=1.0, generator=torch.Generator().manual_seed(1234))
    counts, target = joint_counts(SCENARIOS["iid_sampled"][0], 64, sp, trials=TRIALS // 4)
    assert chi2_pvalue(counts.sum(1), target.sum(1)) < 1e-6
    assert chi2_pvalue(counts, target) < 1e-6


# -- sampling: exact, by enumerating every draft ---------------------------------------------
def exact_step(tree: TokenTree, u: int, k: int, p: torch.Tensor, Pt: torch.Tensor) -> dict:
    """Exact distribution of this step's emitted tokens (cut to 2) from node u, proposal k on,
    with current target p: the verifier's rule written as probabilities."""
    props = tree.proposals[u]
    if k == len(props):
        return {(y,): float(p[y]) for y in range(len(p))}
    c, q, _ = props[k]
    x = int(tree.tokens[c])
    qx = 1.0 if q is None else float(q[x])
    if qx == 0.0:
        return exact_step(tree, u, k + 1, p, Pt)
    acc = min(1.0, float(p[x]) / qx)
    out: dict = {}
    if acc > 0:
        for s, pr in exact_step(tree, c, 0, Pt[x], Pt).items():
            out[((x,) + s)[:2]] = out.get(((x,) + s)[:2], 0.0) + acc * pr
    if acc < 1:
        r = (p - (torch.eye(len(p), dtype=p.dtype)[x] if q is None else q)).clamp(min=0)
        for s, pr in exact_step(tree, u, k + 1, r / r.sum(), Pt).items():
            out[s] = out.get(s, 0.0) + (1 - acc) * pr
    return out


def test_budget_cut_is_exactly_lossless():
    """Three paths of 2 tokens i.i.d. from Q over 3 tokens, every budget: summing the exact
    verifier outcome over all 729 drafts must give the target's joint. Catches biases far
    below chi-square resolution (keeping over-budget steps that reuse a node is off by ~1e-4)."""
    n, Pt, Qt = 3, markov(5, 2.0)[:3, :3], markov(6, 2.0)[:3, :3]
    Pt, Qt = Pt / Pt.sum(-1, keepdim=True), Qt / Qt.sum(-1, keepdim=True)
    seqs = list(itertools.product(range(n), repeat=2))
    target = Pt[ROOT][:, None] * Pt
    for budget in range(1, 7):
        joint = torch.zeros(n, n, dtype=torch.float64)
        for combo in itertools.product(seqs, repeat=3):
            w = math.prod(Qt[ROOT, a] * Qt[a, b] for a, b in combo)
            tree = TokenTree.build(ROOT, [DraftPath(list(s), Qt[[ROOT, s[0]]], "q")
                                          for s in combo], budget)
            for s, pr in exact_step(tree, 0, 0, Pt[ROOT], Pt).items():
                if len(s) == 1:
                    joint[s[0]] += w * pr * Pt[s[0]]
                else:
                    joint[s] += w * pr
        torch.testing.assert_close(joint, target, rtol=0, atol=1e-12)
