"""The float32 Erf kernel: its exhaustive accuracy check, and the single rational it was compared with.

    python tools/fit_erf32.py check [--stride N]      # every float32 bit pattern (or every N-th one)
    python tools/fit_erf32.py rational [--p 5 --q 5]  # fit erf(x)/x ~ P(x^2)/Q(x^2), then run it in float32

check: onnxtrain's float32 erf against its float64 erf (2-3 float64 ulp, far below a float32 ulp) on all
2^32 bit patterns, in chunks. The error of a result is counted in ulps of the reference rounded to float32.
Also checked: NaN in, NaN out; an exact zero reference gives a zero of the input's sign; no overflow,
invalid or divide-by-zero floating-point error (signaling NaN inputs aside). About 3 minutes, one core.

rational: the gather-free form erf(x) = x * P(x^2) / Q(x^2) with x clipped to [-X, X]. P and Q are fitted
in float64 for the relative error, by least squares in a Chebyshev basis of s = x^2, linearised with the
previous Q and reweighted after each pass by the current error (Lawson's rule), which drives the fit to
near-minimax; the coefficients are rounded to float32 and the formula is evaluated in float32 (Horner)
over a dense grid. Its approximation error is tiny, but for x past ~1.5 (erf near 1) every rounding in the
two Horner chains counts in full, and the result lands about 7 ulp off: why the kernel uses a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from onnxtrain.engine.kernels.elementwise import erf  # noqa: E402


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - want) / ulp


def check(stride: int, chunk: int = 1 << 24) -> int:
    worst, where, problems = 0.0, None, 0
    t0 = time.time()
    for start in range(0, 1 << 32, chunk * stride):
        stop = min(start + chunk * stride, 1 << 32)
        bits = np.arange(start, stop, stride, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        mag = bits & 0x7FFFFFFF
        signaling = (mag > 0x7F800000) & (mag < 0x7FC00000)
        if signaling.any():  # NaNs that numpy's arithmetic flags as invalid: only the value is checked
            with np.errstate(all="ignore"):
                problems += int(not np.isnan(erf(x[signaling])).all())
            x = x[~signaling]
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            got = erf(x)
        nan = np.isnan(x)
        problems += int(not np.isnan(got[nan]).all())
        x, got = x[~nan], got[~nan]
        want = erf(x.astype(np.float64))
        zero = want == 0
        signed = np.array_equal(np.signbit(got[zero]), np.signbit(x[zero]))
        problems += int(not (np.all(got[zero] == 0) and signed))
        err = _ulps(got[~zero], want[~zero])
        k = int(np.argmax(err))
        if err[k] > worst:
            worst, where = float(err[k]), x[~zero][k]
    print(f"max error {worst:.4f} ulp at x = {where!r}; {problems} chunk(s) with NaN/zero problems; "
          f"{time.time() - t0:.0f} s")
    return problems


def _lawson_rational(s: np.ndarray, f: np.ndarray, m: int, n: int, span: float, passes: int = 300):
    """Near-minimax P/Q (degrees m, n in s) for the relative error of f; monomial coefficients, Q[0] = 1."""
    u = 2 * s / span - 1
    basis = np.polynomial.chebyshev.chebvander(u, max(m, n))
    w, q_prev, best = np.full(s.size, 1 / s.size), np.ones_like(s), None
    for _ in range(passes):
        lhs = np.hstack([basis[:, :m + 1], -f[:, None] * basis[:, 1:n + 1]])
        scale = np.sqrt(w) / (f * q_prev)
        sol = np.linalg.lstsq(lhs * scale[:, None], f * scale, rcond=None)[0]
        p, q = sol[:m + 1], np.concatenate([[1.0], sol[m + 1:]])
        q_prev = np.polynomial.chebyshev.chebval(u, q)
        err = np.polynomial.chebyshev.chebval(u, p) / q_prev / f - 1
        if best is None or np.abs(err).max() < best[0]:
            best = (np.abs(err).max(), p, q)
        w = w * np.abs(err)
        w /= w.sum()
    to_s = [np.polynomial.Chebyshev(c, domain=[0, span]).convert(kind=np.polynomial.Polynomial).coef
            for c in best[1:]]
    return best[0], to_s[0] / to_s[1][0], to_s[1] / to_s[1][0]


def rational(m: int, n: int, cap: float) -> None:
    span = cap * cap
    s = (np.cos(np.pi * (np.arange(8000) + 0.5) / 8000)[::-1] + 1) * span / 2
    c = np.sqrt(s)
    f = np.where(c > 1e-4, erf(c) / np.maximum(c, 1e-4), 2 / np.sqrt(np.pi) * (1 - s / 3))
    fit_err, p, q = _lawson_rational(s, f, m, n, span)
    p32, q32 = p.astype(np.float32), q.astype(np.float32)
    x = np.arange(np.float32(0.25).view(np.uint32), np.float32(4.25).view(np.uint32), 3,
                  dtype=np.uint32).view(np.float32)
    xc = np.minimum(x, np.float32(cap))
    s32 = xc * xc
    num, den = np.full_like(s32, p32[-1]), np.full_like(s32, q32[-1])
    for k in p32[-2::-1]:
        num = num * s32 + k
    for k in q32[-2::-1]:
        den = den * s32 + k
    got = xc * num / den
    err = _ulps(got, erf(x.astype(np.float64)))
    worst = x[np.argmax(err)]
    print(f"P degree {m}, Q degree {n}, |x| <= {cap}: fitted relative error {fit_err:.2e}; in float32 "
          f"max {err.max():.2f} ulp (at x = {worst!r}), {np.mean(err > 2):.2%} of points over 2 ulp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--stride", type=int, default=1, help="test every N-th bit pattern")
    r = sub.add_parser("rational")
    r.add_argument("--p", type=int, default=5)
    r.add_argument("--q", type=int, default=5)
    r.add_argument("--cap", type=float, default=3.92)
    args = ap.parse_args()
    if args.cmd == "check":
        sys.exit(1 if check(args.stride) else 0)
    rational(args.p, args.q, args.cap)


if __name__ == "__main__":
    main()
