"""Recurrent kernels: LSTM, GRU and RNN (ONNX opset 7+ semantics, layout attribute of opset 14).

All three share one driver. The input projection ``X·Wᵀ + biases`` is one matmul over every time step
and both directions; the loop over time steps then runs both directions at once with batched matmuls
(the reverse direction walks a time-reversed copy of the projection, reversed per sequence when
``sequence_lens`` is given). Steps past a sequence's length keep the state and give zero outputs; a
sequence of length 0 gives zero final states, as onnxruntime's kernels do (the ONNX spec does not say).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.activation import logistic
from onnxtrain.engine.kernels.clamp import negative_part, relu_into
from onnxtrain.engine.registry import Attrs, Inputs, Kernel, Outputs, kernel

Act = Callable[[np.ndarray], np.ndarray]


def _quiet(fn: Kernel) -> Kernel:
    """``fn`` with numpy's overflow warning off: exp in the logistic gate overflows to inf for very
    negative inputs, which gives the gate its limit 0 (one errstate per node, not per time step)."""

    def run(inputs: Inputs, attrs: Attrs) -> Outputs:
        with np.errstate(over="ignore"):
            return fn(inputs, attrs)

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


# --- activation functions -------------------------------------------------------------------------

def _relu(x: np.ndarray) -> np.ndarray:
    return relu_into(x)


def _softsign(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.abs(x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(x, 0).astype(x.dtype, copy=False)


def _make_act(name: str, alpha: float, beta: float) -> Act:
    """The activation ``name`` with its (already resolved) alpha and beta."""
    if name == "sigmoid":
        return logistic  # the kernels run with overflow warnings off (_quiet)
    if name == "tanh":
        return np.tanh
    if name == "relu":
        return _relu
    if name == "softsign":
        return _softsign
    if name == "softplus":
        return _softplus
    if name == "hardsigmoid":
        return lambda x: np.clip(alpha * x + beta, 0, 1)
    if name == "leakyrelu":
        return lambda x: np.where(x >= 0, x, alpha * x)
    if name == "thresholdedrelu":
        return lambda x: np.where(x > alpha, x, 0).astype(x.dtype, copy=False)
    if name == "scaledtanh":
        return lambda x: alpha * np.tanh(beta * x)
    if name == "affine":
        return lambda x: alpha * x + beta
    if name == "elu":
        return lambda x: np.where(x >= 0, x, alpha * np.expm1(negative_part(x)))
    raise ValueError(f"unsupported activation function {name!r}")


# name -> (default alpha or None if unused, default beta or None if unused)
_ACT_PARAMS: dict[str, tuple[float | None, float | None]] = {
    "sigmoid": (None, None), "tanh": (None, None), "relu": (None, None), "softsign": (None, None),
    "softplus": (None, None), "hardsigmoid": (0.2, 0.5), "leakyrelu": (0.01, None),
    "thresholdedrelu": (1.0, None), "scaledtanh": (1.0, 1.0), "affine": (1.0, 0.0), "elu": (1.0, None),
}


def activation_specs(op: str, names: list[str] | None, alphas: list[float] | None, betas: list[float] | None,
                     defaults: tuple[str, ...], n_dirs: int) -> list[tuple[str, float, float]]:
    """(name, alpha, beta) of every activation a recurrent node applies, direction after direction.

    ``activation_alpha``/``activation_beta`` are consumed in order by the functions that take an
    alpha (resp. beta); functions left without a value use the default of the matching ONNX op.
    """
    names = list(names or list(defaults) * n_dirs)
    n = len(defaults)
    if len(names) == n and n_dirs == 2:
        names = names * 2
    elif len(names) == 2 * n and n_dirs == 1:  # RNN's schema default lists both directions
        names = names[:n]
    if len(names) != n * n_dirs:
        raise ValueError(f"{op}: expected {n * n_dirs} activations for {n_dirs} direction(s), "
                         f"got {len(names)}: {names}")
    alphas, betas = list(alphas or []), list(betas or [])
    specs = []
    for name in names:
        key = name.lower()
        if key not in _ACT_PARAMS:
            raise ValueError(f"{op}: unsupported activation function {name!r}")
        a, b = _ACT_PARAMS[key]
        if a is not None and alphas:
            a = alphas.pop(0)
        if b is not None and betas:
            b = betas.pop(0)
        specs.append((key, float(a or 0.0), float(b or 0.0)))
    return specs


def _activations(attrs: Attrs, defaults: tuple[str, ...], n_dirs: int) -> list[list[Act]]:
    """Per direction, the activation callables (f, g[, h]) the node asks for."""
    specs = activation_specs(attrs.op, attrs.get("activations"), attrs.get("activation_alpha"),
                             attrs.get("activation_beta"), defaults, n_dirs)
    n = len(defaults)
    fns = [_make_act(*spec) for spec in specs]
    per_dir = [fns[d * n:(d + 1) * n] for d in range(n_dirs)]
    if n_dirs == 2 and specs[:n] == specs[n:]:
        return [per_dir[0]]  # same functions for both directions: apply once to the stacked state
    return per_dir


def _apply(fns: list[list[Act]], k: int, x: np.ndarray) -> np.ndarray:
    """Activation ``k`` applied to ``x`` of shape [dirs, batch, n] (per direction if they differ)."""
    if len(fns) == 1:
        return fns[0][k](x)
    return np.stack([fns[d][k](x[d]) for d in range(len(fns))])


# --- shared driver --------------------------------------------------------------------------------

class _Setup:
    """Attribute-derived settings of one node, computed once and kept in ``attrs.cache``."""

    __slots__ = ("n_dirs", "reverse", "layout", "clip", "fns", "hidden")

    def __init__(self, attrs: Attrs, defaults: tuple[str, ...]):
        direction = attrs.get("direction") or "forward"
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ValueError(f"{attrs.op}: unknown direction {direction!r}")
        self.n_dirs = 2 if direction == "bidirectional" else 1
        # which direction indices walk the sequence backwards
        self.reverse = (0,) if direction == "reverse" else (1,) if direction == "bidirectional" else ()
        self.layout = int(attrs.get("layout") or 0)
        if self.layout not in (0, 1):
            raise ValueError(f"{attrs.op}: layout must be 0 or 1, got {self.layout}")
        clip = attrs.get("clip")
        self.clip = None if clip is None else float(clip)
        self.fns = _activations(attrs, defaults, self.n_dirs)
        self.hidden = attrs.get("hidden_size")


def _setup(attrs: Attrs, defaults: tuple[str, ...]) -> _Setup:
    s = attrs.cache.get("setup")
    if s is None:
        s = attrs.cache["setup"] = _Setup(attrs, defaults)
    return s


class _Seq:
    """The time-major input projection and what is needed to walk and un-walk the sequence."""

    def __init__(self, inputs: Inputs, s: _Setup, n_gates: int, rec_bias_gates: int,
                 gate_major: bool = False):
        """``gate_major`` (layout 0 only): ``xw`` as [dirs, gates*hidden, steps, batch] instead of
        [steps, dirs, batch, gates*hidden], the reverse direction's steps reversed likewise."""
        x, w, r = inputs[0], inputs[1], inputs[2]
        b = inputs[3] if len(inputs) > 3 else None
        lens = inputs[4] if len(inputs) > 4 else None
        if x.ndim != 3:
            raise ValueError(f"X must be 3-D, got shape {x.shape}")
        n_dirs, gh, n_in = w.shape
        hid = r.shape[-1]
        if n_dirs != s.n_dirs:
            raise ValueError(f"W has {n_dirs} direction(s) but direction needs {s.n_dirs}")
        if gh != n_gates * hid or r.shape != (n_dirs, gh, hid):
            raise ValueError(f"W {w.shape} / R {r.shape} do not fit {n_gates} gates of hidden size {hid}")
        if s.hidden is not None and s.hidden != hid:
            raise ValueError(f"hidden_size={s.hidden} but R has hidden size {hid}")
        if x.shape[2] != n_in:
            raise ValueError(f"X has input size {x.shape[2]} but W expects {n_in}")
        if s.layout == 0:
            n_steps, batch = x.shape[0], x.shape[1]
        else:
            batch, n_steps = x.shape[0], x.shape[1]
        self.n_steps, self.batch, self.hid, self.n_dirs, self.dtype = n_steps, batch, hid, n_dirs, x.dtype
        bias = None
        if b is not None:
            if b.shape != (n_dirs, 2 * gh):
                raise ValueError(f"B must have shape {(n_dirs, 2 * gh)}, got {b.shape}")
            # bfloat16 runs in float32 (numpy's bfloat16 matmul returns float32): so do the biases' sums
            bias = b[:, :gh].astype(np.float32) if b.dtype.kind == "V" else b[:, :gh].copy()
            nb = rec_bias_gates * hid
            bias[:, :nb] += b[:, gh:gh + nb]
        self.mask: np.ndarray | None = None  # [steps, 1, batch, 1] bool, where a step is valid
        self.rev_idx: np.ndarray | None = None  # [steps, batch] per-sequence reversal, own inverse
        # [batch] bool, sequences of length 0 (when there are any): their final states are zeros, as
        # onnxruntime gives them, also when the whole sequence axis has length 0
        self.empty: np.ndarray | None = np.ones(batch, bool) if n_steps == 0 else None
        if gate_major:
            # rows: gates; columns: (step, sample)
            xw = np.matmul(w.reshape(n_dirs * gh, n_in), x.reshape(-1, n_in).T)
            if bias is not None:
                xw += bias.reshape(-1, 1)
            xw = xw.reshape(n_dirs, gh, n_steps, batch)
            for d in s.reverse:
                xw[d] = xw[d, :, ::-1].copy()
            self.xw = xw
            return
        xw = np.matmul(x.reshape(-1, n_in), w.reshape(n_dirs * gh, n_in).T)
        if bias is not None:
            xw += bias.reshape(-1)
        if s.layout == 0:
            xw = xw.reshape(n_steps, batch, n_dirs, gh).transpose(0, 2, 1, 3)
        else:
            xw = xw.reshape(batch, n_steps, n_dirs, gh).transpose(1, 2, 0, 3)
        xw = np.ascontiguousarray(xw)  # [steps, dirs, batch, gates*hidden]
        if lens is not None:
            lens = np.asarray(lens).astype(np.int64, copy=False).reshape(-1)
            if lens.shape[0] != batch:
                raise ValueError(f"sequence_lens has {lens.shape[0]} entries for batch size {batch}")
            if np.any(lens < 0) or np.any(lens > n_steps):
                raise ValueError(f"sequence_lens must lie in [0, {n_steps}], got {lens.tolist()}")
            if np.any(lens != n_steps):
                t = np.arange(n_steps)[:, None]
                valid = t < lens[None, :]
                self.mask = valid[:, None, :, None]
                self.rev_idx = np.where(valid, lens[None, :] - 1 - t, t)
                if not lens.all():
                    self.empty = lens == 0
        for d in s.reverse:
            xw[:, d] = self.flip(xw[:, d])
        self.xw = xw

    def flip(self, a: np.ndarray) -> np.ndarray:
        """``a`` [steps, batch, ...] reversed in time, each sequence within its own length."""
        if self.rev_idx is None:
            return a[::-1]
        return a[self.rev_idx, np.arange(self.batch)[None, :]]

    def initial(self, v: Any, s: _Setup) -> np.ndarray:
        """An initial state input as [dirs, batch, hidden] (zeros when omitted)."""
        shape = (self.n_dirs, self.batch, self.hid)
        if v is None:
            return np.zeros(shape, self.dtype)
        if s.layout == 1:
            v = v.transpose(1, 0, 2)
        if v.shape != shape:
            raise ValueError(f"initial state must have shape {shape} in layout {s.layout}, got {v.shape}")
        return v

    def outputs(self, ys: np.ndarray | None, finals: list[np.ndarray], s: _Setup,
                used: tuple[bool, ...]) -> list[Any]:
        """Y from the per-step states ``ys`` [steps, dirs, batch, hidden], then the final states."""
        out: list[Any] = []
        if ys is not None:
            for d in s.reverse:
                ys[:, d] = self.flip(ys[:, d])
            if self.mask is not None:
                ys *= self.mask
            out.append(ys if s.layout == 0 else np.ascontiguousarray(ys.transpose(2, 0, 1, 3)))
        else:
            out.append(None)
        for k, f in enumerate(finals, start=1):
            if k < len(used) and used[k]:
                if self.empty is not None:
                    f = np.where(self.empty[None, :, None], 0, f)
                if f.dtype != self.dtype:  # bfloat16: numpy's matmul returns float32, the states follow
                    f = f.astype(self.dtype)
                out.append(f if s.layout == 0 else np.ascontiguousarray(f.transpose(1, 0, 2)))
            else:
                out.append(None)
        return out


def _clip(x: np.ndarray, c: float | None) -> np.ndarray:
    return x if c is None else np.clip(x, -c, c, out=x)


# --- LSTM -----------------------------------------------------------------------------------------

@kernel("LSTM", since=7)
@_quiet
def lstm(inputs: Inputs, attrs: Attrs) -> Outputs:
    """LSTM with gate order i, o, f, c; peepholes P = (i, o, f); optional coupled input/forget."""
    s = _setup(attrs, ("Sigmoid", "Tanh", "Tanh"))
    if _plain(inputs, s, [[logistic, np.tanh, np.tanh]]) and not (attrs.get("input_forget") or 0) and not (
            len(inputs) > 7 and inputs[7] is not None):  # no coupled gates, no peepholes
        return _lstm_gate_major(inputs, s, attrs)
    seq = _Seq(inputs, s, 4, 4)
    n = seq.hid
    h = seq.initial(inputs[5] if len(inputs) > 5 else None, s)
    c = seq.initial(inputs[6] if len(inputs) > 6 else None, s)
    p = inputs[7] if len(inputs) > 7 else None
    if p is not None:
        if p.shape != (seq.n_dirs, 3 * n):
            raise ValueError(f"P must have shape {(seq.n_dirs, 3 * n)}, got {p.shape}")
        p = p[:, None, :]
        p_i, p_o, p_f = p[..., :n], p[..., n:2 * n], p[..., 2 * n:]
    couple = bool(attrs.get("input_forget") or 0)
    rt = inputs[2].transpose(0, 2, 1)
    fns, cl, mask = s.fns, s.clip, seq.mask
    uniform = len(fns) == 1
    f_act, g_act, h_act = fns[0] if uniform else (None, None, None)
    ys = np.empty((seq.n_steps, seq.n_dirs, seq.batch, n), seq.dtype) if attrs.output_used[0] else None
    for t in range(seq.n_steps):
        g = seq.xw[t] + np.matmul(h, rt)
        if p is None:
            _clip(g, cl)
            iof = f_act(g[..., :3 * n]) if uniform else _apply(fns, 0, g[..., :3 * n])
            gi, go, gf = iof[..., :n], iof[..., n:2 * n], iof[..., 2 * n:]
        else:
            pre_o = g[..., n:2 * n].copy() if cl is not None else g[..., n:2 * n]
            g[..., :n] += p_i * c
            g[..., 2 * n:3 * n] += p_f * c
            _clip(g, cl)
            gi = f_act(g[..., :n]) if uniform else _apply(fns, 0, g[..., :n])
            gf = f_act(g[..., 2 * n:3 * n]) if uniform else _apply(fns, 0, g[..., 2 * n:3 * n])
        if couple:
            gf = 1 - gi
        gc = g_act(g[..., 3 * n:]) if uniform else _apply(fns, 1, g[..., 3 * n:])
        c_new = gf * c + gi * gc
        if p is not None:
            o_in = _clip(pre_o + p_o * c_new, cl)
            go = f_act(o_in) if uniform else _apply(fns, 0, o_in)
        h_new = go * (h_act(c_new) if uniform else _apply(fns, 2, c_new))
        if mask is None:
            h, c = h_new, c_new
        else:
            m = mask[t]
            h, c = np.where(m, h_new, h), np.where(m, c_new, c)
        if ys is not None:
            ys[t] = h_new
    return seq.outputs(ys, [h, c], s, attrs.output_used)


def _plain(inputs: Inputs, s: _Setup, activations: list[list[Act]]) -> bool:
    """A node the gate-major loops run: layout 0, the default ``activations``, no clip, float32/float64,
    every sequence full length."""
    x = inputs[0]
    lens = inputs[4] if len(inputs) > 4 else None
    return (s.layout == 0 and s.clip is None and s.fns == activations
            and x.ndim == 3 and x.dtype in (np.float32, np.float64)
            and all(v.dtype == x.dtype for v in inputs[1:3])
            and (lens is None or bool(np.all(np.asarray(lens) == x.shape[0]))))


def _transposed_state(v: np.ndarray) -> np.ndarray:
    """An initial state [dirs, batch, hidden] as a new C-contiguous [dirs, hidden, batch] array."""
    return np.array(v.transpose(0, 2, 1), order="C")


def _lstm_gate_major(inputs: Inputs, s: _Setup, attrs: Attrs) -> Outputs:
    """The plain LSTM's loop on states kept transposed, [dirs, hidden, batch]: the gates R·hᵀ come out
    [dirs, 4·hidden, batch], so each gate is a contiguous block and every step runs in place in buffers
    made once (50 steps of batch 32, hidden 128: 2.9 → 2.1 ms against the batch-major loop above)."""
    seq = _Seq(inputs, s, 4, 4, gate_major=True)
    n, dirs, batch = seq.hid, seq.n_dirs, seq.batch
    h = _transposed_state(seq.initial(inputs[5] if len(inputs) > 5 else None, s))
    c = _transposed_state(seq.initial(inputs[6] if len(inputs) > 6 else None, s))
    r = inputs[2]  # [dirs, 4·hidden, hidden]: R·hᵀ needs no transpose
    g = np.empty((dirs, 4 * n, batch), seq.dtype)
    tmp = np.empty((dirs, n, batch), seq.dtype)
    sig, gi, go, gf, gc = g[:, :3 * n], g[:, :n], g[:, n:2 * n], g[:, 2 * n:3 * n], g[:, 3 * n:]
    ys = np.empty((seq.n_steps, dirs, batch, n), seq.dtype) if attrs.output_used[0] else None
    for t in range(seq.n_steps):
        np.matmul(r, h, out=g)
        g += seq.xw[:, :, t]
        logistic(sig, out=sig)
        np.tanh(gc, out=gc)
        c *= gf
        np.multiply(gi, gc, out=tmp)
        c += tmp
        np.tanh(c, out=tmp)
        np.multiply(go, tmp, out=h)
        if ys is not None:
            ys[t] = h.transpose(0, 2, 1)
    finals = [np.ascontiguousarray(v.transpose(0, 2, 1)) for v in (h, c)]
    return seq.outputs(ys, finals, s, attrs.output_used)


# --- GRU ------------------------------------------------------------------------------------------

@kernel("GRU", since=7)
@_quiet
def gru(inputs: Inputs, attrs: Attrs) -> Outputs:
    """GRU with gate order z, r, h; ``linear_before_reset`` applies the reset after R_h."""
    s = _setup(attrs, ("Sigmoid", "Tanh"))
    if _plain(inputs, s, [[logistic, np.tanh]]):
        return _gru_gate_major(inputs, s, attrs)
    lbr = bool(attrs.get("linear_before_reset") or 0)
    seq = _Seq(inputs, s, 3, 2 if lbr else 3)
    n = seq.hid
    h = seq.initial(inputs[5] if len(inputs) > 5 else None, s)
    r_w = inputs[2]
    b = inputs[3] if len(inputs) > 3 else None
    rb_h = b[:, None, 5 * n:] if lbr and b is not None else None
    rt = r_w.transpose(0, 2, 1)  # [dirs, hidden, 3*hidden]
    rt_zr, rt_h = rt[..., :2 * n], rt[..., 2 * n:]
    fns, cl, mask = s.fns, s.clip, seq.mask
    uniform = len(fns) == 1
    f_act, g_act = fns[0] if uniform else (None, None)
    ys = np.empty((seq.n_steps, seq.n_dirs, seq.batch, n), seq.dtype) if attrs.output_used[0] else None
    for t in range(seq.n_steps):
        xw = seq.xw[t]
        if lbr:
            rec = np.matmul(h, rt)
            zr = _clip(xw[..., :2 * n] + rec[..., :2 * n], cl)
            zr = f_act(zr) if uniform else _apply(fns, 0, zr)
            z, r = zr[..., :n], zr[..., n:]
            rh = rec[..., 2 * n:] if rb_h is None else rec[..., 2 * n:] + rb_h
            hh = xw[..., 2 * n:] + r * rh
        else:
            zr = _clip(xw[..., :2 * n] + np.matmul(h, rt_zr), cl)
            zr = f_act(zr) if uniform else _apply(fns, 0, zr)
            z, r = zr[..., :n], zr[..., n:]
            hh = xw[..., 2 * n:] + np.matmul(r * h, rt_h)
        _clip(hh, cl)
        hh = g_act(hh) if uniform else _apply(fns, 1, hh)
        h_new = hh + z * (h - hh)
        h = h_new if mask is None else np.where(mask[t], h_new, h)
        if ys is not None:
            ys[t] = h_new
    return seq.outputs(ys, [h], s, attrs.output_used)


def _gru_gate_major(inputs: Inputs, s: _Setup, attrs: Attrs) -> Outputs:
    """The plain GRU's loop on transposed states, as :func:`_lstm_gate_major`'s."""
    lbr = bool(attrs.get("linear_before_reset") or 0)
    seq = _Seq(inputs, s, 3, 2 if lbr else 3, gate_major=True)
    n, dirs, batch = seq.hid, seq.n_dirs, seq.batch
    h = _transposed_state(seq.initial(inputs[5] if len(inputs) > 5 else None, s))
    r_w = inputs[2]  # [dirs, 3·hidden, hidden]
    b = inputs[3] if len(inputs) > 3 else None
    rb_h = b[:, 5 * n:, None] if lbr and b is not None else None  # [dirs, hidden, 1]
    g = np.empty((dirs, 3 * n, batch), seq.dtype)
    zr, z, r, hh = g[:, :2 * n], g[:, :n], g[:, n:2 * n], g[:, 2 * n:]
    rh = np.empty((dirs, n, batch), seq.dtype)
    ys = np.empty((seq.n_steps, dirs, batch, n), seq.dtype) if attrs.output_used[0] else None
    for t in range(seq.n_steps):
        xw = seq.xw[:, :, t]
        if lbr:  # hh = xw_h + r·(h·R_hᵀ + Rb_h)
            np.matmul(r_w, h, out=g)
            zr += xw[:, :2 * n]
            logistic(zr, out=zr)
            if rb_h is not None:
                hh += rb_h
            hh *= r
        else:  # hh = xw_h + (r·h)·R_hᵀ
            zr[...] = np.matmul(r_w[:, :2 * n], h)
            zr += xw[:, :2 * n]
            logistic(zr, out=zr)
            np.multiply(r, h, out=rh)
            hh[...] = np.matmul(r_w[:, 2 * n:], rh)
        hh += xw[:, 2 * n:]
        np.tanh(hh, out=hh)
        np.subtract(h, hh, out=rh)  # h' = hh + z·(h − hh)
        rh *= z
        np.add(hh, rh, out=h)
        if ys is not None:
            ys[t] = h.transpose(0, 2, 1)
    return seq.outputs(ys, [np.ascontiguousarray(h.transpose(0, 2, 1))], s, attrs.output_used)


# --- RNN ------------------------------------------------------------------------------------------

@kernel("RNN", since=7)
@_quiet
def rnn(inputs: Inputs, attrs: Attrs) -> Outputs:
    """Simple RNN: H_t = f(X_t·Wᵀ + H_{t-1}·Rᵀ + Wb + Rb)."""
    s = _setup(attrs, ("Tanh",))
    seq = _Seq(inputs, s, 1, 1)
    n = seq.hid
    h = seq.initial(inputs[5] if len(inputs) > 5 else None, s)
    rt = inputs[2].transpose(0, 2, 1)
    fns, cl, mask = s.fns, s.clip, seq.mask
    uniform = len(fns) == 1
    f_act = fns[0][0] if uniform else None
    ys = np.empty((seq.n_steps, seq.n_dirs, seq.batch, n), seq.dtype) if attrs.output_used[0] else None
    for t in range(seq.n_steps):
        a = _clip(seq.xw[t] + np.matmul(h, rt), cl)
        h_new = f_act(a) if uniform else _apply(fns, 0, a)
        h = h_new if mask is None else np.where(mask[t], h_new, h)
        if ys is not None:
            ys[t] = h_new
    return seq.outputs(ys, [h], s, attrs.output_used)
