"""The call sequences of tests/training/test_ortt_api_calls.py, as source both processes run.

``DRIVER`` is executed in this process over onnxtrain's API and in onnxruntime-training 1.19.2's venv over
its own (``tests/ortt.py``); ``A`` is a namespace with ``artifacts``, ``onnxblock``, ``CheckpointState``,
``Module``, ``Optimizer``, ``scheduler(o, warmup, total, lr)`` (in the documented argument order),
``buffer(array)`` (what ``copy_buffer_to_parameters`` takes), ``ortvalue(array)``,
``onnxruntime_ortvalue(array)`` (an OrtValue of onnxruntime's class), ``SessionOptions`` and
``run_model(path, feeds)`` (an exported model's outputs by that process's onnxruntime). Every call
is made through ``probe``, which records its value (arrays as lists with dtype and shape) or its exception
(class, the built-in exception classes it derives from, message), so that the two records can be compared
key by key.
"""

DRIVER = r'''
import os
import sys

import numpy as np


def encode(v):
    """A JSON form of a returned value."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, np.integer)) and not isinstance(v, np.bool_):
        return {"int": int(v), "type": type(v).__name__}
    if isinstance(v, (float, np.floating)):
        return {"float": float(v), "type": type(v).__name__}
    if isinstance(v, (list, tuple)):
        return {"seq": [encode(x) for x in v], "type": type(v).__name__}
    if not isinstance(v, np.ndarray) and hasattr(v, "numpy") and callable(v.numpy):
        return {"ortvalue": encode(np.asarray(v.numpy()))}
    if isinstance(v, np.ndarray):
        return {"array": v.astype(np.float64).ravel().tolist() if v.dtype.kind in "fiub" else
                v.ravel().tolist(), "dtype": str(v.dtype), "shape": list(v.shape)}
    return {"object": type(v).__name__}


_BUILTIN = ("ValueError", "TypeError", "RuntimeError", "KeyError", "IndexError", "AttributeError",
            "FileNotFoundError", "IsADirectoryError", "OSError", "NotImplementedError", "LookupError")


# calls that crash onnxruntime-training 1.19.2 (SIGSEGV), made on onnxtrain's side only; the test checks that
# onnxtrain refuses them
CRASHES = {"onnxruntime-training": ("noeval_call",)}
IMPL = "onnxtrain"  # set by the script that runs the driver


def probe(rec, key, fn):
    """Record fn()'s value or exception under key; the value (None after an exception)."""
    assert key not in rec, key
    if os.environ.get("ONNXTRAIN_DRIVER_TRACE"):  # which call crashed the process
        print("probe", key, file=sys.stderr, flush=True)
    if key in CRASHES.get(IMPL, ()):  # the call kills that implementation's process
        rec[key] = {"crash": True}
        return None
    try:
        v = fn()
    except Exception as e:  # recorded, compared by the test
        rec[key] = {"err": type(e).__name__, "bases": sorted({c.__name__ for c in type(e).__mro__
                                                              if c.__name__ in _BUILTIN}),
                    "msg": str(e)[:400]}
        return None
    rec[key] = {"ok": encode(v)}
    return v


def paths(folder):
    return {k: os.path.join(folder, k + ".onnx") for k in ("training_model", "eval_model", "optimizer_model")}


def make_optimizer(A, spec):
    kind = spec[0]
    if kind == "adamw":
        return A.artifacts.OptimType.AdamW
    if kind == "sgd":
        return A.artifacts.OptimType.SGD
    clip = A.onnxblock.optim.ClipGradNorm(spec[2]) if len(spec) > 2 else None
    if kind == "adamw_block":
        return A.onnxblock.optim.AdamW(**spec[1], clip_grad=clip)
    return A.onnxblock.optim.SGD(clip_grad=clip)


def make_loss(A, name):
    return {"ce": A.artifacts.LossType.CrossEntropyLoss, "mse": A.artifacts.LossType.MSELoss,
            "l1": A.artifacts.LossType.L1Loss, "bce": A.artifacts.LossType.BCEWithLogitsLoss}[name]


def generate(A, c, base, folder):
    """The case's artifacts, by A's generate_artifacts."""
    import onnx
    A.artifacts.generate_artifacts(onnx.load(base), requires_grad=c["requires_grad"],
                                   frozen_params=c["frozen"] or None, loss=make_loss(A, c["loss"]),
                                   optimizer=make_optimizer(A, c["optimizer"]), artifact_directory=folder,
                                   additional_output_names=c.get("extra") or None, nominal_checkpoint=True)


def feeds(data, i):
    return [data[f"x{i}"], data[f"y{i}"]]


def params_of(state):
    return [(n, p.requires_grad, np.array(p.data)) for n, p in state.parameters]


def grads_of(state):
    return [(n, None if p.grad is None else np.array(p.grad)) for n, p in state.parameters]


def scenario(A, c, folder, data, out):
    """The Module / Optimizer / CheckpointState call sequence on the artifacts in folder; the record."""
    rec = {}
    P = lambda key, fn: probe(rec, key, fn)  # noqa: E731
    f = paths(folder)
    state = A.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    P("state_params", lambda: params_of(state))
    P("state_len", lambda: len(state.parameters))
    P("state_contains", lambda: [c["requires_grad"][0] in state.parameters, "nope" in state.parameters])
    P("state_props", lambda: list(state.properties))
    P("grad_before_module", lambda: grads_of(state))
    m = A.Module(f["training_model"], state, f["eval_model"])
    P("grad_after_module", lambda: grads_of(state))
    P("training", lambda: m.training)
    P("train_inputs", m.input_names)
    P("train_outputs", m.output_names)
    P("eval_is_self", lambda: m.eval() is m)
    P("eval_training", lambda: m.training)
    P("eval_inputs", m.input_names)
    P("eval_outputs", m.output_names)
    P("train_is_self", lambda: m.train() is m)
    P("train_false", lambda: [m.train(False).training, m.input_names()])
    P("train_true", lambda: [m.train(True).training, m.input_names()])
    o = A.Optimizer(f["optimizer_model"], m)
    P("lr_default", o.get_learning_rate)
    P("step_before_train", o.step)
    P("params_after_step0", lambda: params_of(state))
    P("set_lr", lambda: o.set_learning_rate(0.05))
    P("get_lr", o.get_learning_rate)
    f0 = feeds(data, 0)
    P("call_positional", lambda: m(*f0))
    P("grads_1", lambda: grads_of(state))
    P("call_one_list", lambda: m(list(f0)))
    P("call_one_tuple", lambda: m(tuple(f0)))
    P("call_one_dict", lambda: m(dict(zip(m.input_names(), f0))))
    P("call_ortvalues", lambda: m(*[A.ortvalue(a) for a in f0]))
    P("call_mixed", lambda: m(A.ortvalue(f0[0]), f0[1]))
    # onnxruntime's own OrtValues (the inference package's, in onnxtrain's process)
    P("call_onnxruntime_ortvalues", lambda: m(*[A.onnxruntime_ortvalue(a) for a in f0]))
    P("call_too_few", lambda: m(f0[0]))
    P("call_too_many", lambda: m(*f0, f0[1]))
    P("call_wrong_dtype", lambda: m(f0[0].astype(np.float64) if f0[0].dtype == np.float32 else
                                    f0[0].astype(np.int32), f0[1]))
    P("grads_accumulated", lambda: grads_of(state))
    # (onnxruntime-training takes lists for OrtValues and fails; onnxtrain runs them: in eval mode, which
    # changes no state, not even BatchNorm running statistics)
    P("call_nested_lists", lambda: m.eval()(*[a.tolist() for a in f0]))
    P("call_nested_as_arrays", lambda: m.eval()(*f0))
    m.train()
    P("reset", m.lazy_reset_grad)
    for i in (1, 2, 3):
        P(f"acc_call{i}", lambda: m(*feeds(data, i)))
    P("grads_acc3", lambda: grads_of(state))
    P("reset_twice", lambda: [m.lazy_reset_grad(), m.lazy_reset_grad()])
    P("grads_after_reset", lambda: grads_of(state))
    P("step1", o.step)
    P("params_1", lambda: params_of(state))
    P("step2", o.step)
    P("params_2", lambda: params_of(state))
    m.eval()
    P("eval_call", lambda: m(*f0))
    P("eval_call_x_only", lambda: m(f0[0]))
    P("grads_after_eval", lambda: grads_of(state))
    P("params_after_eval", lambda: params_of(state))
    m.train()
    P("call_after_eval", lambda: m(*feeds(data, 1)))
    P("grads_after_eval_call", lambda: grads_of(state))
    for t in (True, False):
        P(f"contig_{t}", lambda: m.get_contiguous_parameters(t))
        P(f"size_{t}", lambda: m.get_parameters_size(t))
    P("contig_default", lambda: m.get_contiguous_parameters())
    P("size_default", lambda: m.get_parameters_size())
    buf = np.asarray(m.get_contiguous_parameters(True).numpy()).copy()
    P("copy_true", lambda: m.copy_buffer_to_parameters(A.buffer(np.ascontiguousarray(buf * 0.5)), True))
    P("params_copy_true", lambda: params_of(state))
    full = np.asarray(m.get_contiguous_parameters(False).numpy()).copy()
    P("copy_false", lambda: m.copy_buffer_to_parameters(A.buffer(np.ascontiguousarray(full * 2)), False))
    P("params_copy_false", lambda: params_of(state))
    P("copy_default", lambda: m.copy_buffer_to_parameters(A.buffer(np.ascontiguousarray(buf))))
    P("params_copy_default", lambda: params_of(state))
    P("copy_full_as_trainable",
      lambda: m.copy_buffer_to_parameters(A.buffer(np.ascontiguousarray(full)), True))
    P("copy_short", lambda: m.copy_buffer_to_parameters(A.buffer(np.ascontiguousarray(buf[:3])), True))
    P("copy_float64", lambda: m.copy_buffer_to_parameters(A.buffer(buf.astype(np.float64)), True))
    P("params_after_bad_copies", lambda: params_of(state))
    P("call_after_copies", lambda: m(*f0))
    ex = c["exports"]
    P("export_one", lambda: m.export_model_for_inferencing(os.path.join(out, "inference1.onnx"), ex[:1]))
    P("export_two", lambda: m.export_model_for_inferencing(os.path.join(out, "inference2.onnx"), ex))
    P("export_reversed", lambda: m.export_model_for_inferencing(os.path.join(out, "inference3.onnx"),
                                                               ex[::-1]))
    P("export_wrong", lambda: m.export_model_for_inferencing(os.path.join(out, "wrong.onnx"),
                                                            [ex[0], "no_such_output"]))
    P("export_wrong_file", lambda: os.path.exists(os.path.join(out, "wrong.onnx")))
    P("export_empty", lambda: m.export_model_for_inferencing(os.path.join(out, "empty.onnx"), []))
    P("export_missing_folder", lambda: m.export_model_for_inferencing(
        os.path.join(out, "no_folder", "x.onnx"), ex[:1]))
    P("training_after_export", lambda: [m.training, m.input_names()])

    # properties through the mapping interface
    props = state.properties
    P("prop_set_int", lambda: props.__setitem__("i", 3))
    P("prop_set_float", lambda: props.__setitem__("f", 0.1))
    P("prop_set_str", lambda: props.__setitem__("s", "abc"))
    P("prop_set_neg", lambda: props.__setitem__("n", -(2 ** 40)))
    P("prop_get", lambda: [props["i"], props["f"], props["s"], props["n"]])
    P("prop_overwrite", lambda: [props.__setitem__("i", "now a str"), props["i"]])
    P("prop_overwrite_float", lambda: [props.__setitem__("s", 2.5), props["s"]])
    P("prop_len", lambda: len(props))
    P("prop_contains", lambda: ["i" in props, "zz" in props])
    P("prop_iter", lambda: list(props))
    P("prop_missing", lambda: props["zz"])
    P("prop_delete", lambda: props.__delitem__("i"))
    P("prop_bad_list", lambda: props.__setitem__("bad", [1, 2]))
    P("prop_bad_none", lambda: props.__setitem__("bad", None))
    P("prop_bad_dict", lambda: props.__setitem__("bad", {"a": 1}))
    P("prop_bool", lambda: [props.__setitem__("b", True), props["b"]])
    P("prop_np_int", lambda: [props.__setitem__("ni", np.int64(7)), props["ni"]])
    P("prop_np_float", lambda: [props.__setitem__("nf", np.float32(0.25)), props["nf"]])
    P("prop_empty_str", lambda: [props.__setitem__("es", ""), props["es"]])
    P("prop_int_name", lambda: props.__setitem__(5, 1))
    P("prop_after", lambda: list(props))

    # the parameters view
    name0 = c["requires_grad"][0]
    P("param_missing", lambda: state.parameters["nope"])
    P("param_set_missing", lambda: state.parameters.__setitem__("nope", np.zeros(2, np.float32)))
    P("param_view", lambda: [state.parameters[name0].name, state.parameters[name0].requires_grad,
                             repr(state.parameters[name0])])
    shape0 = state.parameters[name0].data.shape
    P("param_set_data", lambda: setattr(state.parameters[name0], "data", np.full(shape0, 0.25, np.float32)))
    P("param_after_set", lambda: state.parameters[name0].data)
    P("param_set_item", lambda: state.parameters.__setitem__(name0, np.full(shape0, 0.5, np.float32)))
    P("param_after_set_item", lambda: state.parameters[name0].data)
    P("param_set_shape", lambda: setattr(state.parameters[name0], "data", np.zeros((7,), np.float32)))
    P("param_set_dtype", lambda: setattr(state.parameters[name0], "data", np.zeros(shape0, np.float64)))
    P("param_after_bad", lambda: state.parameters[name0].data)
    for fz in c["frozen"]:
        P(f"frozen_{fz}", lambda: [state.parameters[fz].requires_grad, state.parameters[fz].grad])
    P("call_after_set", lambda: m(*f0))

    # saved while training, loaded into a fresh Module (and Optimizer)
    P("step3", o.step)
    P("save_opt", lambda: A.CheckpointState.save_checkpoint(state, os.path.join(out, "ckpt_opt"), True))
    P("save_plain", lambda: A.CheckpointState.save_checkpoint(state, os.path.join(out, "ckpt_plain")))
    P("save_folder_missing", lambda: A.CheckpointState.save_checkpoint(
        state, os.path.join(out, "no_folder", "ckpt")))
    P("continued", lambda: [m(*feeds(data, 2)), o.step(), params_of(state)])
    for kind in ("ckpt_opt", "ckpt_plain"):
        st = A.CheckpointState.load_checkpoint(os.path.join(out, kind))
        P(f"{kind}_props", lambda: list(st.properties))
        m2 = A.Module(f["training_model"], st, f["eval_model"])
        o2 = A.Optimizer(f["optimizer_model"], m2)
        P(f"{kind}_lr", o2.get_learning_rate)
        o2.set_learning_rate(0.05)
        P(f"{kind}_continued", lambda: [m2(*feeds(data, 2)), o2.step(), params_of(st)])
    P("load_missing", lambda: A.CheckpointState.load_checkpoint(os.path.join(out, "no_such_ckpt")))
    with open(os.path.join(out, "ckpt_plain"), "rb") as fh:
        raw = fh.read()
    for n, cut in (("half", len(raw) // 2), ("empty", 0), ("head", 8)):
        with open(os.path.join(out, f"trunc_{n}"), "wb") as fh:
            fh.write(raw[:cut])
        P(f"load_trunc_{n}",
          lambda: len(A.CheckpointState.load_checkpoint(os.path.join(out, f"trunc_{n}")).parameters))
    P("load_folder", lambda: A.CheckpointState.load_checkpoint(out))

    # a Module without an eval model
    st3 = A.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    m3 = A.Module(f["training_model"], st3)
    P("noeval_names", lambda: [m3.eval().input_names(), m3.output_names()])
    P("noeval_call", lambda: m3(*f0))
    P("noeval_export", lambda: m3.export_model_for_inferencing(os.path.join(out, "noeval.onnx"), ex[:1]))
    P("noeval_train_call", lambda: m3.train()(*f0))
    return rec


def schedules(A, c, folder, data, cases):
    """Learning rates of a LinearLRScheduler over (warmup, total) cases, each on a fresh Optimizer."""
    rec = {}
    P = lambda key, fn: probe(rec, key, fn)  # noqa: E731
    f = paths(folder)
    for warmup, total in cases:
        key = f"sched_{warmup}_{total}"
        state = A.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        m = A.Module(f["training_model"], state)
        o = A.Optimizer(f["optimizer_model"], m)
        o.set_learning_rate(0.5)
        s = probe(rec, key, lambda: A.scheduler(o, warmup, total, 0.1))
        if s is None:
            continue
        lrs = [o.get_learning_rate()]
        for i in range(total + 3):
            m(*feeds(data, i % 4))
            o.step()
            m.lazy_reset_grad()
            s.step()
            lrs.append(o.get_learning_rate())
            if i == 1:  # a user's rate in between: the next scheduler step overrides it
                o.set_learning_rate(0.7)
                lrs.append(o.get_learning_rate())
        P(key + "_lrs", lambda: lrs)
        P(key + "_params", lambda: params_of(state))
    # the Python wrapper's own argument order (1.19.2 hands (warmup, total) to its binding swapped;
    # onnxtrain's swap_warmup_and_total=True), over three steps
    for warmup, total in ((2, 5), (0, 5), (5, 2)):
        state = A.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        o = A.Optimizer(f["optimizer_model"], A.Module(f["training_model"], state))
        s = probe(rec, f"wrapper_{warmup}_{total}", lambda: A.wrapper_scheduler(o, warmup, total, 0.1))
        lrs = [o.get_learning_rate()]
        for i in range(3):
            o.step()
            s.step()
            lrs.append(o.get_learning_rate())
        P(f"wrapper_{warmup}_{total}_lrs", lambda: lrs)
    return rec


def optimizer_steps(A, folder, data, out, steps):
    """Parameters after each of ``steps`` train-and-step rounds at lr 0.01; saves the state."""
    rec = {}
    f = paths(folder)
    state = A.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    m = A.Module(f["training_model"], state)
    o = A.Optimizer(f["optimizer_model"], m)
    o.set_learning_rate(0.01)
    for i in range(steps):
        probe(rec, f"loss_{i}", lambda: m(*feeds(data, i % 4)))
        probe(rec, f"grads_{i}", lambda: grads_of(state))
        probe(rec, f"step_{i}", o.step)
        probe(rec, f"params_{i}", lambda: params_of(state))
        m.lazy_reset_grad()
    A.CheckpointState.save_checkpoint(state, os.path.join(out, "steps_ckpt"), True)
    return rec


def continue_from(A, c, folder, checkpoint, data):
    """A fresh state, Module and Optimizer over the artifacts in folder from a saved checkpoint (possibly
    the other project's): what it holds, then one training call and update at lr 0.05."""
    rec = {}
    P = lambda key, fn: probe(rec, key, fn)  # noqa: E731
    f = paths(folder)
    st = A.CheckpointState.load_checkpoint(checkpoint)
    P("params", lambda: params_of(st))
    P("props", lambda: [(k, v) for k, v in st.properties if not k.startswith("onnxtrain.")])
    m = A.Module(f["training_model"], st, f["eval_model"])
    o = A.Optimizer(f["optimizer_model"], m)
    P("lr", o.get_learning_rate)
    o.set_learning_rate(0.05)
    P("eval", lambda: m.eval()(*feeds(data, 2)))
    m.train()
    P("continued", lambda: [m(*feeds(data, 2)), grads_of(st), o.step(), params_of(st)])
    P("second", lambda: [m(*feeds(data, 3)), o.step(), params_of(st)])
    return rec


def edges(A, c, folder, data, out):
    """Argument types and edge uses of each call, on fresh objects."""
    import pathlib
    rec = {}
    P = lambda key, fn: probe(rec, key, fn)  # noqa: E731
    f = paths(folder)
    ckpt = os.path.join(folder, "checkpoint")
    P("load_pathlib", lambda: len(A.CheckpointState.load_checkpoint(pathlib.Path(ckpt)).parameters))
    state = A.CheckpointState.load_checkpoint(ckpt)
    P("module_missing_train", lambda: A.Module(os.path.join(out, "none.onnx"), state, f["eval_model"]))
    P("module_missing_eval", lambda: A.Module(f["training_model"], state, os.path.join(out, "none.onnx")))
    P("module_eval_as_train", lambda: A.Module(f["eval_model"], state, f["eval_model"]).input_names())
    for key, device in (("device_cpu", "cpu"), ("device_cpu0", "cpu:0"), ("device_cuda", "cuda"),
                        ("device_bad", "tpu"), ("device_bad_index", "cpu:x")):
        P(key, lambda: A.Module(f["training_model"], A.CheckpointState.load_checkpoint(ckpt), None,
                                device).input_names())
    P("session_options", lambda: A.Module(f["training_model"], A.CheckpointState.load_checkpoint(ckpt),
                                          f["eval_model"], "cpu", A.SessionOptions())(*feeds(data, 0)))
    P("state_not_a_state", lambda: A.Module(f["training_model"], ckpt))
    P("module_keywords", lambda: A.Module(train_model_uri=f["training_model"], state=state,
                                          eval_model_uri=f["eval_model"]).output_names())
    m = A.Module(pathlib.Path(f["training_model"]), state, pathlib.Path(f["eval_model"]))
    P("train_int_mode", lambda: [m.train(0).training, m.input_names(), m.output_names()])
    P("train_int_mode_1", lambda: [m.train(1).training, m.input_names()])
    m.train()
    # the attribute set directly, as a user of torch's nn.Module might
    P("training_attribute", lambda: [setattr(m, "training", False), m.input_names(), m.output_names(),
                                     m(*feeds(data, 0)), grads_of(state)])
    m.training = True
    P("training_attribute_back", lambda: [m.input_names(), m(*feeds(data, 0)), grads_of(state)])
    P("optimizer_missing", lambda: A.Optimizer(os.path.join(out, "none.onnx"), m))
    P("optimizer_is_training_model", lambda: A.Optimizer(f["training_model"], m))
    o = A.Optimizer(pathlib.Path(f["optimizer_model"]), m)
    P("lr_type", lambda: o.get_learning_rate())
    P("set_lr_int", lambda: [o.set_learning_rate(1), o.get_learning_rate()])
    P("set_lr_np", lambda: [o.set_learning_rate(np.float32(0.125)), o.get_learning_rate()])
    P("set_lr_np64", lambda: [o.set_learning_rate(np.float64(0.1)), o.get_learning_rate()])
    P("set_lr_negative", lambda: [o.set_learning_rate(-0.5), o.get_learning_rate()])
    P("set_lr_str", lambda: o.set_learning_rate("0.1"))
    P("set_lr_none", lambda: o.set_learning_rate(None))
    P("set_lr_array", lambda: o.set_learning_rate(np.array([0.1], np.float32)))
    P("set_lr_inf", lambda: [o.set_learning_rate(float("inf")), o.get_learning_rate()])
    P("set_lr_nan", lambda: [o.set_learning_rate(float("nan")), str(o.get_learning_rate())])
    P("set_lr_huge", lambda: [o.set_learning_rate(1e39), o.get_learning_rate()])
    P("set_lr_tiny", lambda: [o.set_learning_rate(1e-46), o.get_learning_rate()])
    P("set_lr_bool", lambda: [o.set_learning_rate(True), o.get_learning_rate()])
    # an int past float64's range: 1.19.2's binding refuses it as a TypeError (an int past float32's is +inf)
    P("set_lr_int_past_float64", lambda: o.set_learning_rate(10**400))
    P("set_lr_int_past_float32", lambda: [o.set_learning_rate(10**40), o.get_learning_rate()])
    P("lr_after_bad", o.get_learning_rate)
    o.set_learning_rate(0.05)
    name0 = c["requires_grad"][0]
    held = state.parameters[name0].data
    before = np.array(held)
    f0 = feeds(data, 0)
    P("call", lambda: m(*f0))
    grad_held = state.parameters[name0].grad
    # refused calls, on a state of their own: onnxruntime-training 1.19.2 runs the nodes before the one
    # that fails (a BatchNormalization's running statistics change), onnxtrain checks the feeds first
    sr = A.CheckpointState.load_checkpoint(ckpt)
    mr = A.Module(f["training_model"], sr, f["eval_model"])
    y0 = f0[1]
    P("params_before_refusals", lambda: params_of(sr))
    P("labels_other_dtype", lambda: mr(f0[0], y0.astype(np.int32 if y0.dtype == np.int64 else np.float64)))
    P("labels_other_batch", lambda: mr(f0[0], y0[:-1]))
    P("input_other_dims", lambda: mr(f0[0][..., :-1] if f0[0].ndim > 1 else f0[0][:-1], y0))
    P("input_extra_axis", lambda: mr(f0[0][None], y0))
    P("eval_other_batch", lambda: mr.eval()(f0[0], y0[:-1]))
    P("grads_after_refusals", lambda: grads_of(sr))
    P("params_after_refusals", lambda: params_of(sr))
    P("step", o.step)
    P("data_is_live", lambda: bool(not np.array_equal(held, before)))
    P("data_equals_state", lambda: bool(np.array_equal(held, state.parameters[name0].data)))
    P("grad_after_step", lambda: state.parameters[name0].grad)
    P("call2", lambda: m(*feeds(data, 1)))
    P("grad_is_live", lambda: bool(np.array_equal(grad_held, state.parameters[name0].grad)))
    contig = m.get_contiguous_parameters(True)
    P("contig_is_copy",
      lambda: [np.asarray(contig.numpy()).__setitem__(0, 123.0), state.parameters[name0].data])
    full = np.asarray(m.get_contiguous_parameters(False).numpy()).copy()
    P("copy_2d", lambda: m.copy_buffer_to_parameters(A.buffer(np.ascontiguousarray(full.reshape(1, -1))),
                                                      False))
    P("params_after_2d", lambda: params_of(state))
    P("copy_int_flag", lambda: m.copy_buffer_to_parameters(A.buffer(full), 0))
    P("params_after_int_flag", lambda: params_of(state))
    P("size_int_flag", lambda: [m.get_parameters_size(0), m.get_parameters_size(1)])
    # properties: numbers at the edges, text
    props = state.properties
    P("prop_big_int", lambda: [props.__setitem__("big", 2 ** 62), props["big"]])
    P("prop_too_big", lambda: props.__setitem__("big2", 2 ** 63))
    P("prop_inf", lambda: [props.__setitem__("inf", float("inf")), props["inf"]])
    P("prop_nan", lambda: [props.__setitem__("nan", float("nan")), str(props["nan"])])
    P("prop_f_rounding", lambda: [props.__setitem__("third", 1 / 3), props["third"]])
    P("prop_unicode", lambda: [props.__setitem__("u", "h\u00e9llo \u2713"), props["u"]])
    P("prop_empty_name", lambda: [props.__setitem__("", 1), props[""]])
    P("prop_bytes", lambda: [props.__setitem__("by", b"abc"), props["by"]])
    P("save_with_props", lambda: A.CheckpointState.save_checkpoint(state, os.path.join(out, "props_ckpt")))
    P("props_loaded", lambda: [(k, str(v)) for k, v in
                               A.CheckpointState.load_checkpoint(os.path.join(out, "props_ckpt")).properties
                               if not k.startswith("onnxtrain.")])
    # saves without an Optimizer, with the flag as other types
    st2 = A.CheckpointState.load_checkpoint(ckpt)
    P("save_opt_without_optimizer",
      lambda: A.CheckpointState.save_checkpoint(st2, os.path.join(out, "noopt"), True))
    P("load_saved_without_optimizer",
      lambda: params_of(A.CheckpointState.load_checkpoint(os.path.join(out, "noopt"))))
    P("save_pathlib", lambda: A.CheckpointState.save_checkpoint(state, pathlib.Path(out) / "pl_ckpt", True))
    P("save_to_folder", lambda: A.CheckpointState.save_checkpoint(state, out))
    pl_ckpt = os.path.join(out, "pl_ckpt")
    P("save_over_file", lambda: [A.CheckpointState.save_checkpoint(state, pl_ckpt),
                                 len(A.CheckpointState.load_checkpoint(pl_ckpt).parameters)])
    P("save_flag_int", lambda: A.CheckpointState.save_checkpoint(state, os.path.join(out, "int_ckpt"), 1))
    # two Optimizers over one Module: their step counts and rates
    o2 = A.Optimizer(f["optimizer_model"], m)
    P("second_optimizer_lr", o2.get_learning_rate)
    o2.set_learning_rate(0.01)
    P("first_optimizer_lr_after", o.get_learning_rate)
    P("second_step", lambda: [o2.step(), params_of(state)])
    P("first_step_again", lambda: [o.step(), params_of(state)])
    P("save_two_optimizers",
      lambda: A.CheckpointState.save_checkpoint(state, os.path.join(out, "two_ckpt"), True))
    st3 = A.CheckpointState.load_checkpoint(os.path.join(out, "two_ckpt"))
    m2 = A.Module(f["training_model"], st3)
    o3 = A.Optimizer(f["optimizer_model"], m2)
    P("resumed_two_lr", o3.get_learning_rate)
    o3.set_learning_rate(0.01)
    P("resumed_two", lambda: [m2(*f0), o3.step(), params_of(st3)])
    # the scheduler's arguments
    for key, args in (("sched_negative", (-1, 5, 0.1)), ("sched_float_counts", (1.0, 5.0, 0.1)),
                      ("sched_int_lr", (1, 5, 1)), ("sched_str_lr", (1, 5, "0.1")),
                      ("sched_zero_lr", (0, 5, 0.0)), ("sched_negative_lr", (0, 5, -0.1)),
                      ("sched_nan_lr", (0, 5, float("nan"))), ("sched_huge_lr", (0, 5, 1e39)),
                      ("sched_int_past_float64_lr", (0, 5, 10**400))):
        P(key, lambda: [A.scheduler(o, *args) is not None, o.get_learning_rate()])
    # a reset then a step without a training call (the old gradients apply); a scheduler made after steps
    # and over a restored step count; a save right after the Optimizer is made
    st4 = A.CheckpointState.load_checkpoint(ckpt)
    m4 = A.Module(f["training_model"], st4)
    o4 = A.Optimizer(f["optimizer_model"], m4)
    P("save_fresh_optimizer",
      lambda: A.CheckpointState.save_checkpoint(st4, os.path.join(out, "fresh_opt"), True))
    P("load_fresh_optimizer",
      lambda: params_of(A.CheckpointState.load_checkpoint(os.path.join(out, "fresh_opt"))))
    o4.set_learning_rate(0.02)
    P("reset_then_step", lambda: [m4(*f0), m4.lazy_reset_grad(), o4.step(), grads_of(st4), params_of(st4)])
    P("reset_then_two_calls", lambda: [m4(*feeds(data, 1)), m4(*feeds(data, 2)), grads_of(st4)])
    P("late_scheduler", lambda: [o4.step(), A.scheduler(o4, 2, 6, 0.1) is not None, o4.get_learning_rate()])
    P("late_scheduler_after", lambda: [o4.step(), o4.get_learning_rate()])
    A.CheckpointState.save_checkpoint(st4, os.path.join(out, "late_ckpt"), True)
    st5 = A.CheckpointState.load_checkpoint(os.path.join(out, "late_ckpt"))
    m5 = A.Module(f["training_model"], st5)
    o5 = A.Optimizer(f["optimizer_model"], m5)
    P("restored_scheduler", lambda: [A.scheduler(o5, 2, 6, 0.1) is not None, o5.get_learning_rate()])
    P("restored_scheduler_step", lambda: [m5(*f0), o5.step(), params_of(st5), o5.get_learning_rate()])
    # two Modules over one state: one set of gradient buffers (each Module's first call overwrites them)
    st6 = A.CheckpointState.load_checkpoint(ckpt)
    ma, mb = A.Module(f["training_model"], st6), A.Module(f["training_model"], st6, f["eval_model"])
    P("two_modules",
      lambda: [ma(*f0), mb(*feeds(data, 1)), grads_of(st6), ma(*feeds(data, 2)), grads_of(st6)])
    P("two_modules_reset", lambda: [ma.lazy_reset_grad(), mb(*f0), grads_of(st6), ma(*f0), grads_of(st6)])
    ob = A.Optimizer(f["optimizer_model"], mb)
    P("two_modules_step", lambda: [ob.step(), params_of(st6), mb.eval()(*f0), ma(*f0)])
    ex = c["exports"]
    # a nominal checkpoint (names and types, no values) until copy_buffer_to_parameters loads them
    full_buffer = np.asarray(A.Module(f["training_model"], A.CheckpointState.load_checkpoint(ckpt))
                             .get_contiguous_parameters(False).numpy()).copy()
    nom = A.CheckpointState.load_checkpoint(os.path.join(folder, "nominal_checkpoint"))
    P("nominal_len", lambda: len(nom.parameters))
    P("nominal_contains", lambda: name0 in nom.parameters)
    P("nominal_iter", lambda: [n for n, _ in nom.parameters])
    P("nominal_get", lambda: nom.parameters[name0].data)
    P("nominal_set", lambda: nom.parameters.__setitem__(name0, np.zeros(1, np.float32)))
    P("nominal_props", lambda: [(k, v) for k, v in nom.properties if not k.startswith("onnxtrain.")])
    mn = A.Module(f["training_model"], nom, f["eval_model"])
    P("nominal_names", lambda: [mn.input_names(), mn.output_names()])
    P("nominal_size", lambda: [mn.get_parameters_size(True), mn.get_parameters_size(False)])
    P("nominal_contig", lambda: mn.get_contiguous_parameters(False))
    P("nominal_train", lambda: mn(*f0))
    P("nominal_eval", lambda: mn.eval()(*f0))
    mn.train()
    P("nominal_export", lambda: mn.export_model_for_inferencing(os.path.join(out, "nominal.onnx"), ex[:1]))
    P("nominal_save", lambda: A.CheckpointState.save_checkpoint(nom, os.path.join(out, "nominal_saved")))
    P("nominal_saved_len", lambda: len(A.CheckpointState.load_checkpoint(os.path.join(out, "nominal_saved"))
                                       .parameters))
    P("nominal_copy_trainable", lambda: mn.copy_buffer_to_parameters(A.buffer(full_buffer[:3].copy()), True))
    P("nominal_copy_short", lambda: mn.copy_buffer_to_parameters(A.buffer(full_buffer[:3].copy()), False))
    P("nominal_copy", lambda: mn.copy_buffer_to_parameters(A.buffer(full_buffer), False))
    P("nominal_loaded", lambda: params_of(nom))
    P("nominal_grads", lambda: grads_of(nom))
    on = A.Optimizer(f["optimizer_model"], mn)
    on.set_learning_rate(0.05)
    P("nominal_train_step", lambda: [mn(*f0), on.step(), params_of(nom), mn.eval()(*f0)])
    # a rate past float32 at step 0 of a warm-up (inf * 0), on an Optimizer that has not stepped
    o7 = A.Optimizer(f["optimizer_model"],
                     A.Module(f["training_model"], A.CheckpointState.load_checkpoint(ckpt)))
    P("sched_huge_lr_warmup", lambda: [A.scheduler(o7, 2, 5, 1e39) is not None, str(o7.get_learning_rate())])
    # exports
    ex = c["exports"]
    P("export_pathlib", lambda: m.export_model_for_inferencing(pathlib.Path(out) / "pl.onnx", ex[:1]))
    P("export_duplicate",
      lambda: m.export_model_for_inferencing(os.path.join(out, "dup.onnx"), [ex[0], ex[0]]))
    P("export_str_names", lambda: m.export_model_for_inferencing(os.path.join(out, "str.onnx"), ex[0]))
    P("export_tuple_names", lambda: m.export_model_for_inferencing(os.path.join(out, "tup.onnx"), tuple(ex)))
    P("export_input_name", lambda: m.export_model_for_inferencing(os.path.join(out, "inp.onnx"), ["input"]))
    P("export_param_name", lambda: m.export_model_for_inferencing(os.path.join(out, "par.onnx"), [name0]))
    return rec


def sequence(A, c, folder, data, out, ops):
    """A drawn sequence of calls (``ops``, made by the test: the same in both processes) on one state."""
    rec = {}
    P = lambda key, fn: probe(rec, key, fn)  # noqa: E731
    f = paths(folder)
    ckpt = os.path.join(folder, "checkpoint")
    st = A.CheckpointState.load_checkpoint(ckpt)
    m = A.Module(f["training_model"], st, f["eval_model"])
    o = A.Optimizer(f["optimizer_model"], m)
    sched = None
    for k, op in enumerate(ops):
        what, key = op[0], f"{k}_{op[0]}"
        if what in ("train", "eval"):
            (m.train() if what == "train" else m.eval())
            P(key, lambda: m(*feeds(data, op[1])))
        elif what == "reset":
            P(key, m.lazy_reset_grad)
        elif what == "step":
            P(key, lambda: [o.step(), params_of(st)])
        elif what == "lr":
            P(key, lambda: [o.set_learning_rate(op[1]), o.get_learning_rate()])
        elif what == "grads":
            P(key, lambda: grads_of(st))
        elif what == "contig":
            P(key, lambda: [m.get_contiguous_parameters(op[1]), m.get_parameters_size(op[1])])
        elif what == "copy":
            buf = np.asarray(m.get_contiguous_parameters(op[1]).numpy())
            buf = np.ascontiguousarray(buf * np.float32(op[2]))
            P(key, lambda: [m.copy_buffer_to_parameters(A.buffer(buf), op[1]), params_of(st)])
        elif what == "set":
            name = c["requires_grad"][op[1] % len(c["requires_grad"])]
            P(key, lambda: [st.parameters.__setitem__(name, st.parameters[name].data * np.float32(op[2])),
                            params_of(st)])
        elif what == "sched":
            sched = probe(rec, key, lambda: A.scheduler(o, op[1], op[2], op[3]))
            P(key + "_lr", o.get_learning_rate)
        elif what == "sched_step" and sched is not None:
            P(key, lambda: [sched.step(), o.get_learning_rate()])
        elif what == "export":  # the inference model now, run by onnxruntime on the batch's input
            path = os.path.join(out, f"seq{k}.onnx")
            P(key, lambda: [m.export_model_for_inferencing(path, c["exports"]),
                            A.run_model(path, {"input": feeds(data, op[1])[0]})])
        elif what == "reload":  # saved with the optimizer state, then a new state, Module and Optimizer
            path = os.path.join(out, f"seq{k}")
            A.CheckpointState.save_checkpoint(st, path, True)
            lr = o.get_learning_rate()
            st = A.CheckpointState.load_checkpoint(path)
            m = A.Module(f["training_model"], st, f["eval_model"])
            o = A.Optimizer(f["optimizer_model"], m)
            o.set_learning_rate(lr)  # (onnxtrain resumes the saved rate, onnxruntime-training 0.001)
            sched = None
            P(key, lambda: [params_of(st), m.input_names(), o.get_learning_rate()])
    P("final", lambda: params_of(st))
    return rec
'''
