"""Graph passes scale with the graph: a name generator probed ``base_1, base_2, ...`` from 1 for every new
name of a base (n² probes: the Adam update of a 2,000-node MLP spent 48 of 85 s building names), and each
fused step rebuilt the plan's slot → name map (steps × values: 7.6 of 10.1 s building an 8,000-node MLP).
Counted, not timed: the probes and the map entries read grow linearly; the names are those of the
probe-from-1 rule."""

from __future__ import annotations

import random

from onnxtrain.engine.fusion.common import slot_names
from onnxtrain.ir.builder import NameGen


class _CountingSet(set):
    probes = 0

    def __contains__(self, item: object) -> bool:
        _CountingSet.probes += 1
        return super().__contains__(item)


def _probe_from_one(taken: set[str], base: str) -> str:
    """The rule the generator keeps: ``base``, else ``base_<i>`` for the smallest free i."""
    if base not in taken:
        taken.add(base)
        return base
    i = 1
    while f"{base}_{i}" in taken:
        i += 1
    taken.add(f"{base}_{i}")
    return f"{base}_{i}"


def test_names_are_those_of_the_probe_from_one_rule() -> None:
    rng = random.Random(0)
    start = {"a", "a_2", "b_1", "a_5", "c"}
    gen, taken = NameGen(start), set(start)
    for _ in range(2000):
        base = rng.choice(["a", "b", "c", "a_1", ""])
        if rng.random() < 0.1:  # a caller taking a name itself, as some passes do
            extra = f"{base or 'v'}_{rng.randint(1, 40)}"
            gen.taken.add(extra)
            taken.add(extra)
        assert gen(base) == _probe_from_one(taken, base or "v")


def test_names_of_one_base_take_linear_probes() -> None:
    n = 4000
    gen = NameGen()
    gen.taken = _CountingSet(gen.taken)
    _CountingSet.probes = 0
    for _ in range(n):
        gen("t")
    assert _CountingSet.probes < 3 * n, _CountingSet.probes  # (n² / 2 before)


class _Plan:
    def __init__(self) -> None:
        self.slot: dict[str, int] = {}


class _CountingDict(dict):
    read = 0

    def items(self):  # type: ignore[override]
        return _CountingItems(self)


class _CountingItems:
    """A dict's items view that counts the entries read, forwards or from the end."""

    def __init__(self, d: dict) -> None:
        self.d = d

    def __iter__(self):
        for kv in dict.items(self.d):
            _CountingDict.read += 1
            yield kv

    def __reversed__(self):
        for kv in reversed(dict.items(self.d)):
            _CountingDict.read += 1
            yield kv


def test_the_slot_map_is_read_once_per_value() -> None:
    plan = _Plan()
    plan.slot = _CountingDict()
    _CountingDict.read = 0
    n = 3000
    for k in range(n):
        plan.slot[f"v{k}"] = k if k % 7 else k - 1  # (some names share a slot: the last one names it)
        names = slot_names(plan)
    assert names == {s: v for v, s in dict(plan.slot).items()}
    assert _CountingDict.read <= n, _CountingDict.read  # (n² / 2 before)
