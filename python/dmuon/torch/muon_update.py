"""Muon's update rule on one rank's rows of a matrix (DESIGN 1), as functions of tensors: the part
before Newton–Schulz and the part after it. Both modes call them through muon_step.py: the all-to-all
mode on each rank's rows (its U rows travel to the owner and its O rows back between the two), the
owner-centric mode on the owner's whole matrices (nothing travels).

Whether the step updates the matrix at all (`keep`: it has a gradient on some rank, and every gradient
of the step is finite) is a 0-dim bool tensor on the device, not a host branch (gradient_check.py):
with keep false both functions leave their tensors as they were, bit for bit."""

import torch


def muon_momentum(buf, grad, beta, nesterov, keep, grad_scale=None):
    """M ← β·M + (1−β)·g (in place in buf); returns U = nesterov ? (1−β)·g + β·M : M. buf: the momentum
    (its dtype is the arithmetic's); grad: the gradient, None for zeros; keep: false takes g as M, so
    M stays as it was and a non-finite g leaves no trace; grad_scale: the clipping factor (a 0-dim
    tensor) or None."""
    g = torch.zeros_like(buf) if grad is None else grad.to(buf.dtype)
    if grad_scale is not None:
        g = g * grad_scale
    g = torch.where(keep, g, buf)
    buf.lerp_(g, 1.0 - beta)
    return torch.lerp(g, buf, beta) if nesterov else buf


def muon_apply(values, update, lr, weight_decay, scale, keep):
    """W ← W·(1 − lr·wd) − lr·s·O in place in values where keep, computed in the wider of the two dtypes
    (float32 at least) and rounded once to the parameter's. lr: a float or a 1-element tensor."""
    wide = torch.promote_types(torch.promote_types(values.dtype, update.dtype), torch.float32)
    w = values if wide == values.dtype else values.to(wide)
    if weight_decay:
        w.mul_(torch.where(keep, 1.0 - lr * weight_decay, 1.0))
    w.addcmul_(update, torch.where(keep, -lr * scale, 0.0))
    if w is not values:
        values.copy_(w)
