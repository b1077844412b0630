"""Muon's update rule on one rank's rows of a matrix (DESIGN 1), as functions of tensors: the part
before Newton–Schulz and the part after it. Both modes call them through muon_step.py: the all-to-all
mode on each rank's rows (its U rows travel to the owner and its O rows back between the two), the
owner-centric mode on the owner's whole matrices (nothing travels)."""

import torch


def muon_momentum(buf, grad, beta, nesterov, grad_scale=1.0):
    """M ← β·M + (1−β)·g (in place in buf); returns U = nesterov ? (1−β)·g + β·M : M. buf: the momentum
    (its dtype is the arithmetic's); grad: the gradient, None for zeros; grad_scale: the clipping factor."""
    g = torch.zeros_like(buf) if grad is None else grad.to(buf.dtype)
    if grad_scale != 1.0:
        g = g * grad_scale
    buf.lerp_(g, 1.0 - beta)
    return torch.lerp(g, buf, beta) if nesterov else buf


def muon_apply(values, update, lr, weight_decay, scale):
    """W ← W·(1 − lr·wd) − lr·s·O in place in values, computed in the wider of the two dtypes and rounded
    once to the parameter's."""
    wide = torch.promote_types(values.dtype, update.dtype)
    w = values if wide == values.dtype else values.to(wide)
    if weight_decay:
        w.mul_(1.0 - lr * weight_decay)
    w.add_(update, alpha=-lr * scale)
    if w is not values:
        values.copy_(w)
