import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import tiers  # noqa: E402

# The suite starts several hundred Python processes (MPI ranks, bench workers, the CLI), each importing
# onnxtrain: with PYTHONDONTWRITEBYTECODE set (as on some CI images) every one compiled its modules again
# (0.4 s of each start). Compiled modules are cached for this run and the processes it starts.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# A job started in the background of a non-interactive shell inherits SIGINT ignored, and so does every
# process it starts: the Ctrl-C tests (a step interrupted in process, a CLI run stopped and resumed) then saw
# no KeyboardInterrupt. They test onnxtrain's handling of Ctrl-C, so the suite takes Python's own handler
# (and the processes it starts, the default disposition, for which Python installs that handler).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _blas_share_per_worker() -> None:
    """Under pytest-xdist, each worker's OpenBLAS gets its share of the CPUs instead of all of them: a BLAS
    helper thread busy-waits about 0.1 s after each call, on the core the other worker needs (with two
    workers on two CPUs, a set of session tests took 100-115 s against 82-91 s with one BLAS thread each).
    Set in the worker only, not through the environment: the processes the tests start (MPI ranks, the CLI)
    choose their threads as a user's would. A thread count the user set is kept."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not workers.isdigit() or int(workers) < 2:
        return
    if any(os.environ.get(k, "").strip() for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        return
    from onnxtrain.engine.blas import _thread_count_functions

    functions = _thread_count_functions()
    if functions is not None:
        functions[0](max(1, len(os.sched_getaffinity(0)) // int(workers)))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: long or needs an optional environment (e.g. /tmp/ortt)")
    config.addinivalue_line("markers", f"extended: a sweep's case run only when {tiers.VARIABLE}=1")
    tiers.full()  # a wrong value fails the run here
    _blas_share_per_worker()
    if config.option.durations is None:  # the CI log names the slowest tests (the suite's budget is 15 min)
        config.option.durations = 25


def pytest_collection_modifyitems(config, items) -> None:
    """The default suite leaves out the sweeps' ``extended`` cases (see :mod:`tests.tiers`)."""
    if tiers.full():
        return
    left_out = [item for item in items if item.get_closest_marker("extended")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]


@pytest.fixture(scope="session", autouse=True)
def _torchlib_registry_once():  # noqa: ANN202
    """torch's dynamo exporter rebuilds its registry of torchlib functions at every export (about 0.7 s of
    the 1.1 s a small export takes, and 5 s the first time in a process): built once per opset for the
    whole run. No custom translation table is given anywhere in the suite, so the registry stays as built."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    cls = _registration.ONNXRegistry
    original = cls.__dict__.get("from_torchlib")
    if not isinstance(original, classmethod):
        yield
        return
    built: dict = {}

    def from_torchlib(klass, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        key = (args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = original.__func__(klass, *args, **kwargs)
        return built[key]

    cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        cls.from_torchlib = original


@pytest.fixture(scope="session", autouse=True)
def _export_op_tables_once():  # noqa: ANN202
    """torch's dynamo exporter walks the dispatcher for every CompositeImplicitAutograd op (about 0.45 s) and
    builds its decomposition table (0.25 s) at every export, of a small export's 0.7 s: both are pure
    functions of the registered ops, which no test adds to, so they are worked out once per set of op
    namespaces (and of ONNX-implemented ops) and each export gets a copy."""
    try:
        from torch._export import utils as export_utils
        from torch.export import decomp_utils, exported_program
        from torch.onnx._internal.exporter import _decomp
    except ImportError:
        yield
        return
    import torch

    collect = export_utils._collect_all_valid_cia_ops
    table = _decomp.create_onnx_friendly_decomposition_table
    cia: dict = {}
    tables: dict = {}

    def collect_once():  # noqa: ANN202
        key = tuple(sorted(torch.ops._dir))
        if key not in cia:
            cia[key] = frozenset(collect())
        return set(cia[key])

    def table_once(onnx_registered_ops):  # noqa: ANN001, ANN202
        key = frozenset(onnx_registered_ops)
        if key not in tables:
            tables[key] = table(onnx_registered_ops)
        return dict(tables[key])

    patched = [(exported_program, "_collect_all_valid_cia_ops", collect_once),
               (decomp_utils, "_collect_all_valid_cia_ops", collect_once),
               (_decomp, "create_onnx_friendly_decomposition_table", table_once)]
    originals = [(m, name, getattr(m, name)) for m, name, _ in patched if hasattr(m, name)]
    for m, name, fn in patched:
        if hasattr(m, name):
            setattr(m, name, fn)
    try:
        yield
    finally:
        for m, name, fn in originals:
            setattr(m, name, fn)
