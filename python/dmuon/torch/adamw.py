"""The AdamW half of one DMuon step: torch.optim.AdamW's fused step (torch.optim.adamw.adamw with
fused=True: bias-corrected, decoupled decay; one kernel per device and dtype for all of a param group's
tensors), given the step's clipping factor and skip flag as device tensors, so nothing waits for the
device. A parameter whose dtype differs from its moments' (bf16 parameters, float32 state) is stepped
on a copy in the moments' dtype and rounded once back to its own.

torch's fused step divides the gradients by grad_scale and stores them so (GradScaler's convention):
with clipping, the AdamW parameters' .grad are left clipped, as torch.nn.utils.clip_grad_norm_
leaves them."""

import torch
from torch.optim.adamw import adamw


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, hyper, grad_scale, skip):
    """One AdamW step of a param group's local tensors: params, grads, exp_avgs, exp_avg_sqs (lists, the
    moments in the state dtype), steps (their "step" counters, float32 tensors on each parameter's
    device, counted up here unless skipped); hyper: the param group; grad_scale: the clipping factor
    (a 0-dim tensor) or None; skip: a 0-dim bool tensor, true: nothing changes."""
    rounded = []  # (parameter, its copy in the moments' dtype)
    work_params, work_grads = [], []
    for p, g, m in zip(params, grads, exp_avgs):
        if p.dtype != m.dtype:
            rounded.append((p, p.to(m.dtype)))
            p = rounded[-1][1]
        work_params.append(p)
        work_grads.append(g if g.dtype == m.dtype else g.to(m.dtype))
    device = work_params[0].device
    inverse_scale = None if grad_scale is None else (1.0 / grad_scale).to(device, torch.float32)
    b1, b2 = hyper["betas"]
    adamw(work_params, work_grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, grad_scale=inverse_scale,
          found_inf=skip.to(device, torch.float32), amsgrad=False, beta1=b1, beta2=b2, lr=hyper["lr"],
          weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False)
    for p, copy in rounded:
        p.copy_(copy)
