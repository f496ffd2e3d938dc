"""Adaptive drafting: the controller turns speculation off where it cannot pay, keeps it where
it does, brings a cheap drafter back when its shadow score recovers and probes a costly one;
output stays exactly HF greedy either way; the cost model is timed and interpolated."""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specfork import adaptive, cost_model
from specfork.adaptive import DraftController, matched
from specfork.cost_model import CostModel
from specfork.decoder import SpecDecoder
from specfork.drafters.ngram import NgramDrafter
from specfork.kv_tree import KVTree
from specfork.model import Model
from specfork.types import DraftPath

V = 64


def _tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


class Scripted:
    """A path drafter that proposes `script(context)` (one path) and sleeps nothing."""

    def __init__(self, name, script):
        self.name, self.script = name, script

    def begin(self, prompt_ids):
        pass

    def observe(self, context):
        pass

    def end(self):
        pass

    def propose(self, context, num_paths, max_len, sampling):
        toks = self.script(context)[:max_len]
        return [DraftPath(toks, None, self.name)] if toks and num_paths else []


def _cost(per_row=0.1):
    """A plain step costs 1.0 s; each extra tree row `per_row` more."""
    return CostModel({n: 1.0 + per_row * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64)})


def _fixed():
    """A verify tree costs a lot more than one row (drafting must earn it), whatever this
    busy or idle machine measures (no online offset)."""
    return CostModel({n: 1e-3 * (1 + 0.2 * (n - 1)) for n in cost_model.SIZES}, rate=0.0)


def _run(ctl, truth, step_guess, steps, seconds=0.0):
    """Drive the controller as the decoder does: plan, every drafter with a depth (or shadowed)
    proposes `step_guess(i, k)`, the target emits `truth` tokens."""
    for _ in range(steps):
        depths = ctl.plan()
        props, secs = [], []
        for i, k in enumerate(depths):
            if k or ctl.cheap(i):
                props.append([step_guess(i, ctl.draft_len)])
                secs.append(seconds)
            else:
                props.append(None)
                secs.append(0.0)
        emitted = truth(depths, props)
        ctl.update(depths, props, secs, emitted, 1 + sum(depths), 1.0 + 0.1 * sum(depths))
    return ctl


def test_matched_is_the_longest_common_prefix():
    assert matched([[1, 2, 3], [1, 2, 4, 5]], [1, 2, 4, 9]) == (3, 4)
    assert matched([], [1]) == (0, 0)
    assert matched([[7]], [1, 2]) == (0, 1)


def test_cost_model_interpolates_and_follows_measured_steps():
    c = _cost()
    assert c.seconds(1) == 1.0 and abs(c.seconds(3) - 1.2) < 1e-9
    assert abs(c.seconds(96) - (1.0 + 0.1 * 95)) < 1e-9         # the last slope beyond
    for _ in range(50):
        c.observe(1, 1.5)                                        # this request: +0.5 s a step
    assert abs(c.seconds(4) - 1.8) < 1e-3 and abs(c.seconds(1) - 1.5) < 1e-3
    for _ in range(50):          # verifying a tree costs 0.2 s more than its rows' forward
        c.observe(4, 2.0)
    assert abs(c.seconds(4) - 2.0) < 1e-3 and abs(c.seconds(1) - 1.5) < 1e-3
    assert abs(c.seconds(4, tree=False) - 1.8) < 1e-3
    c.reset()                    # a new request: its prefix is short again; the tree's extra
    assert c.seconds(1) == 1.0 and abs(c.seconds(4) - 1.5) < 1e-3        # cost is the machine's


def test_wrong_drafter_is_switched_off_and_probed():
    ctl = DraftController([Scripted("bad", None)], draft_len=4, cost=_cost(), probe=8)
    # the drafter costs 0.3 plain steps per call: never cheap, so it is probed, not shadowed
    _run(ctl, lambda d, p: [9, 9, 9], lambda i, k: [1] * k, steps=240, seconds=0.3)
    on = [row[0] for row in ctl.trace]
    assert sum(1 for x in on[20:] if x == 0) >= 0.9 * len(on[20:])   # off, but for probes
    assert ctl.off_steps >= 0.9 * 220
    # probed again and again, each failed probe at least doubling the wait (8, 16, 32, 64
    # steps, or longer where the probe's cost over EXPLORE_AGAIN asks more)
    probes = [i for i, x in enumerate(on) if x][-4:]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert ctl.probe_steps >= 4 and gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], gaps


def test_a_cheap_lookup_stays_shadowed_through_a_slow_call():
    """A lookup drafter costs 1e-4 plain steps a call whatever the depth (n-gram:
    `flat_cost`); one call slowed 10^4 times (a GC pause) must not push it out of the shadow,
    where it would never be timed again."""
    d = Scripted("lookup", None)
    d.flat_cost = True
    ctl = DraftController([d], draft_len=4, cost=_cost(), probe=8)
    _run(ctl, lambda dp, p: [9], lambda i, k: [1], steps=20, seconds=1e-4)
    assert ctl.cheap(0) and abs(ctl.tracks[0].cost(4) - 1e-4) < 1e-9     # not 4x: flat
    _run(ctl, lambda dp, p: [9], lambda i, k: [1], steps=1, seconds=1.0)
    assert ctl.cheap(0)
    _run(ctl, lambda dp, p: [9], lambda i, k: [1], steps=60, seconds=0.5)
    assert not ctl.cheap(0)                      # slow for good: it leaves the shadow


def test_costly_probes_take_a_bounded_share_of_the_time():
    """A drafter that never pays and whose probe costs 10 decode steps beyond one (it drafts 4
    deep at 2.4 s a depth and adds 4 rows, as a cold model draft reading a long context
    might): its waits grow past doubling and past PROBE_MAX, so failed probes take at most
    EXPLORE_AGAIN of the time (doubling alone, capped at PROBE_MAX, would give it 7%)."""
    ctl = DraftController([Scripted("bad", None)], draft_len=4, cost=_cost(), probe=8)
    steps, extra = 2400, 0.0
    for _ in range(steps):
        depths = ctl.plan()
        k = depths[0]
        secs = [2.4 * 4] if k else [0.0]
        ctl.update(depths, [[[1] * 4] if k else None], secs, [9], 1 + k, 1.0 + 0.1 * k)
        extra += secs[0] + 0.1 * k
    probes = [i for i, row in enumerate(ctl.trace) if row[0]]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps[-1] >= 9.6 / adaptive.EXPLORE_AGAIN > adaptive.PROBE_MAX, gaps
    assert extra / (steps + extra) <= 1.5 * adaptive.EXPLORE_AGAIN


def test_probe_wait_resets_once_the_drafter_pays_again():
    """A costly drafter that starts paying after a wrong phase is back within PROBE_MAX steps
    and then stays on."""
    ctl = DraftController([Scripted("m", None)], draft_len=4, cost=_cost(), probe=8)
    _run(ctl, lambda d, p: [9, 9, 9], lambda i, k: [1] * k, steps=60, seconds=0.3)
    assert ctl.tracks[0].gap > 8
    _run(ctl, lambda d, p: [5] * (d[0] + 1), lambda i, k: [5] * k, steps=140, seconds=0.01)
    assert all(row[0] > 0 for row in ctl.trace[-10:]) and ctl.tracks[0].gap == 8


def test_right_drafter_stays_on_at_full_depth():
    ctl = DraftController([Scripted("good", None)], draft_len=4, cost=_cost(), probe=8)
    _run(ctl, lambda d, p: [5] * (d[0] + 1), lambda i, k: [5] * k, steps=40, seconds=0.01)
    assert ctl.off_steps == 0 and all(row[0] == 4 for row in ctl.trace[5:])


def test_cheap_drafter_comes_back_when_its_shadow_score_recovers():
    ctl = DraftController([Scripted("ngram", None)], draft_len=4, cost=_cost(), probe=10 ** 6)
    _run(ctl, lambda d, p: [9, 9], lambda i, k: [1] * k, steps=40)      # wrong: off
    assert ctl.trace[-1] == [0]
    # the text starts to repeat: its shadow proposals match what the target emits
    _run(ctl, lambda d, p: [1] * (d[0] + 1), lambda i, k: [1] * k, steps=30)
    assert ctl.trace[-1][0] > 0 and ctl.probe_steps == 0


def test_costly_drafter_is_cut_to_the_depth_that_pays():
    # first token always right, later ones never: depth 1 beats 4 (3 rows that never pay)
    ctl = DraftController([Scripted("m", None)], draft_len=4, cost=_cost(0.3), probe=8)
    _run(ctl, lambda d, p: [5, 6], lambda i, k: [5] + [7] * (k - 1), steps=40, seconds=0.05)
    assert all(row == [1] for row in ctl.trace[-10:])


def test_costly_drafter_is_probed_only_when_its_request_is_alone():
    """A probe forced on a request that shares its step would make every request in the
    batch wait on it (a cold model draft first reads the whole context)."""
    ctl = DraftController([Scripted("m", None)], draft_len=4, cost=_cost(), probe=8)
    _run(ctl, lambda d, p: [9, 9, 9], lambda i, k: [1] * k, steps=30, seconds=0.3)
    t = ctl.tracks[0]
    t.idle = t.gap                                    # its probe is due
    assert ctl.plan(ctx=(5.0, 5, 0.0)) == [0] and not t.probed      # 5 other rows: not now
    assert ctl.plan(ctx=(0.0, 0, 0.0))[0] > 0 and t.probed          # alone: probed


def test_a_drafters_catch_up_read_is_costed():
    """A model draft that must first read a long context (a prompt it never saw, or the
    tokens since it last drafted) is not planned where every request of a batch would wait on
    that read, and alone the read is spread over the tokens the request has left."""
    ctl = DraftController([Scripted("m", None)], draft_len=4, cost=_cost(), probe=8)
    _run(ctl, lambda d, p: [5] * (d[0] + 1), lambda i, k: [5] * k, steps=30, seconds=0.01)
    busy = (5.0, 5, 0.0)                              # 5 other rows share the step
    ctl.lags, ctl.left = [2], 100
    assert ctl.plan(ctx=busy)[0] > 0                  # a short read: part of drafting
    ctl.lags = [300]
    assert ctl.plan(ctx=busy) == [0]                  # its read's cost unknown: not risked
    assert ctl.plan()[0] > 0                          # alone: tried (and then timed)
    assert ctl.read(0, 300, 3.0) and not ctl.read(0, 3, 1.0)     # 10 ms a token
    assert ctl.plan(ctx=busy) == [0]                  # 3 s against 5 rows' 1.5 s step
    assert ctl.plan()[0] > 0                          # alone: 3 s over ~20 steps left
    ctl.left, ctl.lags = 2, [1000]
    assert ctl.plan() == [0]                          # 10 s over the last 2 tokens: no
    ctl.lags = [20]
    ctl.tracks[0].read_rate = 1e-4                    # a fast reader: worth it in the batch
    assert ctl.plan(ctx=busy)[0] > 0


def test_a_new_concurrent_request_inherits_what_was_measured():
    first = DraftController([Scripted("m", None)], draft_len=4, cost=_cost(), probe=8)
    _run(first, lambda d, p: [5] * (d[0] + 1), lambda i, k: [5] * k, steps=30, seconds=0.01)
    second = DraftController([Scripted("m", None)], draft_len=4, cost=_cost(), probe=8)
    assert second.tracks[0].chance(4) != first.tracks[0].chance(4)          # the prior
    second.inherit(first)
    second.warm_start = True
    second.begin()
    assert second.tracks[0].chance(4) == first.tracks[0].chance(4)
    assert second.tracks[0] is not first.tracks[0] and second.kappa == first.kappa
    assert second.tracks[0].seconds == first.tracks[0].seconds > 0


def _run_paths(ctl, right: int, steps: int):
    """Drive a controller of one cheap path drafter that proposes 3 paths (best first) each
    step, of which only path `right` matches what the target emits."""
    for _ in range(steps):
        depths = ctl.plan()
        ctl.asked = [3]                               # as Request asks a cheap drafter
        paths = [[5 if j == right else 7] * ctl.draft_len for j in range(3)]
        emitted = [5] * (depths[0] + 1)
        rows = 1 + min(ctl.budget, 3) * depths[0]
        ctl.update(depths, [paths], [0.0], emitted, rows, ctl.cost.seconds(rows))


def test_path_budget_narrows_to_the_paths_that_pay():
    """Rows cost 0.3 plain steps each: when only the first path is ever right the tree keeps
    one path (full depth); when the second is, it keeps two; a cheap drafter is scored on all
    three either way, so the controller knows what a wider tree would catch."""
    ctl = DraftController([Scripted("ngram", None)], draft_len=4, cost=_cost(0.3),
                          probe=10 ** 6, num_paths=3)
    _run_paths(ctl, right=0, steps=40)
    assert ctl.budgets[-10:] == [1] * 10 and [r[0] for r in ctl.trace[-10:]] == [4] * 10
    ctl = DraftController([Scripted("ngram", None)], draft_len=4, cost=_cost(0.3),
                          probe=10 ** 6, num_paths=3)
    _run_paths(ctl, right=1, steps=40)
    assert ctl.budgets[-10:] == [2] * 10 and ctl.stats(["ngram"])["path_budget"] == ctl.budgets


def test_path_budget_stays_wide_where_rows_are_nearly_free():
    ctl = DraftController([Scripted("ngram", None)], draft_len=4, cost=_cost(0.001),
                          probe=10 ** 6, num_paths=3)
    _run_paths(ctl, right=2, steps=40)
    assert ctl.budgets[-10:] == [3] * 10


def _greedy_ref(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_adaptive_decoder_stays_exact_and_switches_a_useless_drafter_off():
    hf = _tiny()
    model = Model(hf)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = _greedy_ref(hf, prompt, 48)
    bad = Scripted("bad", lambda ctx: [(ctx[-1] + 7) % V, 0, 0])
    dec = SpecDecoder(model, None, [bad], num_paths=1, draft_len=3, eos_token_ids=[],
                      adaptive=True, max_kv_tokens=128)
    dec.controller.cost = _fixed()
    r = dec.generate(prompt, max_new_tokens=48)
    assert r.token_ids == ref
    ad = r.stats["adaptive"]
    assert ad["off_steps"] >= 0.6 * r.stats["spec_steps"]
    assert r.stats["kv_blocks_leaked"] == 0
    # an oracle that knows the greedy output: speculation stays on, tau well above 1
    truth = prompt + ref

    def oracle(ctx):
        return truth[len(ctx):len(ctx) + 3]

    dec = SpecDecoder(model, None, [Scripted("oracle", oracle), NgramDrafter()], num_paths=2,
                      draft_len=3, eos_token_ids=[], adaptive=True, max_kv_tokens=128)
    dec.controller.cost = _fixed()
    r = dec.generate(prompt, max_new_tokens=48)
    assert r.token_ids == ref
    assert r.stats["adaptive"]["off_steps"] == 0 and r.stats["mean_accepted"] > 3.0
    assert len(r.stats["adaptive"]["depth"]["0:oracle"]) == r.stats["spec_steps"]


def test_a_lone_request_skips_the_plan_search_while_off_and_quiet(monkeypatch):
    """A request alone on the engine, off because its drafter proposes nothing: the steps that
    teach nothing skip the plan search (at most REPLAN in a row), as they do for a controller
    driven directly, and the output stays HF greedy."""
    hf = _tiny()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    dec = SpecDecoder(Model(hf), None, [Scripted("mute", lambda ctx: [])], num_paths=1,
                      draft_len=3, eos_token_ids=[], adaptive=True, max_kv_tokens=128)
    dec.controller.cost = _fixed()
    searched = []
    best = DraftController._best
    monkeypatch.setattr(DraftController, "_best",
                        lambda self, *a: searched.append(1) or best(self, *a))
    r = dec.generate(prompt, max_new_tokens=48)
    assert r.token_ids == _greedy_ref(hf, prompt, 48)
    off = r.stats["adaptive"]["off_steps"]
    assert off >= 16
    assert len(searched) <= r.stats["spec_steps"] - off + off // (adaptive.REPLAN + 1) + 2, \
        len(searched)


def test_calibration_times_every_size_and_frees_its_blocks():
    model = Model(_tiny())
    kv = KVTree(model.make_pool(num_blocks=64, block_size=16))
    table = cost_model.calibrate(model, kv, max_rows=16, reps=1)
    assert sorted(table) == [1, 2, 4, 8, 12, 16] and all(t > 0 for t in table.values())
    assert kv.pool.used_blocks == 0


def test_deeper_depths_lean_on_the_depth_above():
    """A drafter asked one token deep, and right every time, has no counts deeper down: its
    second token's chance follows its first's, not the prior's coin toss (with which a
    prior-led plan never drafts it deeper)."""
    t = adaptive._Track(4, tree=False)
    for _ in range(20):
        t.score([[5]], [5, 6])
    c = t.chance(4)
    assert c[0] > 0.9 and c[1] / c[0] > 0.8 and c[3] > 0.5, c
    for _ in range(20):                      # now measured deeper: its own counts decide
        t.score([[5, 7]], [5, 6])
    c = t.chance(4)
    assert c[0] > 0.9 and c[1] / c[0] < 0.3, c


def _lookup_beside_a_costly_draft(steps: int = 128) -> DraftController:
    """A request beside a fast target: a cheap lookup that is always wrong and a model draft
    (timed in an earlier request: 0.2 steps a depth, its catch-up read 0.025 steps a token)
    that is always right."""
    look = Scripted("lookup", None)
    look.flat_cost = True
    ctl = DraftController([look, Scripted("m", None)], draft_len=4, cost=_cost(), probe=8)
    lk, m = ctl.tracks
    lk.seconds, lk.timed = 1e-4, True
    m.seconds, m.timed = 0.2, True
    m.read_rate, m.read_timed = 0.025, True
    lag = 50
    for s in range(steps):
        ctl.lags, ctl.left = [0, lag], steps - s
        depths = ctl.plan()
        k = depths[1]
        props = [[[9] * 4], [[5] * k] if k else None]
        ctl.update(depths, props, [1e-4, 0.2 * k], [5] * (k + 1), 1 + sum(depths),
                   1.0 + 0.1 * sum(depths))
        lag = 2 if k else lag + 1
    return ctl


def test_a_costly_drafter_out_from_the_first_step_is_probed_early_in_its_request():
    """Beside a fast target a model draft loses the first plan to a cheap lookup, and then
    sits out. Its first probe is due on what the request has left: a wait on elapsed time
    would not come due in 128 tokens, as the read it must catch up on (the prompt, then every
    token it sat out) grows with the wait. Where it is right, it drafts from then on."""
    ctl = _lookup_beside_a_costly_draft()
    first = next((s for s, row in enumerate(ctl.trace) if row[1]), None)
    assert ctl.trace[0][0] and not ctl.trace[0][1]            # the lookup won the first plan
    assert first is not None and first <= 12, (first, ctl.trace)
    assert all(row[1] > 1 for row in ctl.trace[-20:]), ctl.trace[-20:]


def test_stats_list_each_probe_with_its_outcome():
    """`adaptive.probes` in a request's stats: each probe's step, drafter, whether it was the
    drafter's first verified draft in the request, and whether the drafter was kept after it
    (what eval/probe_outcomes.py counts)."""
    ctl = _lookup_beside_a_costly_draft()
    probes = ctl.stats(["lookup", "m"])["probes"]
    assert probes and probes[0]["drafter"] == "m", probes
    assert probes[0]["first"] and probes[0]["kept"], probes
    assert probes[0]["step"] == next(s for s, row in enumerate(ctl.trace) if row[1])
    ctl.begin()
    assert ctl.stats(["lookup", "m"])["probes"] == []
