"""``rules.MODULES``, the index the registry imports rule modules by, against what the modules register."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

from onnxtrain.autodiff import registry, rules

PACKAGE = rules.__name__


def test_index_lists_exactly_what_each_module_registers():
    registry.ops_with_rules()  # imports every listed module
    registered: dict[str, set[str]] = {}
    for op, modules in registry._ORIGINS.items():
        for m in modules:
            assert m.startswith(PACKAGE + "."), f"{op} registered outside the rules package, by {m}"
            registered.setdefault(m.removeprefix(PACKAGE + "."), set()).add(op)
    listed = {m: set(ops) for m, ops in rules.MODULES.items()}
    missing = {m: sorted(ops - listed.get(m, set())) for m, ops in registered.items()
               if ops - listed.get(m, set())}
    stale = {m: sorted(ops - registered.get(m, set())) for m, ops in listed.items()
             if ops - registered.get(m, set())}
    assert not missing, f"ops registered but not listed in rules.MODULES: {missing}"
    assert not stale, f"ops listed in rules.MODULES that the module does not register: {stale}"


def test_every_rule_module_is_listed_or_registers_nothing():
    registry.ops_with_rules()
    helpers = {m.name for m in pkgutil.iter_modules(rules.__path__)} - set(rules.MODULES)
    assert helpers == {"rnn_loop", "rnn_unroll", "body_draws"}  # helpers of the RNN and control-flow rules
    for name in helpers:
        assert not any(PACKAGE + "." + name in ms for ms in registry._ORIGINS.values()), name


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_a_lookup_imports_only_its_ops_modules():
    code = (
        "import sys\n"
        "from onnxtrain.autodiff import registry\n"
        f"loaded = lambda: sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('{PACKAGE}.'))\n"
        "before = loaded()\n"
        "rule = registry.find_rule('Relu', 17)\n"
        "print(before, loaded(), rule.fn.__name__ if rule else None,\n"
        "      registry.find_rule('NoSuchOp', 17), registry.has_no_gradient('Shape'), loaded())\n"
    )
    before, after_relu, rest = _fresh(code).split("] ", 2)
    # the builder's own helpers are imported with the package; Relu adds its module only
    assert set(eval(after_relu + "]")) - set(eval(before + "]")) == {"activation"}
    name, none, shape_has_none, final = rest.split(" ", 3)
    assert name != "None" and none == "None" and shape_has_none == "True"
    assert set(eval(final)) - set(eval(after_relu + "]")) == {"shape"}


def test_lookups_answer_as_with_every_module_imported():
    """The same rule, variant and no-gradient answers for every op whether the registry imported one
    module at a time (a fresh process, ops in listing order) or all of them first (this process)."""
    ops = sorted({op for ops in rules.MODULES.values() for op in ops} | {"NoSuchOp", "Identity"})
    code = (
        "from onnxtrain.autodiff import registry\n"
        f"for op in {ops!r}:\n"
        "    for opset in (7, 13, 21):\n"
        "        r = registry.find_rule(op, opset)\n"
        "        print(op, opset, r and (r.fn.__module__, r.fn.__name__, r.since),\n"
        "              registry.has_no_gradient(op), bool(registry.find_variant(op, 'from_output')))\n"
    )
    lazy = _fresh(code).splitlines()
    registry.ops_with_rules()
    eager = []
    for op in ops:
        for opset in (7, 13, 21):
            r = registry.find_rule(op, opset)
            eager.append(f"{op} {opset} {r and (r.fn.__module__, r.fn.__name__, r.since)} "
                         f"{registry.has_no_gradient(op)} {bool(registry.find_variant(op, 'from_output'))}")
    assert lazy == eager


def test_lookups_from_many_threads_at_once_find_every_rule():
    """The first lookups, from 8 threads released together (thread switches every microsecond), each find
    their op's rule: no thread reads the op-to-module table while another is still filling it."""
    code = (
        "import sys, threading\n"
        "sys.setswitchinterval(1e-6)\n"
        "from onnxtrain.autodiff import registry\n"
        "ops = ['Conv', 'Relu', 'MatMul', 'Softmax', 'LSTM', 'Gather', 'ReduceSum', 'Loop']\n"
        "gate = threading.Barrier(len(ops))\n"
        "found = {}\n"
        "def look(op):\n"
        "    gate.wait()\n"
        "    found[op] = registry.find_rule(op, 17) is not None\n"
        "threads = [threading.Thread(target=look, args=(op,)) for op in ops]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "print(sorted(op for op, ok in found.items() if not ok))\n"
    )
    for _ in range(3):
        assert _fresh(code) == "[]"
