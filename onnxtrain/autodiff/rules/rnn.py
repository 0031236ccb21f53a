"""Gradient rules of LSTM, GRU and RNN (same names as engine/kernels/rnn.py).

No single op computes these gradients, so each rule lowers the node to its per-step equations and
emits backprop through time, unrolled over the static sequence length:

* the hidden states h_t come from the forward node's Y output (added when the model omits it), so
  every gate is recomputed with batched MatMuls over all steps at once; only LSTM's cell state
  (and its peephole gates) need a sequential elementwise recurrence;
* the backward recurrence is linear in (dh, dc): its coefficients (gate derivatives) are computed
  batched, and each step costs one concat, a few multiplies and one MatMul with R;
* the per-step pre-activation gradients dG are concatenated and give dX, dW, dR, dB with one
  MatMul/Einsum each.

All tensors are kept as [dirs, steps, batch, features] in *walking order* (the reverse direction's
steps reversed), so both directions of a bidirectional node step together with batched MatMuls.
Supported: directions forward/reverse/bidirectional, layout 0/1, B, initial_h/initial_c absent or
given, LSTM peepholes and input_forget (f = 1 − i), GRU linear_before_reset 0/1, clip (0 gradient where
it cut a gate's input), any of ONNX's activations (each direction its own), and sequence_lens (the valid
steps are a prefix of each sample's walk: the backward zeroes the new states' gradients past it and
passes the state's own gradient through).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.engine.kernels.rnn import activation_specs

_DEFAULT_ACTS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh"), "RNN": ("tanh",)}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


class _Unroll:
    """Shapes, layout helpers and the shared weight-gradient tail of one recurrent node."""

    def __init__(self, g: GradCtx):
        op = g.node.op_type
        self.g = g
        direction = g.attr("direction") or "forward"
        self.D = 2 if direction == "bidirectional" else 1
        self.rev = [False, True] if self.D == 2 else [direction == "reverse"]
        self.layout = int(g.attr("layout") or 0)
        self.lens = g.x(4) if g.has_x(4) else None  # sequence_lens: per-sample lengths, or None
        self._valid: str | None = None
        self._rev: str | None = None
        self._m: list[str] | None = None
        self._keep: list[str] | None = None
        clip = g.attr("clip")
        self.clip = None if clip is None else float(clip)
        try:
            specs = activation_specs(op, g.attr("activations"), g.attr("activation_alpha"),
                                     g.attr("activation_beta"), _DEFAULT_ACTS[op], self.D)
        except ValueError as e:
            raise RuleError(str(e)) from None
        n = len(_DEFAULT_ACTS[op])
        # (f, g[, h]), each as its (name, alpha, beta) per direction
        self.acts = [tuple(specs[d * n + k] for d in range(self.D)) for k in range(n)]
        xs, ws, rs = g.static_shape(0), g.static_shape(1), g.static_shape(2)
        t = None if xs is None else xs[0 if self.layout == 0 else 1]
        if t is None:
            raise RuleError(f"{op} gradient needs a static sequence length (X has shape {xs})")
        self.T = t
        hid = g.attr("hidden_size") or (rs[2] if rs is not None else None)
        n_in = ws[2] if ws is not None else None
        if hid is None or n_in is None:
            raise RuleError(f"{op} gradient needs static W/R shapes (hidden and input sizes)")
        self.H, self.I = int(hid), int(n_in)
        self.G = _GATES[op] * self.H
        self.one = g.const(1.0)

    # ---- small emitters ----------------------------------------------------------------------
    def e(self, op: str, *inputs: str | None, **attrs: object) -> str:
        return self.g.emit(op, *inputs, **attrs)

    def mul(self, a: str, b: str) -> str:
        return self.e("Mul", a, b)

    def add(self, a: str | None, b: str | None) -> str | None:
        if a is None:
            return b
        return a if b is None else self.e("Add", a, b)

    def one_minus(self, a: str) -> str:
        return self.e("Sub", self.one, a)

    def dsig(self, s: str) -> str:
        """σ' from σ: s·(1 − s)."""
        return self.mul(s, self.one_minus(s))

    def dtanh(self, t: str) -> str:
        """tanh' from tanh: 1 − t²."""
        return self.one_minus(self.mul(t, t))


    def clipped(self, pre: str) -> tuple[str, str | None]:
        """(pre-activation clipped to [−clip, clip], the 0/1 mask where it was not cut), or (pre, None)."""
        if self.clip is None:
            return pre, None
        c = self.g.const(self.clip)
        inside = self.e("LessOrEqual", self.e("Abs", pre), c)
        return self.e("Clip", pre, self.e("Neg", c), c), self.e("Cast", inside, to=self.g.dtype)

    def masked(self, coef: str, mask: str | None) -> str:
        return coef if mask is None else self.mul(coef, mask)

    def _per_direction(self, fn, specs: tuple, *values: str) -> str:
        """``fn(spec, *values)`` with each direction's spec on its slice [d] of ``values`` [D, ...]."""
        if len(set(specs)) == 1:
            return fn(specs[0], *values)
        parts = [self.split(v, [1] * self.D, 0) for v in values]
        return self.cat([fn(sp, *(p[d] for p in parts)) for d, sp in enumerate(specs)], 0)

    def act(self, specs: tuple, x: str) -> str:
        """Activation ``specs`` (per direction: name, alpha, beta) of ``x`` [D, ...]."""
        return self._per_direction(self._act, specs, x)

    def dact(self, specs: tuple, x: str, y: str) -> str:
        """The derivative of activation ``specs`` (per direction) at ``x``, where ``y`` is its value there."""
        return self._per_direction(self._dact, specs, x, y)

    def _act(self, spec: tuple[str, float, float], x: str) -> str:
        """Activation ``spec`` (name, alpha, beta) of ``x`` in standard ONNX ops, as the kernel has it."""
        name, a, b = spec
        g = self.g
        simple = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu", "softsign": "Softsign",
                  "softplus": "Softplus"}
        if name in simple:
            return self.e(simple[name], x)
        if name == "hardsigmoid":
            return self.e("HardSigmoid", x, alpha=a, beta=b)
        if name == "leakyrelu":
            return self.e("Where", self.e("GreaterOrEqual", x, g.const(0)), x, self.mul(x, g.const(a)))
        if name == "thresholdedrelu":
            return self.e("Where", self.e("Greater", x, g.const(a)), x, g.const(0))
        if name == "scaledtanh":
            return self.mul(g.const(a), self.e("Tanh", self.mul(x, g.const(b))))
        if name == "affine":
            return self.e("Add", self.mul(x, g.const(a)), g.const(b))
        if name == "elu":
            neg = self.mul(g.const(a), self.e("Sub", self.e("Exp", self.e("Min", x, g.const(0))), self.one))
            return self.e("Where", self.e("GreaterOrEqual", x, g.const(0)), x, neg)
        raise RuleError(f"{g.node.op_type} gradient: activation {name!r} is not supported")

    def _dact(self, spec: tuple[str, float, float], x: str, y: str) -> str:
        """The derivative of activation ``spec`` at ``x``, where ``y`` is its value there."""
        name, a, b = spec
        g = self.g
        zero = g.const(0)
        if name == "sigmoid":
            return self.dsig(y)
        if name == "tanh":
            return self.dtanh(y)
        if name == "relu":
            return self.e("Cast", self.e("Greater", x, zero), to=g.dtype)
        if name == "softsign":
            d = self.e("Add", self.one, self.e("Abs", x))
            return self.e("Reciprocal", self.mul(d, d))
        if name == "softplus":
            return self.e("Sigmoid", x)
        if name == "hardsigmoid":
            z = self.e("Add", self.mul(x, g.const(a)), g.const(b))
            inside = self.e("And", self.e("Greater", z, zero), self.e("Less", z, self.one))
            return self.e("Where", inside, g.const(a), zero)
        if name == "leakyrelu":
            return self.e("Where", self.e("GreaterOrEqual", x, zero), self.one, g.const(a))
        if name == "thresholdedrelu":
            return self.e("Cast", self.e("Greater", x, g.const(a)), to=g.dtype)
        if name == "scaledtanh":
            t = self.e("Tanh", self.mul(x, g.const(b)))
            return self.mul(g.const(a * b), self.dtanh(t))
        if name == "affine":
            return self.e("Expand", g.const(a), self.e("Shape", x))
        if name == "elu":
            return self.e("Where", self.e("GreaterOrEqual", x, zero), self.one, self.e("Add", y, g.const(a)))
        raise RuleError(f"{g.node.op_type} gradient: activation {name!r} has no derivative here")
    def idx(self, rows: list[list[int]]) -> str:
        return self.g.w.const(np.array(rows, dtype=np.int64), TensorProto.INT64)

    def walk(self, t: int, d: int) -> int:
        """Time index of walking step ``t`` of direction ``d``."""
        return self.T - 1 - t if self.rev[d] else t

    def split(self, a: str, sizes: list[int], axis: int) -> list[str]:
        if len(sizes) == 1:
            return [a]
        return self.g.emit("Split", a, self.g.ints(sizes), axis=axis, outputs=len(sizes))

    def steps(self, a: str) -> list[str]:
        """[D, T, B, F] → T tensors [D, 1, B, F]."""
        return self.split(a, [1] * self.T, 1)

    def cat(self, parts: list[str], axis: int) -> str:
        return parts[0] if len(parts) == 1 else self.e("Concat", *parts, axis=axis)

    # ---- sequence_lens -----------------------------------------------------------------------
    # With lengths, walking step t of sample b is valid while t < len_b (the reverse direction walks each
    # sequence backwards within its own length, as the kernel does), and the state is frozen after it.
    # The valid steps are a prefix of the walk, so recomputing the forward unmasked gives their values;
    # the backward masks the new states' gradients and passes the state's own past the frozen steps.
    def _lengths(self) -> tuple[str, str]:
        """(valid [T, B] bool, rev [T, B] int64: each sequence's time index at a reverse walking step)."""
        if self._valid is None or self._rev is None:
            g = self.g
            lens = self.e("Unsqueeze", self.e("Cast", self.lens, to=TensorProto.INT64), g.ints([0]))  # [1, B]
            t = g.w.const(np.arange(self.T, dtype=np.int64).reshape(-1, 1), TensorProto.INT64)  # [T, 1]
            self._valid = self.e("Less", t, lens)
            back = self.e("Sub", self.e("Sub", lens, g.ints([1])), t)
            self._rev = self.e("Where", self._valid, back, self.e("Expand", t, self.e("Shape", self._valid)))
        return self._valid, self._rev

    def _masks(self) -> tuple[list[str], list[str]]:
        """Per walking step, the [1, 1, B, 1] float masks of valid steps and of frozen ones."""
        if self._m is None or self._keep is None:
            valid, _ = self._lengths()
            m = self.e("Unsqueeze", self.e("Cast", valid, to=self.g.dtype), self.g.ints([0, 3]))
            self._m, self._keep = self.steps(m), self.steps(self.one_minus(m))
        return self._m, self._keep

    def valid(self, a: str | None, t: int) -> str | None:
        """``a`` zeroed at the samples whose sequence has ended before walking step ``t``."""
        return a if a is None or self.lens is None else self.mul(a, self._masks()[0][t])

    def frozen(self, ds: str | None, t: int) -> str | None:
        """The part of the state gradient ``ds`` (after step ``t``) that passes to the state before it:
        all of it where step ``t`` is past the sample's length, none elsewhere."""
        return None if ds is None or self.lens is None else self.mul(ds, self._masks()[1][t])

    def flip(self, a: str) -> str:
        """``a`` [T, B, F] reversed in time, each sequence within its own length (its own inverse)."""
        _, rev = self._lengths()
        idx = self.e("Expand", self.e("Unsqueeze", rev, self.g.ints([2])), self.e("Shape", a))
        return self.e("GatherElements", a, idx, axis=0)

    def _walked(self, per_dir: list[str]) -> str:
        """[T, B, F] per direction (in time order) → [D, T, B, F] in walking order, with lengths."""
        walked = [self.flip(p) if r else p for p, r in zip(per_dir, self.rev)]
        return self.cat([self.e("Unsqueeze", p, self.g.ints([0])) for p in walked], 0)

    # ---- layouts -----------------------------------------------------------------------------
    def walk_x(self) -> str:
        """X → [D, T, B, I] in walking order."""
        x = self.g.x(0)
        if self.layout == 1:
            x = self.e("Transpose", x, perm=[1, 0, 2])
        if self.lens is not None:
            return self._walked([x] * self.D)
        if self.D == 1 and not self.rev[0]:
            return self.e("Unsqueeze", x, self.g.ints([0]))
        return self.e(
            "Gather", x, self.idx([[self.walk(t, d) for t in range(self.T)] for d in range(self.D)]), axis=0
        )

    def walk_y(self, y: str) -> str:
        """Y (or dY), layout 0 [T, D, B, H] / layout 1 [B, T, D, H] → [D, T, B, H] in walking order."""
        if self.layout == 1:
            y = self.e("Transpose", y, perm=[1, 2, 0, 3])
        if self.lens is not None:
            parts = self.split(y, [1] * self.D, 1)
            return self._walked([self.e("Squeeze", p, self.g.ints([1])) for p in parts])
        if self.D == 1 and not self.rev[0]:
            return self.e("Transpose", y, perm=[1, 0, 2, 3])
        flat = self.e("Reshape", y, self.g.ints([self.T * self.D, -1, self.H]))
        rows = [[self.walk(t, d) * self.D + d for t in range(self.T)] for d in range(self.D)]
        return self.e("Gather", flat, self.idx(rows), axis=0)

    def unwalk_x(self, dxw: str) -> str:
        """[D, T, B, I] in walking order → dX in X's layout, summed over directions."""
        if self.lens is not None:
            parts = [self.e("Squeeze", p, self.g.ints([0])) for p in self.split(dxw, [1] * self.D, 0)]
            parts = [self.flip(p) if r else p for p, r in zip(parts, self.rev)]
            dx = parts[0] if self.D == 1 else self.e("Add", *parts)
            return self.e("Transpose", dx, perm=[1, 0, 2]) if self.layout == 1 else dx
        if self.D == 1 and not self.rev[0]:
            dx = self.e("Squeeze", dxw, self.g.ints([0]))
        else:
            flat = self.e("Reshape", dxw, self.g.ints([self.D * self.T, -1, self.I]))
            rows = [[d * self.T + self.walk(t, d) for t in range(self.T)] for d in range(self.D)]
            dx = self.e("Gather", flat, self.idx(rows if self.D == 2 else rows[0]), axis=0)
            if self.D == 2:
                dx = self.g.reduce("ReduceSum", dx, [0], keepdims=0)
        return self.e("Transpose", dx, perm=[1, 0, 2]) if self.layout == 1 else dx

    def state_in(self, name: str | None) -> str | None:
        """A state (or its gradient) [D, B, H] (layout 1: [B, D, H]) → [D, 1, B, H]."""
        if name is None:
            return None
        if self.layout == 1:
            name = self.e("Transpose", name, perm=[1, 0, 2])
        return self.e("Unsqueeze", name, self.g.ints([1]))

    def state_out(self, s: str) -> str:
        """[D, 1, B, H] → the layout of initial_h/initial_c."""
        s = self.e("Squeeze", s, self.g.ints([1]))
        return self.e("Transpose", s, perm=[1, 0, 2]) if self.layout == 1 else s

    def input_state(self, i: int) -> str | None:
        return self.state_in(self.g.x(i)) if self.g.has_x(i) else None

    def shift(self, a: str, init: str | None) -> str:
        """[D, T, B, H] → the previous step's values: init (or zeros) then a[:, :T−1]."""
        g = self.g
        head = g.emit("Slice", a, g.ints([0]), g.ints([self.T - 1]), g.ints([1]))
        if init is not None:
            return self.e("Concat", init, head, axis=1) if self.T > 1 else init
        return self.e("Pad", head, g.ints([0, 1, 0, 0, 0, 0, 0, 0]))

    def wt4(self, w: str) -> str:
        """[D, G, K] → [D, 1, K, G] (right operand of a per-direction MatMul)."""
        return self.e("Unsqueeze", self.e("Transpose", w, perm=[0, 2, 1]), self.g.ints([1]))

    def w4(self, w: str) -> str:
        """[D, G, K] → [D, 1, G, K]."""
        return self.e("Unsqueeze", w, self.g.ints([1]))

    def b4(self, b: str) -> str:
        """[D, G] → [D, 1, 1, G]."""
        return self.e("Unsqueeze", b, self.g.ints([1, 2]))

    def biases(self) -> tuple[str, str] | None:
        """(Wb, Rb), each [D, G], or None when B is absent."""
        if not self.g.has_x(3):
            return None
        wb, rb = self.split(self.g.x(3), [self.G, self.G], 1)
        return wb, rb

    def state_grad(self, t: int, rec: str | None, ds: str | None) -> str | None:
        """The gradient on the hidden state after walking step ``t``: dY_h at the last step, else what step
        t + 1 sent back (``rec``) plus what passed its frozen samples (``ds``, the one after step t + 1)."""
        return self.state_in(self.g.dy(1)) if t == self.T - 1 else self.add(rec, self.frozen(ds, t + 1))

    def new_state_grad(self, t: int, dy: str | None, ds: str | None) -> str:
        """The gradient on step ``t``'s new state: its output's and the state's (zeros if neither flows),
        zeroed where the sample's sequence has ended."""
        d = self.add(dy, ds)
        if d is None:
            d = self.state_in(self.g.dy_or_zeros(1))
        return self.valid(d, t)  # type: ignore[return-value]

    def dy_steps(self) -> list[str | None]:
        dy = self.g.dy(0)
        if dy is None:
            return [None] * self.T
        return self.steps(self.walk_y(dy))

    def finish(self, dgx: str, dgh: str, xw: str, hprev: str, dh0: str | None, dr: str | None = None) -> None:
        """dX, dW, dR, dB from the pre-activation gradients of the input (dgx) and recurrent (dgh) paths."""
        g = self.g
        if g.needs_dx(0):
            g.set_dx(0, self.unwalk_x(self.e("MatMul", dgx, self.w4(g.x(1)))))  # dX_t = dG_t·W
        if g.needs_dx(1):
            g.set_dx(1, self.e("Einsum", dgx, xw, equation="dtbg,dtbi->dgi"))  # dW = Σ_t,b dGᵀ·x
        if g.needs_dx(2):
            g.set_dx(2, dr or self.e("Einsum", dgh, hprev, equation="dtbg,dtbh->dgh"))  # dR = Σ dGᵀ·h_prev
        if g.has_x(3) and g.needs_dx(3):
            sx = g.reduce("ReduceSum", dgx, [1, 2], keepdims=0)
            sh = sx if dgh == dgx else g.reduce("ReduceSum", dgh, [1, 2], keepdims=0)
            g.set_dx(3, self.e("Concat", sx, sh, axis=1))
        if g.has_x(5) and g.needs_dx(5) and dh0 is not None:
            g.set_dx(5, self.state_out(dh0))


# ------------------------------------------------------------------------------------------- LSTM


@gradient("LSTM", uses=("x*", "y0", "y1"), stop=(4,))
def lstm_grad(g: GradCtx) -> None:
    # gates (order i, o, f, c): a = x·Wᵀ + h_prev·Rᵀ + Wb + Rb;  i, o, f = σ(a_i + P_i c_prev, a_o + P_o c,
    # a_f + P_f c_prev), c̃ = tanh(a_c);  c = f·c_prev + i·c̃;  h = o·tanh(c)
    u = _Unroll(g)
    H = u.H
    fa, ga, ha = u.acts  # the gates', the cell input's and the cell output's activations (σ, tanh, tanh)
    couple = bool(g.attr("input_forget"))  # f = 1 − i: the forget gate's own input is not used
    xw = u.walk_x()
    hw = u.walk_y(g.y(0))
    h0, c0 = u.input_state(5), u.input_state(6)
    hprev = u.shift(hw, h0)
    a = u.e("Add", u.e("MatMul", xw, u.wt4(g.x(1))), u.e("MatMul", hprev, u.wt4(g.x(2))))
    bias = u.biases()
    if bias is not None:
        a = u.e("Add", a, u.b4(u.e("Add", *bias)))
    peep = g.has_x(7)
    m_i = m_o = m_f = m_c = None  # with clip: 0/1 where each gate's input was not cut
    if not peep:
        a, mask = u.clipped(a)
        if mask is not None:
            m_i, m_o, m_f, m_c = u.split(mask, [H, H, H, H], 3)
        sig, a_c = u.split(a, [3 * H, H], 3)
        a_i, a_o, a_f = u.split(sig, [H, H, H], 3)
        i_g, o_g, f_g = u.split(u.act(fa, sig), [H, H, H], 3)
        if couple:
            f_g = u.one_minus(i_g)
        cc = u.act(ga, a_c)
        f_s, ic_s = u.steps(f_g), u.steps(u.mul(i_g, cc))
        cs: list[str] = []
        c = c0
        for t in range(u.T):
            c = ic_s[t] if c is None else u.e("Add", u.mul(f_s[t], c), ic_s[t])
            cs.append(c)
    else:
        p_i, p_o, p_f = u.split(u.b4(g.x(7)), [H, H, H], 3)
        a_i, a_o, a_f, a_c = u.split(a, [H, H, H, H], 3)
        a_c, m_c = u.clipped(a_c)
        cc = u.act(ga, a_c)
        ai_s, ao_s, af_s, cc_s = u.steps(a_i), u.steps(a_o), u.steps(a_f), u.steps(cc)
        cs, is_, os_, fs = [], [], [], []
        raw: dict[str, list[str]] = {"i": [], "o": [], "f": []}  # the gates' inputs per step, unclipped
        c = c0
        for t in range(u.T):
            pre_i = ai_s[t] if c is None else u.e("Add", ai_s[t], u.mul(p_i, c))
            pre_f = af_s[t] if c is None else u.e("Add", af_s[t], u.mul(p_f, c))
            it = u.act(fa, u.clipped(pre_i)[0])
            ft = u.one_minus(it) if couple else u.act(fa, u.clipped(pre_f)[0])
            ic = u.mul(it, cc_s[t])
            c = ic if c is None else u.e("Add", u.mul(ft, c), ic)
            pre_o = u.e("Add", ao_s[t], u.mul(p_o, c))
            os_.append(u.act(fa, u.clipped(pre_o)[0]))
            cs.append(c)
            is_.append(it)
            fs.append(ft)
            for k, v in (("i", pre_i), ("o", pre_o), ("f", pre_f)):
                raw[k].append(v)
        i_g, o_g, f_g = u.cat(is_, 1), u.cat(os_, 1), u.cat(fs, 1)
        cut = {k: u.clipped(u.cat(raw[k], 1)) for k in "iof"}
        (a_i, m_i), (a_o, m_o), (a_f, m_f) = (cut[k] for k in "iof")
    c_all = u.cat(cs, 1)
    cprev = u.shift(c_all, c0)
    tc = u.act(ha, c_all)
    # backward coefficients: dc += dh·k1;  da_o = dh·b_o;  da_i, da_f, da_c = dc·(a_i, a_f, a_c);
    # dc_prev = dc·fc
    k1 = u.mul(o_g, u.dact(ha, c_all, tc))
    b_o = u.masked(u.mul(tc, u.dact(fa, a_o, o_g)), m_o)
    if couple:  # c = (1 − i)·c_prev + i·c̃: i's input gets (c̃ − c_prev)·i', f's none
        c_i = u.masked(u.mul(u.e("Sub", cc, cprev), u.dact(fa, a_i, i_g)), m_i)
        c_f = u.e("Expand", g.const(0), u.e("Shape", c_i))
    else:
        c_i = u.masked(u.mul(cc, u.dact(fa, a_i, i_g)), m_i)
        c_f = u.masked(u.mul(cprev, u.dact(fa, a_f, f_g)), m_f)
    c_c = u.masked(u.mul(i_g, u.dact(ga, a_c, cc)), m_c)
    fc = f_g
    if peep:
        k1 = u.e("Add", k1, u.mul(b_o, p_o))
        fc = u.e("Add", f_g, u.e("Add", u.mul(c_i, p_i), u.mul(c_f, p_f)))
    coef_s = u.steps(u.e("Concat", c_i, b_o, c_f, c_c, axis=3))
    k1_s, fc_s = u.steps(k1), u.steps(fc)
    r4 = u.w4(g.x(2))
    dhw = u.dy_steps()
    dgs: list[str] = [""] * u.T
    rec: str | None = None
    dc: str | None = None
    need_dh0 = g.has_x(5) and g.needs_dx(5)
    ds: str | None = None  # gradient on the hidden state after the step
    dcs: str | None = None  # and on the cell state
    for t in range(u.T - 1, -1, -1):
        ds = u.state_grad(t, rec, ds)
        dh = u.new_state_grad(t, dhw[t], ds)
        dcs = u.state_in(g.dy(2)) if t == u.T - 1 else u.add(u.mul(dc, fc_s[t + 1]), u.frozen(dcs, t + 1))  # type: ignore[arg-type]
        dc = u.add(u.mul(dh, k1_s[t]), u.valid(dcs, t))
        dgs[t] = u.mul(u.e("Concat", dc, dh, dc, dc, axis=3), coef_s[t])
        if t > 0 or need_dh0:
            rec = u.e("MatMul", dgs[t], r4)  # dh_prev = dG·R
    dgate = u.cat(dgs, 1)
    u.finish(dgate, dgate, xw, hprev, u.add(rec, u.frozen(ds, 0)) if need_dh0 else None)
    if g.has_x(6) and g.needs_dx(6):
        g.set_dx(6, u.state_out(u.add(u.mul(dc, fc_s[0]), u.frozen(dcs, 0))))  # type: ignore[arg-type]
    if peep and g.needs_dx(7):
        d_i, d_o, d_f, _ = u.split(dgate, [H, H, H, H], 3)
        parts = [
            g.reduce("ReduceSum", u.mul(d, v), [1, 2], keepdims=0)
            for d, v in ((d_i, cprev), (d_o, c_all), (d_f, cprev))
        ]
        g.set_dx(7, u.e("Concat", *parts, axis=1))


# -------------------------------------------------------------------------------------------- GRU


@gradient("GRU", uses=("x*", "y0", "y1"), stop=(4,))
def gru_grad(g: GradCtx) -> None:
    # z, r = σ(x·W_zrᵀ + h_prev·R_zrᵀ + b);  h̃ = tanh(x·W_hᵀ + (r·h_prev)·R_hᵀ + b_h), or with
    # linear_before_reset tanh(x·W_hᵀ + Wb_h + r·(h_prev·R_hᵀ + Rb_h));  h = h̃ + z·(h_prev − h̃)
    u = _Unroll(g)
    H = u.H
    fa, ga = u.acts  # the gates' and the candidate's activations (σ, tanh)
    lbr = bool(g.attr("linear_before_reset") or 0)
    xw = u.walk_x()
    hw = u.walk_y(g.y(0))
    h0 = u.input_state(5)
    hprev = u.shift(hw, h0)
    gx = u.e("MatMul", xw, u.wt4(g.x(1)))
    bias = u.biases()
    if bias is not None:
        gx = u.e("Add", gx, u.b4(bias[0] if lbr else u.e("Add", *bias)))
    gx_zr, gx_h = u.split(gx, [2 * H, H], 3)
    if lbr:
        gh = u.e("MatMul", hprev, u.wt4(g.x(2)))
        if bias is not None:
            gh = u.e("Add", gh, u.b4(bias[1]))
        gh_zr, nh = u.split(gh, [2 * H, H], 3)
        pre_zr, m_zr = u.clipped(u.e("Add", gx_zr, gh_zr))
        z, rg = u.split(u.act(fa, pre_zr), [H, H], 3)
        pre_h, m_h = u.clipped(u.e("Add", gx_h, u.mul(rg, nh)))
    else:
        r_zr, r_h = u.split(g.x(2), [2 * H, H], 1)
        pre_zr, m_zr = u.clipped(u.e("Add", gx_zr, u.e("MatMul", hprev, u.wt4(r_zr))))
        z, rg = u.split(u.act(fa, pre_zr), [H, H], 3)
        rh = u.mul(rg, hprev)
        pre_h, m_h = u.clipped(u.e("Add", gx_h, u.e("MatMul", rh, u.wt4(r_h))))
    hh = u.act(ga, pre_h)
    m_z, m_r = u.split(m_zr, [H, H], 3) if m_zr is not None else (None, None)
    pre_z, pre_r = u.split(pre_zr, [H, H], 3)
    # dh → da_z = dh·c_z, da_h̃ = dh·c_h (pre-activation gradients), dh_prev ∋ dh·z
    c_z = u.masked(u.mul(u.e("Sub", hprev, hh), u.dact(fa, pre_z, z)), m_z)
    c_h = u.masked(u.mul(u.one_minus(z), u.dact(ga, pre_h, hh)), m_h)
    dsig_r = u.masked(u.dact(fa, pre_r, rg), m_r)
    z_s = u.steps(z)
    dhw = u.dy_steps()
    need_dh0 = g.has_x(5) and g.needs_dx(5)
    rec: str | None = None
    dhs: list[str] = [""] * u.T
    if lbr:
        # a_r gets dh·c_h·nh·σ'(r); the recurrent h-path (h_prev·R_hᵀ + Rb_h) gets dh·c_h·r
        coef = u.e("Concat", c_z, u.mul(c_h, u.mul(nh, dsig_r)), u.mul(c_h, rg), axis=3)
        coef_s = u.steps(coef)
        r4 = u.w4(g.x(2))
        dghs: list[str] = [""] * u.T
        ds: str | None = None
        for t in range(u.T - 1, -1, -1):
            ds = u.state_grad(t, rec, ds)
            dh = u.new_state_grad(t, dhw[t], ds)
            dhs[t] = dh
            dghs[t] = u.mul(u.e("Concat", dh, dh, dh, axis=3), coef_s[t])
            if t > 0 or need_dh0:
                rec = u.e("Add", u.e("MatMul", dghs[t], r4), u.mul(dh, z_s[t]))
        dgh = u.cat(dghs, 1)
        dzr, _ = u.split(dgh, [2 * H, H], 3)
        dgx = u.e("Concat", dzr, u.mul(u.cat(dhs, 1), c_h), axis=3)
        u.finish(dgx, dgh, xw, hprev, u.add(rec, u.frozen(ds, 0)) if need_dh0 else None)
        return
    # linear_before_reset=0: q = da_h̃·R_h is the gradient of r·h_prev; da_r = q·h_prev·σ'(r)
    c_r = u.mul(hprev, dsig_r)
    cz_s, ch_s, cr_s, rg_s = u.steps(c_z), u.steps(c_h), u.steps(c_r), u.steps(rg)
    r4_h, r4_zr = u.w4(r_h), u.w4(r_zr)
    qs: list[str] = [""] * u.T
    ds_: str | None = None
    for t in range(u.T - 1, -1, -1):
        ds_ = u.state_grad(t, rec, ds_)
        dh = u.new_state_grad(t, dhw[t], ds_)
        dhs[t] = dh
        qs[t] = u.e("MatMul", u.mul(dh, ch_s[t]), r4_h)
        if t > 0 or need_dh0:
            dzr_t = u.e("Concat", u.mul(dh, cz_s[t]), u.mul(qs[t], cr_s[t]), axis=3)
            rec = u.e(
                "Add",
                u.e("Add", u.mul(dh, z_s[t]), u.mul(qs[t], rg_s[t])),
                u.e("MatMul", dzr_t, r4_zr),
            )
    dh_all = u.cat(dhs, 1)
    dzr = u.e("Concat", u.mul(dh_all, c_z), u.mul(u.cat(qs, 1), c_r), axis=3)
    dah = u.mul(dh_all, c_h)
    dgx = u.e("Concat", dzr, dah, axis=3)
    dr = None
    if g.needs_dx(2):
        # R_zr sees h_prev, R_h sees r·h_prev
        dr = u.e(
            "Concat",
            u.e("Einsum", dzr, hprev, equation="dtbg,dtbh->dgh"),
            u.e("Einsum", dah, rh, equation="dtbg,dtbh->dgh"),
            axis=1,
        )
    u.finish(dgx, dgx, xw, hprev, u.add(rec, u.frozen(ds_, 0)) if need_dh0 else None, dr=dr)


# -------------------------------------------------------------------------------------------- RNN


@gradient("RNN", uses=("x*", "y0", "y1"), stop=(4,))
def rnn_grad(g: GradCtx) -> None:
    # h = tanh(x·Wᵀ + h_prev·Rᵀ + Wb + Rb):  da = dh·(1 − h²),  dh_prev = da·R
    # any activation f: h = f(a), da = dh·f'(a) (and 0 where clip cut a)
    u = _Unroll(g)
    xw = u.walk_x()
    hw = u.walk_y(g.y(0))
    hprev = u.shift(hw, u.input_state(5))
    spec = u.acts[0]
    if all(sp[0] == "tanh" for sp in spec) and u.clip is None:
        dact = u.dtanh(hw)
    else:
        a = u.e("Add", u.e("MatMul", xw, u.wt4(g.x(1))), u.e("MatMul", hprev, u.wt4(g.x(2))))
        bias = u.biases()
        if bias is not None:
            a = u.e("Add", a, u.b4(u.e("Add", *bias)))
        a, mask = u.clipped(a)
        dact = u.masked(u.dact(spec, a, hw), mask)
    a_s = u.steps(dact)
    r4 = u.w4(g.x(2))
    dhw = u.dy_steps()
    need_dh0 = g.has_x(5) and g.needs_dx(5)
    rec: str | None = None
    das: list[str] = [""] * u.T
    ds: str | None = None
    for t in range(u.T - 1, -1, -1):
        ds = u.state_grad(t, rec, ds)
        das[t] = u.mul(u.new_state_grad(t, dhw[t], ds), a_s[t])
        if t > 0 or need_dh0:
            rec = u.e("MatMul", das[t], r4)
    da = u.cat(das, 1)
    u.finish(da, da, xw, hprev, u.add(rec, u.frozen(ds, 0)) if need_dh0 else None)
