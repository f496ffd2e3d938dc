import pytest
import torch
from hypothesis import given, settings, strategies as st

from specfork.types import DraftPath
from specfork.token_tree import TokenTree

V = 8


def qrows(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, V, generator=torch.Generator().manual_seed(seed)).softmax(-1)


def test_shared_prefixes_stored_once_and_every_path_keeps_its_proposals():
    qa, qb = qrows(3, 0), qrows(3, 1)
    paths = [DraftPath([1, 2, 3], qa, "a"), DraftPath([1, 2, 4], qb, "b"),
             DraftPath([5], None, "c"), DraftPath([1, 2, 3], None, "c")]
    t = TokenTree.build(9, paths, budget=100)
    assert t.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert t.parent.tolist() == [-1, 0, 1, 2, 2, 0]
    assert t.depth.tolist() == [0, 1, 2, 3, 3, 1]
    assert t.children == [[1, 5], [2], [3, 4], [], [], []]
    assert [[(c, d) for c, _, d in props] for props in t.proposals] == [
        [(1, "a"), (1, "b"), (5, "c"), (1, "c")],
        [(2, "a"), (2, "b"), (2, "c")],
        [(3, "a"), (4, "b"), (3, "c")],
        [], [], []]
    # q rows are the drafter's own rows for that token (views, no copies)
    assert torch.equal(t.proposals[0][0][1], qa[0]) and torch.equal(t.proposals[0][1][1], qb[0])
    assert torch.equal(t.proposals[2][1][1], qb[2]) and t.proposals[2][2][1] is None
    assert t.proposals[0][2][1] is None
    assert t.node_drafters == [set(), {"a", "b", "c"}, {"a", "b", "c"}, {"a", "c"}, {"b"}, {"c"}]
    assert t.leaf_paths() == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 5]]
    assert t.path_to(4) == [0, 1, 2, 4] and t.path_to(0) == [0]
    assert t.positions(7).tolist() == [7, 8, 9, 10, 10, 8]


def test_budget_truncates_paths_in_order():
    paths = [DraftPath([1, 2, 3]), DraftPath([1, 2, 4, 6]), DraftPath([5])]
    t = TokenTree.build(0, paths, budget=4)           # path 2 stops after its new node 4
    assert t.tokens.tolist() == [0, 1, 2, 3, 4]
    assert [len(p) for p in t.proposals] == [2, 2, 2, 0, 0]
    t = TokenTree.build(0, paths, budget=2)           # path 1 cut at depth 2; no one else enters
    assert t.tokens.tolist() == [0, 1, 2]
    assert [len(p) for p in t.proposals] == [1, 1, 0]


def test_full_budget_drops_even_steps_onto_existing_nodes():
    """A step is kept or dropped by what came before it, never by its own token: keeping only
    proposals that happen to hit an existing node would bias the verifier towards them."""
    t = TokenTree.build(0, [DraftPath([1, 2]), DraftPath([1, 2])], budget=2)
    assert t.tokens.tolist() == [0, 1, 2]
    assert t.proposals[0] == [(1, None, "")] and t.proposals[1] == [(2, None, "")]


def test_empty_tree_is_just_the_root():
    for paths, budget in [([], 5), ([DraftPath([1, 2])], 0), ([DraftPath([])], 3)]:
        t = TokenTree.build(4, paths, budget)
        assert t.tokens.tolist() == [4] and t.parent.tolist() == [-1]
        assert t.leaf_paths() == [[0]] and t.ancestor_mask().tolist() == [[True]]


def test_q_with_too_few_rows_is_refused():
    with pytest.raises(ValueError, match="q has 1 rows for 2 tokens"):
        TokenTree.build(0, [DraftPath([1, 2], qrows(1, 0), "x")], 10)


def naive(root, paths, budget):
    """Reference trie keyed by token prefixes: (nodes in creation order, proposal triples)."""
    nodes, props = [()], []
    for k, p in enumerate(paths):
        for i in range(len(p)):
            if len(nodes) - 1 >= budget:
                break
            pre = tuple(p[:i + 1])
            if pre not in nodes:
                nodes.append(pre)
            props.append((pre[:-1], pre[-1], f"d{k}"))
    return nodes, props


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=7), st.integers(0, 30))
def test_trie_matches_reference_and_mask_matches_loop(paths, budget):
    t = TokenTree.build(7, [DraftPath(p, None, f"d{k}") for k, p in enumerate(paths)], budget)
    T = len(t)
    prefix = [tuple(t.tokens[n].item() for n in t.path_to(u)[1:]) for u in range(T)]
    nodes, props = naive(7, paths, budget)
    assert prefix == nodes
    assert sorted((prefix[u], t.tokens[c].item(), d) for u in range(T)
                  for c, _, d in t.proposals[u]) == sorted(props)
    assert all(t.parent[c] == u for u in range(T) for c in t.children[u])
    assert (t.depth[1:] == t.depth[t.parent[1:]] + 1).all()
    assert (t.parent[1:] < torch.arange(1, T)).all()
    ref = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            ref[i, j] = True
            j = t.parent[j].item()
    assert torch.equal(t.ancestor_mask(), ref)
    leaves = t.leaf_paths()
    assert sorted(lp[-1] for lp in leaves) == [u for u in range(T) if not t.children[u]]
    assert all(ref[lp[-1], lp].all() and ref[lp[-1]].sum() == len(lp) for lp in leaves)
