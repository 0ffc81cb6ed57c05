"""GDPA's activations and their FMA-only approximations (gem/ops/gdpa.py explains them): constants that the
dispatcher (gem.ops.gdpa) and the kernels (gem.ops.triton_gdpa) both read, here so neither imports the other's
module for them."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "relu2", "leaky_relu", "identity")
LEAKY_SLOPE = 0.01


@dataclass(frozen=True)
class Poly6:
    """relu(x) - p(min(|x|, clamp)), p(t) = sum_{k=1..6} coef[k-1] t^k."""

    coef: tuple[float, float, float, float, float, float]
    clamp: float
    max_abs_err: float  # |approx(x) - act(x)| over all x
    max_abs_grad_err: float  # |approx'(x) - act'(x)| over all x


POLY6 = {
    "gelu": Poly6(
        (0.5, -0.4121347377, 0.02008931786, 0.07410799769, -0.02559526894, 0.002590125262),
        3.5,
        max_abs_err=2.0e-3,  # measured 1.73e-3
        max_abs_grad_err=2.5e-2,  # measured 2.35e-2
    ),
    "gelu_tanh": Poly6(
        (0.5, -0.4123756303, 0.02131887525, 0.0729591225, -0.02521933963, 0.00254931405),
        3.5,
        max_abs_err=2.0e-3,  # measured 1.52e-3
        max_abs_grad_err=2.5e-2,  # measured 2.30e-2
    ),
    "silu": Poly6(
        (0.5, -0.2981138086, 0.06659739995, -0.006434139081, 0.0002064444144, 2.161329522e-06),
        8.75,
        max_abs_err=1.0e-2,  # measured 8.69e-3
        max_abs_grad_err=6.0e-2,  # measured 5.52e-2
    ),
}
APPROX = {"poly6": tuple(POLY6)}
