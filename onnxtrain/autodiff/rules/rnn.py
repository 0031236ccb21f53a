"""Gradient rules of LSTM, GRU and RNN (same names as engine/kernels/rnn.py).

No single op computes these gradients, so each rule lowers the node to its per-step equations and
emits backprop through time, unrolled over the static sequence length (when X's sequence axis is known
only at run time, the two sequential recurrences below are ``Scan`` nodes instead: rnn_loop.py):

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
passes the state's own gradient through; a sequence of length 0 has zero final states, so their
gradients stop there).
"""

from __future__ import annotations

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient
from onnxtrain.autodiff.rules import rnn_loop
from onnxtrain.autodiff.rules.rnn_loop import LoopUnroll, unroll
from onnxtrain.autodiff.rules.rnn_unroll import Unroll

# ------------------------------------------------------------------------------------------- LSTM


@gradient("LSTM", uses=("x*", "y0", "y1"), stop=(4,))
def lstm_grad(g: GradCtx) -> None:
    # gates (order i, o, f, c): a = x·Wᵀ + h_prev·Rᵀ + Wb + Rb;  i, o, f = σ(a_i + P_i c_prev, a_o + P_o c,
    # a_f + P_f c_prev), c̃ = tanh(a_c);  c = f·c_prev + i·c̃;  h = o·tanh(c)
    u = unroll(g)
    H = u.H
    fa, ga, ha = u.acts  # the gates', the cell input's and the cell output's activations (σ, tanh, tanh)
    couple = bool(g.attr("input_forget"))  # f = 1 − i: the forget gate's own input is not used
    xw = u.walk_x()
    hw = u.walk_y(g.y(0))
    h0, c0 = u.input_state(5), u.input_state(6)
    hprev = u.shift(hw, h0)
    xh = u.joint_input(xw, hprev)
    if xh is not None:  # one product with [W, R] (and one for dW, dR below)
        a = u.joint_gates(xh)
    else:
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
        if isinstance(u, LoopUnroll):
            c_all = rnn_loop.lstm_cell_states(u, f_g, u.mul(i_g, cc), c0)
        else:
            f_s, ic_s = u.steps(f_g), u.steps(u.mul(i_g, cc))
            cs: list[str] = []
            c = c0
            for t in range(u.T):  # type: ignore[arg-type]
                c = ic_s[t] if c is None else u.e("Add", u.mul(f_s[t], c), ic_s[t])
                cs.append(c)
    elif isinstance(u, LoopUnroll):
        a_i, a_o, a_f, a_c = u.split(a, [H, H, H, H], 3)
        a_c, m_c = u.clipped(a_c)
        cc = u.act(ga, a_c)
        st = rnn_loop.lstm_peephole_states(u, g.x(7), a_i, a_o, a_f, cc, c0, couple)
        c_all, i_g, o_g, f_g = st["c"], st["i"], st["o"], st["f"]  # type: ignore[assignment]
        a_i, a_o, a_f, m_i, m_o, m_f = st["a_i"], st["a_o"], st["a_f"], st["m_i"], st["m_o"], st["m_f"]
        p_i, p_o, p_f = u.split(u.b4(g.x(7)), [H, H, H], 3)
    else:
        p_i, p_o, p_f = u.split(u.b4(g.x(7)), [H, H, H], 3)
        a_i, a_o, a_f, a_c = u.split(a, [H, H, H, H], 3)
        a_c, m_c = u.clipped(a_c)
        cc = u.act(ga, a_c)
        ai_s, ao_s, af_s, cc_s = u.steps(a_i), u.steps(a_o), u.steps(a_f), u.steps(cc)
        cs, is_, os_, fs = [], [], [], []
        cut: dict[str, list[tuple[str, str | None]]] = {"i": [], "o": [], "f": []}  # (input, mask) per step
        c = c0
        for t in range(u.T):  # type: ignore[arg-type]
            cut["i"].append(u.clipped(ai_s[t] if c is None else u.e("Add", ai_s[t], u.mul(p_i, c))))
            cut["f"].append(u.clipped(af_s[t] if c is None else u.e("Add", af_s[t], u.mul(p_f, c))))
            it = u.act(fa, cut["i"][t][0])
            ft = u.one_minus(it) if couple else u.act(fa, cut["f"][t][0])
            ic = u.mul(it, cc_s[t])
            c = ic if c is None else u.e("Add", u.mul(ft, c), ic)
            cut["o"].append(u.clipped(u.e("Add", ao_s[t], u.mul(p_o, c))))
            os_.append(u.act(fa, cut["o"][t][0]))
            cs.append(c)
            is_.append(it)
            fs.append(ft)
        i_g, o_g, f_g = u.cat(is_, 1), u.cat(os_, 1), u.cat(fs, 1)
        # the gates' (clipped) inputs and clip masks over all steps
        (a_i, m_i), (a_o, m_o), (a_f, m_f) = (
            (u.cat([v for v, _ in cut[k]], 1), None if u.clip is None else u.cat([m for _, m in cut[k]], 1))
            for k in "iof"
        )
    if not isinstance(u, LoopUnroll):
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
    need_dh0 = g.has_x(5) and g.needs_dx(5)
    if isinstance(u, LoopUnroll):
        dgate, dh0, dc0 = rnn_loop.lstm_backward(u, u.e("Concat", c_i, b_o, c_f, c_c, axis=3), k1, fc)
        u.finish(dgate, dgate, xw, hprev, None, xh=xh)
        u.set_state_grads(dh0, dc0)
        _lstm_peephole_grad(u, dgate, cprev, c_all)
        return
    coef_s = u.steps(u.e("Concat", c_i, b_o, c_f, c_c, axis=3))
    k1_s, fc_s = u.steps(k1), u.steps(fc)
    r4 = u.w4(g.x(2))
    dhw = u.dy_steps()
    dgs: list[str] = [""] * u.T
    rec: str | None = None
    dc: str | None = None
    ds: str | None = None  # gradient on the hidden state after the step
    dcs: str | None = None  # and on the cell state
    for t in range(u.T - 1, -1, -1):  # type: ignore[operator]
        ds = u.state_grad(t, rec, ds)
        dh = u.new_state_grad(t, dhw[t], ds)
        dcs = u.final_grad(2) if t == u.T - 1 else u.add(u.mul(dc, fc_s[t + 1]), u.frozen(dcs, t + 1))  # type: ignore[arg-type]
        dc = u.add(u.mul(dh, k1_s[t]), u.valid(dcs, t))
        dgs[t] = u.mul(u.e("Concat", dc, dh, dc, dc, axis=3), coef_s[t])
        if t > 0 or need_dh0:
            rec = u.e("MatMul", dgs[t], r4)  # dh_prev = dG·R
    dgate = u.cat(dgs, 1)
    u.finish(dgate, dgate, xw, hprev, u.add(rec, u.frozen(ds, 0)) if need_dh0 else None, xh=xh)
    if g.has_x(6) and g.needs_dx(6):
        g.set_dx(6, u.state_out(u.add(u.mul(dc, fc_s[0]), u.frozen(dcs, 0))))  # type: ignore[arg-type]
    _lstm_peephole_grad(u, dgate, cprev, c_all)


def _lstm_peephole_grad(u: Unroll, dgate: str, cprev: str, c_all: str) -> None:
    """dP: each peephole weight times the cell state its gate reads, summed over steps and batch."""
    g, H = u.g, u.H
    if g.has_x(7) and g.needs_dx(7):
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
    u = unroll(g)
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
    loop = isinstance(u, LoopUnroll)
    if not loop:
        z_s = u.steps(z)
        dhw = u.dy_steps()
    need_dh0 = g.has_x(5) and g.needs_dx(5)
    rec: str | None = None
    dhs: list[str] = [""] * (u.T or 0)
    if lbr:
        # a_r gets dh·c_h·nh·σ'(r); the recurrent h-path (h_prev·R_hᵀ + Rb_h) gets dh·c_h·r
        coef = u.e("Concat", c_z, u.mul(c_h, u.mul(nh, dsig_r)), u.mul(c_h, rg), axis=3)
        if isinstance(u, LoopUnroll):
            dgh, dh_all, dh0 = rnn_loop.gru_backward_lbr(u, coef, z)
            dzr, _ = u.split(dgh, [2 * H, H], 3)
            u.finish(u.e("Concat", dzr, u.mul(dh_all, c_h), axis=3), dgh, xw, hprev, None)
            u.set_state_grads(dh0)
            return
        coef_s = u.steps(coef)
        r4 = u.w4(g.x(2))
        dghs: list[str] = [""] * u.T  # type: ignore[operator]
        ds: str | None = None
        for t in range(u.T - 1, -1, -1):  # type: ignore[operator]
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
    qs: list[str] = [""] * (u.T or 0)
    ds_: str | None = None
    if isinstance(u, LoopUnroll):
        dh_all, q_all, dh0 = rnn_loop.gru_backward(u, r_zr, r_h, c_z, c_h, c_r, rg, z)
    else:
        cz_s, ch_s, cr_s, rg_s = u.steps(c_z), u.steps(c_h), u.steps(c_r), u.steps(rg)
        r4_h, r4_zr = u.w4(r_h), u.w4(r_zr)
        for t in range(u.T - 1, -1, -1):  # type: ignore[operator]
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
    dzr = u.e("Concat", u.mul(dh_all, c_z), u.mul(q_all if loop else u.cat(qs, 1), c_r), axis=3)
    dah = u.mul(dh_all, c_h)
    dgx = u.e("Concat", dzr, dah, axis=3)
    dr = None
    if g.needs_dx(2):
        # R_zr sees h_prev, R_h sees r·h_prev
        dr = u.e(
            "Concat",
            g.in_float32("Einsum", dzr, hprev, equation="dtbg,dtbh->dgh"),
            g.in_float32("Einsum", dah, rh, equation="dtbg,dtbh->dgh"),
            axis=1,
        )
    u.finish(dgx, dgx, xw, hprev, u.add(rec, u.frozen(ds_, 0)) if need_dh0 and not loop else None, dr=dr)
    if isinstance(u, LoopUnroll):
        u.set_state_grads(dh0)


# -------------------------------------------------------------------------------------------- RNN


@gradient("RNN", uses=("x*", "y0", "y1"), stop=(4,))
def rnn_grad(g: GradCtx) -> None:
    # h = tanh(x·Wᵀ + h_prev·Rᵀ + Wb + Rb):  da = dh·(1 − h²),  dh_prev = da·R
    # any activation f: h = f(a), da = dh·f'(a) (and 0 where clip cut a)
    u = unroll(g)
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
    if isinstance(u, LoopUnroll):
        da, dh0 = rnn_loop.rnn_backward(u, dact)
        u.finish(da, da, xw, hprev, None)
        u.set_state_grads(dh0)
        return
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
