"""The unrolling of a recurrent node (LSTM, GRU, RNN) that its gradient rule (rnn.py) emits nodes with:
shapes, the walking layout of both directions, sequence lengths, clip masks, activations and their
derivatives, and the weight-gradient tail the three rules share."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.engine.kernels.rnn import activation_specs

_DEFAULT_ACTS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh"), "RNN": ("tanh",)}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
# activations that are ONNX ops of their own with no attribute
_ONNX_ACTS = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu", "softsign": "Softsign",
              "softplus": "Softplus"}
# those whose ONNX op takes the activation's alpha
_ONNX_ALPHA_ACTS = {"leakyrelu": "LeakyRelu", "thresholdedrelu": "ThresholdedRelu", "elu": "Elu"}


def sequence_length(g: GradCtx) -> int | None:
    """The static sequence length of recurrent node ``g``'s X (its axis 0, or 1 with layout 1), or None."""
    xs = g.static_shape(0)
    return None if xs is None else xs[0 if int(g.attr("layout") or 0) == 0 else 1]


class Unroll:
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
        # the static sequence length; None when only a run knows it (rnn_loop.LoopUnroll handles that case)
        self.T: int | None = sequence_length(g)
        hid = g.attr("hidden_size") or (rs[2] if rs is not None else None)
        if hid is None:
            raise RuleError(f"{op} gradient needs the hidden size: no hidden_size attribute, R of shape {rs}")
        self.H = int(hid)
        # the input size, when W or X says it statically (torch's dynamo exporter builds W at run time)
        n_in = next((s[-1] for s in (ws, xs) if s is not None and s[-1] is not None), None)
        self.I = None if n_in is None else int(n_in)
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
        if name in _ONNX_ACTS:
            return self.e(_ONNX_ACTS[name], x)
        if name == "hardsigmoid":
            return self.e("HardSigmoid", x, alpha=a, beta=b)
        if name in _ONNX_ALPHA_ACTS:
            return self.e(_ONNX_ALPHA_ACTS[name], x, alpha=a)
        if name == "scaledtanh":
            return self.mul(g.const(a), self.e("Tanh", self.mul(x, g.const(b))))
        if name == "affine":
            return self.e("Add", self.mul(x, g.const(a)), g.const(b))
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
            t = self._time_index()  # [T, 1]
            self._valid = self.e("Less", t, lens)
            back = self.e("Sub", self.e("Sub", lens, g.ints([1])), t)
            self._rev = self.e("Where", self._valid, back, self.e("Expand", t, self.e("Shape", self._valid)))
        return self._valid, self._rev

    def _time_index(self) -> str:
        """The walking steps 0 … T − 1 as an int64 column [T, 1]."""
        return self.g.w.const(np.arange(self.T, dtype=np.int64).reshape(-1, 1), TensorProto.INT64)

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
            flat = self.e("Reshape", dxw, self.flat_steps_shape(dxw))
            rows = [[d * self.T + self.walk(t, d) for t in range(self.T)] for d in range(self.D)]
            dx = self.e("Gather", flat, self.idx(rows if self.D == 2 else rows[0]), axis=0)
            if self.D == 2:
                dx = self.g.reduce("ReduceSum", dx, [0], keepdims=0)
        return self.e("Transpose", dx, perm=[1, 0, 2]) if self.layout == 1 else dx

    def flat_steps_shape(self, dxw: str) -> str:
        """The shape [D·T, B, I] of ``dxw`` [D, T, B, I] with its first two axes merged."""
        if self.I is not None:
            return self.g.ints([self.D * self.T, -1, self.I])
        last = self.e("Slice", self.e("Shape", dxw), self.g.ints([3]), self.g.ints([4]))
        return self.e("Concat", self.g.ints([self.D * self.T, -1]), last, axis=0)

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

    def final_grad(self, k: int) -> str | None:
        """The gradient of final-state output ``k`` as [D, 1, B, H], zeroed at the sequences of length 0 (the
        kernel gives them zero final states, whatever the initial ones)."""
        d = self.state_in(self.g.dy(k))
        if d is None or self.lens is None:
            return d
        lens = self.e("Cast", self.lens, to=TensorProto.INT64)
        some = self.e("Cast", self.e("Greater", lens, self.g.ints([0])), to=self.g.dtype)
        return self.mul(d, self.e("Unsqueeze", some, self.g.ints([0, 1, 3])))

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
        return self.final_grad(1) if t == self.T - 1 else self.add(rec, self.frozen(ds, t + 1))

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

    def joint_input(self, xw: str, hprev: str) -> str | None:
        """[x, h_prev] along the features, [1, T, B, I + H], for one product with [W, R] where the gates' two
        paths share their gradient (one direction, the input size known), else None."""
        if self.D != 1 or self.I is None:
            return None
        return self.e("Concat", xw, hprev, axis=3)

    def joint_gates(self, xh: str) -> str:
        """The gates' pre-activations without bias, [x, h_prev]·[W, R]ᵀ, from ``xh`` (:meth:`joint_input`)."""
        g = self.g
        return self.e("MatMul", xh, self.wt4(self.e("Concat", g.x(1), g.x(2), axis=2)))

    def finish(self, dgx: str, dgh: str, xw: str, hprev: str, dh0: str | None, dr: str | None = None,
               xh: str | None = None) -> None:
        """dX, dW, dR, dB from the pre-activation gradients of the input (dgx) and recurrent (dgh) paths.
        With ``xh`` (:meth:`joint_input`, dgx = dgh), dW and dR are one product over the T·B rows."""
        g = self.g
        if g.needs_dx(0):
            g.set_dx(0, self.unwalk_x(self.e("MatMul", dgx, self.w4(g.x(1)))))  # dX_t = dG_t·W
        if xh is not None and dr is None and dgx == dgh and (g.needs_dx(1) or g.needs_dx(2)):
            # [dW, dR] = Σ_t,b dGᵀ·[x, h_prev]: one GEMM over the flattened steps and samples
            dwr = self.e("Gemm", self.e("Flatten", dgx, axis=3), self.e("Flatten", xh, axis=3), transA=1)
            dw, dr_ = self.split(self.e("Unsqueeze", dwr, g.ints([0])), [self.I, self.H], 2)  # type: ignore[list-item]
            if g.needs_dx(1):
                g.set_dx(1, dw)
            if g.needs_dx(2):
                g.set_dx(2, dr_)
        else:
            if g.needs_dx(1):
                g.set_dx(1, g.in_float32("Einsum", dgx, xw, equation="dtbg,dtbi->dgi"))  # dW = Σ_t,b dGᵀ·x
            if g.needs_dx(2):
                # dR = Σ dGᵀ·h_prev
                g.set_dx(2, dr or g.in_float32("Einsum", dgh, hprev, equation="dtbg,dtbh->dgh"))
        if g.has_x(3) and g.needs_dx(3):
            sx = g.reduce("ReduceSum", dgx, [1, 2], keepdims=0)
            sh = sx if dgh == dgx else g.reduce("ReduceSum", dgh, [1, 2], keepdims=0)
            g.set_dx(3, self.e("Concat", sx, sh, axis=1))
        if g.has_x(5) and g.needs_dx(5) and dh0 is not None:
            g.set_dx(5, self.state_out(dh0))
