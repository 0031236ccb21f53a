"""Op table rows for the matrix-product kernels (onnxtrain/engine/kernels/matmul.py)."""

from __future__ import annotations

from tests.op_cases import OpCase

CASES = [
    OpCase("MatMul", [(3, 4), (4, 5)], opset=13),
    OpCase("MatMul", [(2, 3, 4), (4, 5)], opset=13, variant="batch_rhs2d"),
    OpCase("MatMul", [(2, 1, 3, 4), (3, 4, 2)], opset=13, variant="batch_bcast"),
    OpCase("MatMul", [(4,), (2, 4, 3)], opset=13, variant="vec_lhs"),
    OpCase("MatMul", [(2, 3, 4), (4,)], opset=13, variant="vec_rhs"),
    OpCase("MatMul", [(5,), (5,)], opset=13, variant="dot"),
    OpCase("Gemm", [(3, 4), (4, 5), (5,)], opset=13),
    OpCase("Gemm", [(3, 4), (4, 5)], opset=13, variant="no_c"),
    OpCase("Gemm", [(4, 3), (5, 4), (3, 5)], attrs={"transA": 1, "transB": 1}, opset=13, variant="trans"),
    OpCase("Gemm", [(3, 4), (5, 4), (3, 1)], attrs={"transB": 1, "alpha": 0.5, "beta": 2.0}, opset=13,
           variant="alpha_beta_col"),
    OpCase("Gemm", [(3, 4), (4, 5), (1,)], attrs={"alpha": -1.5}, opset=13, variant="scalar_c"),
    OpCase("Gemm", [(3, 4), (4, 5), (3, 5)], attrs={"beta": 0.0}, opset=11, variant="beta0"),
    OpCase("Einsum", [(3, 4), (4, 5)], attrs={"equation": "ij,jk->ik"}, opset=13),
    OpCase("Einsum", [(2, 3, 4), (2, 4, 5)], attrs={"equation": "bij, bjk -> bik"}, opset=13,
           variant="batch_spaces"),
    OpCase("Einsum", [(4, 4)], attrs={"equation": "ii->i"}, opset=13, variant="diag"),
    OpCase("Einsum", [(3, 4)], attrs={"equation": "ij->"}, opset=13, variant="sum_all"),
    OpCase("Einsum", [(5,), (5,)], attrs={"equation": "i,i"}, opset=13, variant="implicit_dot"),
    OpCase("Einsum", [(2, 3, 4), (4, 2)], attrs={"equation": "...ij,jk->...ik"}, opset=13,
           variant="ellipsis"),
    OpCase("Einsum", [(2, 3), (3, 4), (4, 2)], attrs={"equation": "ij,jk,kl->il"}, opset=13,
           variant="chain3"),
    OpCase("Einsum", [(2, 3, 4)], attrs={"equation": "abc->cab"}, opset=13, variant="transpose"),
]

# gradient rows (autodiff/rules/matmul.py): transposes, alpha/beta and every C broadcast, batch broadcasting,
# Einsum with summed-away letters, broadcast '...' axes and traces
CASES += [
    OpCase("MatMul", [(2, 3, 4), (2, 4, 5)], variant="grad_batch_same"),
    OpCase("MatMul", [(3, 4), (2, 2, 4, 5)], variant="grad_lhs2d_bcast"),
    OpCase("MatMul", [(3, 1, 2, 4), (1, 2, 4, 3)], variant="grad_both_bcast"),
    OpCase("MatMul", [(4,), (4, 3)], variant="grad_vec_mat"),
    OpCase("MatMul", [(3, 4), (4,)], variant="grad_mat_vec"),
    OpCase("MatMul", [(3, 1), (1, 4)], variant="grad_outer"),
    OpCase("MatMul", [(2, 3, 2, 4), (4, 5)], variant="grad_rank4_rhs2d"),  # dB as one Gemm over the batch
    OpCase("Gemm", [(4, 3), (4, 5), (1, 5)], attrs={"transA": 1}, variant="grad_transA_row_c"),
    OpCase("Gemm", [(3, 4), (5, 4), (5,)], attrs={"transB": 1, "alpha": 2.0}, variant="grad_transB_vec_c"),
    OpCase("Gemm", [(4, 3), (5, 4), ()], attrs={"transA": 1, "transB": 1, "alpha": 0.7, "beta": -0.5},
           variant="grad_trans_scalar0d_c"),
    OpCase("Gemm", [(4, 3), (4, 5), (3, 5)], attrs={"transA": 1, "alpha": 1.5, "beta": 0.25},
           variant="grad_transA_full_c"),
    OpCase("Gemm", [(3, 4), (5, 4), (1, 1)], attrs={"transB": 1, "beta": 3.0}, variant="grad_transB_11_c"),
    OpCase("Einsum", [(3, 4), (4,)], attrs={"equation": "ij,j->i"}, variant="grad_matvec"),
    OpCase("Einsum", [(2, 3, 4), (2, 5, 4)], attrs={"equation": "bik,bjk->bij"}, variant="grad_bmm_nt"),
    OpCase("Einsum", [(3, 4), (5,)], attrs={"equation": "ij,k->ik"}, variant="grad_summed_letter"),
    OpCase("Einsum", [(2, 1, 3, 4), (1, 5, 4, 2)], attrs={"equation": "...ij,...jk->...ik"},
           variant="grad_ellipsis_bcast"),
    OpCase("Einsum", [(3, 3)], attrs={"equation": "ii"}, variant="grad_trace"),
    OpCase("Einsum", [(3, 3, 2)], attrs={"equation": "iij->ji"}, variant="grad_diag_batch"),
]

# Det: batched; its gradient is dY·cof(X), the cofactors as determinants of the minors
CASES += [
    OpCase("Det", [(3, 3)], opset=11),
    OpCase("Det", [(2, 3, 4, 4)], opset=11, variant="batch_4x4"),
    OpCase("Det", [(2, 2)], variant="grad_2x2"),
    OpCase("Det", [(3, 1, 1)], variant="grad_1x1"),
    OpCase("Det", [(2, 5, 5)], variant="grad_batch_5x5"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    OpCase("MatMul", [(2, 3, 4, 5), (2, 3, 5, 4)], opset=11, variant="grad_ort_rank4_same_v11"),
    OpCase("Gemm", [(1, 4), (4, 3), (3,)], opset=11, variant="grad_ort_one_row_v11"),
    OpCase("Gemm", [(2, 4), (4, 3), (2, 3)], attrs={"alpha": 0.7, "beta": 5.0},
           variant="grad_ort_alpha_beta_full_c"),
]
