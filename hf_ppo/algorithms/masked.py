"""Masked statistics: sums, means, variances and whitening over the real tokens of a (batch, response_len) tensor.

Conventions: `mask` is a bool tensor, True = a real response token. These also take a 0/1 float or integer mask
(TRL's convention) and give the same result. Values at masked positions never change a result.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """`mask` as bool: a bool mask as it is; a 0/1 float or integer mask (TRL's convention) converted.

    Any other value is an error rather than a weight: these are selections, and treating 0.5 as "selected" (or as
    half a token) would silently change every statistic. Only non-bool masks pay for the check.
    """
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("A mask must hold only 0 and 1 (or True/False); to weight entries, multiply the values "
                         "by the weights and pass a 0/1 mask.")
    return mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask); masked entries (even NaN/inf) contribute exactly 0. `mask`: bool or 0/1."""
    mask = as_bool_mask(mask)
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    masked = torch.where(mask, values, zeros)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the True entries of `mask` (over `dim`, or all entries). 0 where nothing is selected."""
    mask = as_bool_mask(mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the True entries of `mask`, with Bessel's correction when `unbiased` (n / (n - 1))."""
    mask = as_bool_mask(mask)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries; with `shift_mean=False` the mean is added back (scale only).

    Masked positions are returned as 0. Used for advantages (shift) and, optionally, rewards (no shift: N+ paper).
    """
    mask = as_bool_mask(mask)
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))
