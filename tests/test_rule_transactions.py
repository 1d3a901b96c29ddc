"""A step is a transaction of the rule's state: a step that falls back (or raises on bad labels) leaves every
stateful rule's state exactly as before it, and no step copies a rule's whole state (O(N) per step, whatever
the dataset's size)."""
from __future__ import annotations

import math

import pytest
import torch

from capskip_fx.rules import KABENA, RandomSkip, Rule, SelectiveBackprop, StaleSB, UpperBoundIS
from capskip_fx.rules.base import Journal, Selection
from capskip_fx.runtime.forwards import ForwardContext
from capskip_fx.runtime.state import RuntimeState

N, C, D, M = 16, 5, 4, 200  # batch, classes, features, dataset size


class CountingRule(Rule):
    """A rule of a user's, not journaled: undone from its state_dict() copy."""

    name = "counting"
    needs_labels = True
    _state_keys = ("seen",)

    def __init__(self):
        self.seen = torch.zeros(M)

    def select(self, view):
        self.seen[view.index] += 1
        return Selection(weight=torch.ones(view.n))


RULES = {
    "sb": lambda: SelectiveBackprop(prime_epochs=0, history=24),
    "stale_sb": lambda: StaleSB(prime_epochs=0, history=24, num_examples=M),
    "stale_sb_growing": lambda: StaleSB(prime_epochs=0, history=24),  # its cache grows with the indices seen
    "kabena": lambda: KABENA(tau=0.5),
    "ub": lambda: UpperBoundIS(tau_th=0.0),
    "random_match_sb": lambda: RandomSkip(match=SelectiveBackprop(prime_epochs=0, history=24)),
    "user_rule": CountingRule,
}


def batch(step: int, nan_h: bool = False, bad_label: bool = False):
    g = torch.Generator().manual_seed(step)
    z = torch.randn(N, C, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, C, (N,), generator=g)
    g_ = (z.softmax(1) - torch.nn.functional.one_hot(y, C).double()) / N
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    if nan_h:
        h[3, 1] = math.nan  # the step falls back (non-finite); the rules' own inputs stay finite for most
    if bad_label:
        y = y.clone()
        y[2] = C + 3
    index = (torch.arange(N) * 7 + step * 5) % M + (M if step == 99 else 0) // 2
    return h, z, g_, ForwardContext(targets=y, index=index)


def same(a, b, where="state") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert torch.equal(torch.isnan(a), torch.isnan(b)) if a.is_floating_point() else True, f"{where}: NaNs moved"
        ok = torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) if a.is_floating_point() else torch.equal(a, b)
        assert ok, f"{where}: values differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def warmed(name: str) -> RuntimeState:
    state = RuntimeState(RULES[name]())
    for step in range(3):  # accepted steps: the state is built up
        state.select(*batch(step))
    return state


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("how", ["fallback", "bad_labels"])
def test_a_step_that_falls_back_leaves_the_state_as_before(name, how):
    state = warmed(name)
    before = state.rule.state_dict()
    gen_before = state.generator(torch.device("cpu")).get_state()
    step = 99 if name == "stale_sb_growing" else 3  # 99: indices past the cache, which grows in the step
    args = batch(step, nan_h=how == "fallback", bad_label=how == "bad_labels")
    # the same step accepted changes the rule's state or the generator it draws from (so the checks can fail)
    probe = warmed(name)
    probe.select(*batch(step, bad_label=False))
    with pytest.raises(AssertionError):
        same((before, gen_before), (probe.rule.state_dict(), probe.generator(torch.device("cpu")).get_state()))
    if how == "fallback":
        weight, k = state.select(*args)
        assert k == N and bool((weight == 1).all()), f"{name}: a non-finite step should run dense (kept {k})"
        assert state.last.fallback is not None, f"{name}: the step should say why it fell back"
    else:
        with pytest.raises(ValueError):
            state.select(*args)
    same(before, state.rule.state_dict(), f"{name} after a step that fell back ({how})")
    assert torch.equal(gen_before, state.generator(torch.device("cpu")).get_state()), (
        f"{name}: the runtime's generator should be put back too")
    assert state.rule.journal is None, f"{name}: no transaction should stay open after the step"
    # and the rule goes on exactly as one that never saw the step
    ref = warmed(name)
    state.select(*batch(4))
    ref.select(*batch(4))
    same(ref.rule.state_dict(), state.rule.state_dict(), f"{name}: the step after the undone one")


@pytest.mark.parametrize("name", ["sb", "stale_sb", "stale_sb_growing", "kabena", "ub", "random_match_sb"])
def test_no_step_copies_the_whole_state(name, monkeypatch):
    """The built-in rules' steps, accepted or undone, never call state_dict(): the undo costs what the step
    wrote (the batch's cache rows, its history slots), not the state's size."""
    state = warmed(name)
    rules = [state.rule] + ([state.rule.match] if getattr(state.rule, "match", None) is not None else [])

    def refuse(self):
        raise AssertionError(f"{type(self).__name__}.state_dict() called during a step")

    for r in rules:
        monkeypatch.setattr(type(r), "state_dict", refuse)
    state.select(*batch(5))
    state.select(*batch(6, nan_h=True))
    assert state.last.fallback is not None, "the second step should have fallen back"


def test_stale_sb_undo_is_as_large_as_the_batch(monkeypatch):
    """The transaction of a Stale-SB step over a dataset of 10^6 examples holds O(N) numbers."""
    rule = StaleSB(prime_epochs=0, num_examples=10 ** 6)
    state = RuntimeState(rule)
    state.select(*batch(0))
    held = []
    orig = Journal.rows

    def rows(self, t, index):
        held.append(t[index].numel())
        return orig(self, t, index)

    monkeypatch.setattr(Journal, "rows", rows)
    state.select(*batch(1, nan_h=True))
    assert held and sum(held) <= 4 * N + rule.R, f"the undo log held {sum(held)} numbers for a batch of {N}"
