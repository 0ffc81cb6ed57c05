"""gem.bench.kernels.disagreement: tools/jfa_vs_varlen.py reports no speed for a result that differs from varlen_attn's."""

import torch

from gem.bench.kernels import disagreement


def _four(seed, shape=(33, 4, 8)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).bfloat16() for _ in range(4)]


def test_bf16_rounding_agrees_and_empty_tensors_pass():
    want = _four(0)
    got = [(t.float() * (1 + 2 ** -8)).bfloat16() for t in want]  # one bf16 ulp off everywhere
    assert disagreement(got, want) == ""
    empty = [torch.empty(0, 4, 8)] * 4
    assert disagreement(empty, empty) == ""


def test_non_finite_and_wrong_values_are_named():
    want = _four(1)
    got = [t.clone() for t in want]
    got[1][5, 2, 3] = float("nan")
    got[3] = got[3] * 1.5
    msg = disagreement(got, want)
    assert "dq non-finite" in msg and "dv max error" in msg and "out" not in msg and "dk" not in msg
