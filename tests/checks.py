"""Comparison helpers shared by the tests."""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (absolute error when expected is zero)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff


def assert_rel(actual, expected, tol=1e-5, what="tensor"):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"
    return err
