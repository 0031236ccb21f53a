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


# ---- donation analysis -------------------------------------------------------------------------------------
class _Reads(tuple):
    """A step's input slots that count the entries read, by iteration or by ``count``."""

    read = 0

    def __iter__(self):
        _Reads.read += len(self)
        return super().__iter__()

    def count(self, value: object) -> int:  # type: ignore[override]
        _Reads.read += len(self)
        return super().count(value)


class _Step:
    def __init__(self, op: str, inputs: list[int], outputs: list[int]) -> None:
        self.node = type("N", (), {"op_type": op})()
        self.fn = None
        self.inputs = _Reads(inputs)
        self.outputs = tuple(outputs)


class _DonationPlan:
    def __init__(self, n_in: int, steps: list[_Step], outputs: list[int]) -> None:
        self._init_values: list = []
        self._input_slots = list(range(n_in))
        self._output_slots = outputs
        self.steps = steps


def _reusable_by_definition(plan: _DonationPlan) -> dict[int, frozenset[int]]:
    """The rule spelt out: an input is reusable at its last read when that step reads it once and no value
    reached from it through non-fresh steps (a possible view) is read at that step or later or is an
    output."""
    from onnxtrain.engine.donation import FRESH_OPS

    steps, n = plan.steps, len(plan.steps)
    outputs = set(plan._output_slots)
    last: dict[int, int] = {}
    for i, st in enumerate(steps):
        for s in (*tuple.__iter__(st.inputs), *st.outputs):
            last[s] = i
    out: dict[int, set[int]] = {}
    for r in plan._input_slots:
        if r in outputs or r not in last:
            continue
        views, frontier = set(), {r}
        for st in steps:
            if st.node.op_type not in FRESH_OPS and frontier & set(tuple.__iter__(st.inputs)):
                views.update(st.outputs)
                frontier.update(st.outputs)
        until = max((n if v in outputs else last.get(v, -1) for v in views), default=-1)
        i = last[r]
        if until < i and tuple.count(steps[i].inputs, r) == 1:
            out.setdefault(i, set()).add(r)
    return {i: frozenset(v) for i, v in out.items()}


def test_reusable_inputs_follow_the_rule_on_random_plans() -> None:
    from onnxtrain.engine.donation import reusable_inputs

    rng = random.Random(1)
    for _ in range(300):
        n_in = rng.randint(1, 6)
        steps, made = [], list(range(n_in))
        for k in range(rng.randint(1, 12)):
            ins = [rng.choice(made) for _ in range(rng.randint(1, 3))]
            out = n_in + k
            steps.append(_Step(rng.choice(["Add", "Reshape", "Identity", "Mul", "Slice"]), ins, [out]))
            made.append(out)
        outputs = rng.sample(made, rng.randint(1, 2))
        plan = _DonationPlan(n_in, steps, outputs)
        assert reusable_inputs(plan) == _reusable_by_definition(plan)  # type: ignore[arg-type]


def test_the_donation_analysis_reads_each_input_list_a_few_times() -> None:
    """A fused update reading thousands of inputs once each, and a Concat of thousands more viewed by a chain
    of Reshapes: each input was counted in the whole list (k²), each view carried the set of all the Concat's
    inputs (k × chain). The reads of the input lists are counted."""
    from onnxtrain.engine.donation import reusable_inputs

    k, chain = 3000, 300
    steps = [_Step("Add", list(range(k)), [2 * k]), _Step("Concat", list(range(k, 2 * k)), [2 * k + 1])]
    steps += [_Step("Reshape", [2 * k + 1 + j], [2 * k + 2 + j]) for j in range(chain)]
    steps.append(_Step("Relu", [2 * k, *range(2 * k + 1, 2 * k + chain + 2)], [2 * k + chain + 2]))
    plan = _DonationPlan(2 * k, steps, [2 * k + chain + 2])
    _Reads.read = 0
    got = reusable_inputs(plan)  # type: ignore[arg-type]
    assert got == {0: frozenset(range(k))}  # the Concat's inputs have views read later
    assert _Reads.read <= 4 * (2 * k + 2 * chain), _Reads.read
    assert got == _reusable_by_definition(plan)  # type: ignore[arg-type]
