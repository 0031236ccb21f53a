"""Backprop through time for recurrent nodes (LSTM, GRU, RNN) whose sequence length is known only at run
time: the two sequential recurrences become ONNX ``Scan`` nodes, everything else stays batched.

``LoopUnroll`` is ``Unroll`` (rnn_unroll.py) with the layout helpers that read the length from X's shape
at run time (a reverse walk is a ``Slice`` with step −1 instead of a ``Gather`` of constant indices), and
two kinds of ``Scan``:

* forward, over the walking steps: LSTM's cell state (and, with peepholes, the gates that read it);
* backward, over the walking steps from the last: the gradients on the hidden (and cell) state, whose
  per-step coefficients (gate derivatives) the rules compute batched before the scan; the scan outputs
  the per-step pre-activation gradients, stacked, from which the rules get dX, dW, dR, dB batched.

Scan bodies work on one step [D, B, F] of the [D, T, B, F] tensors (axis 1 scanned), so both directions
of a bidirectional node step together; weights enter the bodies as outer values [D, G, K]. Every feature
of the static path is supported, with the same arithmetic (the gradients are bit for bit those of the
unrolled graph). A run whose X has no step at all (T = 0) is not: a Scan of no iteration cannot give
its stacked outputs their batch size, and the run fails at a node downstream, naming it (the static
path does not take T = 0 either; sequence_lens entries of 0 are fine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from onnx import helper, numpy_helper

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.rules.rnn_unroll import Unroll, sequence_length
from onnxtrain.ir.builder import NodeWriter

# A scan body: (its state inputs, its per-step inputs) → (its new states, its per-step outputs).
Body = Callable[[list[str], list[str]], tuple[list[str], list[str]]]
_INT64_MIN = int(np.iinfo(np.int64).min)


def unroll(g: GradCtx) -> Unroll:
    """The unrolling helper of recurrent node ``g``: ``Unroll`` for a static sequence length, else
    ``LoopUnroll`` (whose ``T`` is None)."""
    return Unroll(g) if sequence_length(g) else LoopUnroll(g)  # a static length of 0 too: no step to unroll


class LoopUnroll(Unroll):
    """``Unroll`` for a sequence length known only at run time (or 0); recurrences are ``Scan`` nodes."""

    def __init__(self, g: GradCtx):
        super().__init__(g)
        self.T = None
        self._zeros: str | None = None

    # ---- the length and layouts at run time -----------------------------------------------------
    def _time_index(self) -> str:
        g = self.g
        steps = g.shape_entry(g.shape(0), 0 if self.layout == 0 else 1)  # T, a scalar
        return self.e("Unsqueeze", self.e("Range", g.int64(0), steps, g.int64(1)), g.ints([1]))

    def _steps(self) -> str:
        """T as a 1-D tensor [T] (read from X's shape at run time)."""
        return self.e("Gather", self.g.shape(0), self.g.ints([0 if self.layout == 0 else 1]))

    def reverse(self, a: str, axis: int) -> str:
        """``a`` reversed along ``axis`` (a Slice with step −1)."""
        g = self.g
        return self.e("Slice", a, g.ints([-1]), g.ints([_INT64_MIN]), g.ints([axis]), g.ints([-1]))

    def _directions(self, per_dir: list[str], axis: int) -> str:
        """Per direction, ``a`` [..., T, ...] with its time on ``axis`` (in time order) → walking order,
        the directions stacked on a new axis 0."""
        walked = [self.reverse(p, axis) if r else p for p, r in zip(per_dir, self.rev)]
        return self.cat([self.e("Unsqueeze", p, self.g.ints([0])) for p in walked], 0)

    def walk_x(self) -> str:
        if self.lens is not None:
            return super().walk_x()
        x = self.g.x(0)
        if self.layout == 1:
            x = self.e("Transpose", x, perm=[1, 0, 2])
        return self._directions([x] * self.D, 0)

    def walk_y(self, y: str) -> str:
        if self.lens is not None:
            return super().walk_y(y)
        # layout 0 [T, D, B, H] / layout 1 [B, T, D, H] → [D, T, B, H]
        y = self.e("Transpose", y, perm=[1, 0, 2, 3] if self.layout == 0 else [2, 1, 0, 3])
        if not any(self.rev):
            return y
        parts = [self.e("Squeeze", p, self.g.ints([0])) for p in self.split(y, [1] * self.D, 0)]
        return self._directions(parts, 0)

    def unwalk_x(self, dxw: str) -> str:
        if self.lens is not None:
            return super().unwalk_x(dxw)
        parts = [self.e("Squeeze", p, self.g.ints([0])) for p in self.split(dxw, [1] * self.D, 0)]
        parts = [self.reverse(p, 0) if r else p for p, r in zip(parts, self.rev)]
        dx = parts[0] if self.D == 1 else self.e("Add", *parts)
        return self.e("Transpose", dx, perm=[1, 0, 2]) if self.layout == 1 else dx

    def shift(self, a: str, init: str | None) -> str:
        """[D, T, B, H] → the previous step's values: init (or zeros) then a[:, :T−1] (none when T = 0)."""
        g = self.g
        full = self.e("Concat", init, a, axis=1) if init is not None else self.e(
            "Pad", a, g.ints([0, 1, 0, 0, 0, 0, 0, 0]))
        return self.e("Slice", full, g.ints([0]), self._steps(), g.ints([1]))

    # ---- states of one step, [D, B, H] -----------------------------------------------------------
    def zeros3(self) -> str:
        """Zeros [D, B, H] (B read from X's shape); made outside any body, which may read it."""
        if self._zeros is None:
            g = self.g
            batch = self.e("Gather", g.shape(0), g.ints([1 if self.layout == 0 else 0]))
            shape = self.e("Concat", g.ints([self.D]), batch, g.ints([self.H]), axis=0)
            zero = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(g.dtype)))
            self._zeros = self.e("ConstantOfShape", shape, value=zero)
        return self._zeros

    def state3(self, s4: str | None) -> str:
        """A state [D, 1, B, H] (None: zeros) → [D, B, H]."""
        return self.zeros3() if s4 is None else self.e("Squeeze", s4, self.g.ints([1]))

    def state_out3(self, s: str) -> str:
        """[D, B, H] → the layout of initial_h/initial_c."""
        return self.e("Transpose", s, perm=[1, 0, 2]) if self.layout == 1 else s

    def set_state_grads(self, dh0: str, dc0: str | None = None) -> None:
        """Set the gradients of initial_h and initial_c (when wanted) from theirs [D, B, H]."""
        g = self.g
        for i, d in ((5, dh0), (6, dc0)):
            if d is not None and g.has_x(i) and g.needs_dx(i):
                g.set_dx(i, self.state_out3(d))

    def step_masks(self) -> tuple[str, str] | None:
        """With sequence_lens, the [1, T, B, 1] float masks of valid walking steps and of frozen ones."""
        if self.lens is None:
            return None
        valid, _ = self._lengths()
        m = self.e("Unsqueeze", self.e("Cast", valid, to=self.g.dtype), self.g.ints([0, 3]))
        return m, self.one_minus(m)

    # ---- Scan ----------------------------------------------------------------------------------------
    @contextmanager
    def _body_writer(self, nodes: list) -> Iterator[None]:
        """Route the rule's emitters (and new constants) into ``nodes``, a body graph's, for a while."""
        g = self.g
        outer = g.w
        g.w = NodeWriter(outer.names, nodes, prefix=f"{outer.prefix}Scan/",
                         const_cache=dict(outer.const_cache))
        try:
            yield
        finally:
            g.w = outer

    def scan(self, body: Body, states: list[str], xs: list[str], backward: bool,
             widths: list[int | None] | None = None) -> tuple[list[str], list[str]]:
        """A Scan along axis 1 of ``xs`` [D, T, B, F] (from the last step if ``backward``): its final
        states and its per-step outputs stacked in walking order [D, T, B, F].

        The ``xs`` whose ``widths`` (F) are given go in as one Concat along F that the body splits again:
        one contiguous slice per step instead of a strided copy of each (what numpy's take makes)."""
        g = self.g
        names = g.w.names
        packed = [i for i, w in enumerate(widths or []) if w is not None]
        packed = packed if len(packed) > 1 else []
        alone = [i for i in range(len(xs)) if i not in packed]
        scanned = [xs[i] for i in alone]
        if packed:
            scanned.append(self.e("Concat", *(xs[i] for i in packed), axis=3))
            g.ints([widths[i] for i in packed])  # type: ignore[index,misc]  # made here, the body reads it
        s_in = [names(f"{g.w.prefix}Scan/state") for _ in states]
        x_in = [names(f"{g.w.prefix}Scan/step") for _ in scanned]
        nodes: list = []
        with self._body_writer(nodes):
            steps = [""] * len(xs)
            for i, name in zip(alone, x_in):
                steps[i] = name
            if packed:
                parts = self.split(x_in[-1], [widths[i] for i in packed], 2)  # type: ignore[index,misc]
                for i, name in zip(packed, parts):
                    steps[i] = name
            s_out, outs = body(s_in, steps)
            made = {o for n in nodes for o in n.output}
            seen: set[str] = set()
            results = []
            for v in [*s_out, *outs]:  # each body output a value of its own, made in the body
                if v not in made or v in seen:
                    v = self.e("Identity", v)
                seen.add(v)
                results.append(v)

        def info(name: str):
            return helper.make_tensor_value_info(name, g.dtype, [None, None, None])

        graph = helper.make_graph(nodes, names(f"{g.w.prefix}scan_body"), [info(n) for n in s_in + x_in],
                                  [info(n) for n in results])
        d = int(backward)
        n = len(scanned)
        got = g.emit("Scan", *states, *scanned, outputs=len(results), body=graph, num_scan_inputs=n,
                     scan_input_axes=[1] * n, scan_input_directions=[d] * n,
                     scan_output_axes=[1] * len(outs), scan_output_directions=[d] * len(outs))
        got = [got] if isinstance(got, str) else got
        return got[:len(states)], got[len(states):]

    def backward_scan(self, inits: list[str], coefs: list[str], widths: list[int],
                      cell: Callable[[str, list[str], list[str], str | None], tuple[list[str], list[str]]]
                      ) -> tuple[list[str], list[str]]:
        """The backward recurrence, from the last walking step to the first. Its states are the gradients
        on the hidden state (first) and others after a step, ``inits`` after the last; ``coefs`` [D, T, B, F]
        (F: ``widths``) are scanned with them. ``cell(dh, states, coef_steps, valid)`` gives the states'
        gradients before the step and the step's outputs, from ``dh``, the gradient on the step's new
        hidden state (dY's step added, zeroed past a sample's length; ``valid`` is that [1, B, 1] mask or
        None). Where a sample's sequence has ended, the states' gradients pass the step unchanged."""
        dy = self.g.dy(0)
        masks = self.step_masks()
        xs = [*coefs, *([self.walk_y(dy)] if dy is not None else []), *(masks or ())]
        sizes: list[int | None] = [*widths, *([self.H] if dy is not None else [])]
        sizes += [None, None] if masks else []

        def body(states: list[str], steps: list[str]) -> tuple[list[str], list[str]]:
            k = len(coefs)
            dh = states[0] if dy is None else self.e("Add", states[0], steps[k])
            valid = keep = None
            if masks is not None:
                valid, keep = steps[-2], steps[-1]
                dh = self.mul(dh, valid)
            new, outs = cell(dh, states, steps[:k], valid)
            if keep is not None:
                new = [self.e("Add", n, self.mul(s, keep)) for n, s in zip(new, states)]
            return new, outs

        return self.scan(body, inits, xs, backward=True, widths=sizes)

    def final_grad(self, k: int) -> str | None:
        """As :meth:`Unroll.final_grad`, and zero when the sequence has no step (the kernel then gives zero
        final states, as it does a sequence of length 0 in sequence_lens)."""
        d = super().final_grad(k)
        if d is None or self.lens is not None:
            return d
        g = self.g
        return self.mul(d, self.e("Cast", self.e("Greater", self._steps(), g.ints([0])), to=g.dtype))

    def final3(self, k: int) -> str:
        """The gradient of final-state output ``k`` as [D, B, H] (zeros when it has none)."""
        d = self.final_grad(k)
        return self.zeros3() if d is None else self.e("Squeeze", d, self.g.ints([1]))


# ---- the recurrences of the three rules ---------------------------------------------------------------

def lstm_cell_states(u: LoopUnroll, f: str, ic: str, c0: str | None) -> str:
    """LSTM's cell states [D, T, B, H]: c_t = f_t·c_{t−1} + ic_t from c0 [D, 1, B, H] (None: zeros)."""

    def body(states: list[str], steps: list[str]) -> tuple[list[str], list[str]]:
        c = u.e("Add", u.mul(steps[0], states[0]), steps[1])
        return [c], [c]

    _, (c_all,) = u.scan(body, [u.state3(c0)], [f, ic], backward=False, widths=[u.H, u.H])
    return c_all


def lstm_peephole_states(u: LoopUnroll, p: str, a_i: str, a_o: str, a_f: str, cc: str, c0: str | None,
                         couple: bool) -> dict[str, str | None]:
    """LSTM with peepholes ``p`` [D, 3H]: the gates that read the cell state, computed along with it.
    Returns the cell states "c", the gates "i", "o", "f", their (clipped) inputs "a_i", "a_o", "a_f" and
    the clip masks "m_i", "m_o", "m_f" (None without clip), each [D, T, B, H]."""
    H = u.H
    fa = u.acts[0]
    p_i, p_o, p_f = u.split(u.e("Unsqueeze", p, u.g.ints([1])), [H, H, H], 2)  # [D, 1, H]
    clip = u.clip is not None

    def body(states: list[str], steps: list[str]) -> tuple[list[str], list[str]]:
        (c,), (xi, xo, xf, cct) = states, steps
        ai, mi = u.clipped(u.e("Add", xi, u.mul(p_i, c)))
        it = u.act(fa, ai)
        af, mf = u.clipped(u.e("Add", xf, u.mul(p_f, c)))
        ft = u.one_minus(it) if couple else u.act(fa, af)
        c_new = u.e("Add", u.mul(ft, c), u.mul(it, cct))
        ao, mo = u.clipped(u.e("Add", xo, u.mul(p_o, c_new)))
        ot = u.act(fa, ao)
        outs = [c_new, it, ot, ft, ai, ao, af]
        if clip:
            outs += [mi, mo, mf]  # type: ignore[list-item]
        return [c_new], outs

    _, outs = u.scan(body, [u.state3(c0)], [a_i, a_o, a_f, cc], backward=False, widths=[H] * 4)
    keys = ["c", "i", "o", "f", "a_i", "a_o", "a_f"] + (["m_i", "m_o", "m_f"] if clip else [])
    got: dict[str, str | None] = dict(zip(keys, outs))
    if not clip:
        got.update(m_i=None, m_o=None, m_f=None)
    return got


def lstm_backward(u: LoopUnroll, coef: str, k1: str, fc: str) -> tuple[str, str, str]:
    """LSTM's backward recurrence in (dh, dc): the gate gradients dG [D, T, B, 4H] (order i, o, f, c),
    and the gradients on the initial hidden and cell states [D, B, H]."""
    r = u.g.x(2)  # [D, 4H, H]

    def cell(dh: str, states: list[str], steps: list[str], valid: str | None) -> tuple[list[str], list[str]]:
        (_, dcs), (cf, k, f) = states, steps
        dc = u.e("Add", u.mul(dh, k), dcs if valid is None else u.mul(dcs, valid))
        dg = u.mul(u.e("Concat", dc, dh, dc, dc, axis=2), cf)
        return [u.e("MatMul", dg, r), u.mul(dc, f)], [dg]

    (dh0, dc0), (dgate,) = u.backward_scan([u.final3(1), u.final3(2)], [coef, k1, fc], [4 * u.H, u.H, u.H],
                                                 cell)
    return dgate, dh0, dc0


def gru_backward_lbr(u: LoopUnroll, coef: str, z: str) -> tuple[str, str, str]:
    """GRU (linear_before_reset=1) backward: the recurrent path's gradients dGh [D, T, B, 3H], the new
    states' gradients dh [D, T, B, H] and the initial state's [D, B, H]."""
    r = u.g.x(2)

    def cell(dh: str, states: list[str], steps: list[str], valid: str | None) -> tuple[list[str], list[str]]:
        cf, zt = steps
        dgh = u.mul(u.e("Concat", dh, dh, dh, axis=2), cf)
        return [u.e("Add", u.e("MatMul", dgh, r), u.mul(dh, zt))], [dgh, dh]

    (dh0,), (dgh, dh_all) = u.backward_scan([u.final3(1)], [coef, z], [3 * u.H, u.H], cell)
    return dgh, dh_all, dh0


def gru_backward(u: LoopUnroll, r_zr: str, r_h: str, c_z: str, c_h: str, c_r: str, rg: str,
                 z: str) -> tuple[str, str, str]:
    """GRU (linear_before_reset=0) backward: the new states' gradients dh and q = da_h̃·R_h (the gradient
    of r·h_prev), both [D, T, B, H], and the initial state's gradient [D, B, H]."""

    def cell(dh: str, states: list[str], steps: list[str], valid: str | None) -> tuple[list[str], list[str]]:
        cz, ch, cr, rt, zt = steps
        q = u.e("MatMul", u.mul(dh, ch), r_h)
        dzr = u.e("Concat", u.mul(dh, cz), u.mul(q, cr), axis=2)
        rec = u.e("Add", u.e("Add", u.mul(dh, zt), u.mul(q, rt)), u.e("MatMul", dzr, r_zr))
        return [rec], [dh, q]

    (dh0,), (dh_all, qs) = u.backward_scan([u.final3(1)], [c_z, c_h, c_r, rg, z], [u.H] * 5, cell)
    return dh_all, qs, dh0


def rnn_backward(u: LoopUnroll, dact: str) -> tuple[str, str]:
    """RNN backward: the pre-activation gradients [D, T, B, H] and the initial state's gradient [D, B, H]."""
    r = u.g.x(2)

    def cell(dh: str, states: list[str], steps: list[str], valid: str | None) -> tuple[list[str], list[str]]:
        da = u.mul(dh, steps[0])
        return [u.e("MatMul", da, r)], [da]

    (dh0,), (da,) = u.backward_scan([u.final3(1)], [dact], [u.H], cell)
    return da, dh0
