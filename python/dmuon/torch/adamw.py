"""The AdamW half of one DMuon step: torch.optim.AdamW's fused step (torch.optim.adamw.adamw with
fused=True: bias-corrected, decoupled decay; one kernel per device and dtype for all of a param group's
tensors), given the step's clipping factor and skip flag as device tensors, so nothing waits for the
device. The kernel steps the wider of a parameter's and its moments' dtypes (plan.work_dtype): a parameter or
moments of the narrower (bf16 parameters with float32 state; bf16 state of float32 parameters), or that are not
contiguous (a strided view), are stepped on dense copies in that dtype and copied (rounded once, to nearest even)
back to their own; such a gradient is read through one too (dense.py). bf16 parameters with bf16 state take the
kernel as torch.optim.AdamW's (it computes in float32 inside and rounds each store).

torch's fused step divides the gradients by grad_scale and stores them so (GradScaler's convention):
with clipping, the AdamW parameters' .grad are left clipped, as torch.nn.utils.clip_grad_norm_
leaves them."""

import torch
from torch.optim.adamw import adamw

from dmuon.torch.dense import DenseOperands, may_overlap


def adamw_phase(groups, layouts, state, grads, taking_part, check):
    """The AdamW parameters' step, of DMuon's parameters (groups, layouts: their param groups and layout.Layouts
    in its order; state: its optimizer state; grads: their local gradients, None where this rank has none;
    taking_part: whether each requires grad; check: the step's GradientCheck): per param group, one fused call for
    those with a gradient here (skipped when any gradient is non-finite) and one per parameter without one here
    (zeros, skipped unless another rank has its gradient)."""
    with_grad, without = {}, []  # with_grad: id(param group) → indices
    for i, group in enumerate(groups):
        if group["use_muon"] or not taking_part[i]:
            continue
        if grads[i] is None:
            without.append(i)
        else:
            with_grad.setdefault(id(group), []).append(i)

    def call(indices, grads, skip):  # one fused call for parameters `indices` of one param group
        mine = [layouts[i] for i in indices]
        states = [state[l.tensor] for l in mine]
        adamw_step([l.local(l.tensor) for l in mine], grads, [l.local(st["exp_avg"]) for l, st in zip(mine, states)],
                   [l.local(st["exp_avg_sq"]) for l, st in zip(mine, states)], [st["step"] for st in states],
                   groups[indices[0]], check.grad_scale, skip)
    for indices in with_grad.values():
        call(indices, [grads[i] for i in indices], ~check.finite)
    for i in without:
        call([i], [torch.zeros_like(layouts[i].local(layouts[i].tensor))], ~check.keep[i])


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, hyper, grad_scale, skip):
    """One AdamW step of a param group's local tensors: params, grads, exp_avgs, exp_avg_sqs (lists, the
    moments in the state dtype), steps (their "step" counters, float32 tensors on each parameter's
    device, counted up here unless skipped); hyper: the param group; grad_scale: the clipping factor
    (a 0-dim tensor) or None; skip: a 0-dim bool tensor, true: nothing changes."""
    dense = DenseOperands()  # the kernel takes dense tensors of one dtype: the wider of parameter's and moments'
    work = [torch.promote_types(p.dtype, m.dtype) for p, m in zip(params, exp_avgs)]
    work_params = [dense.write(p, d) for p, d in zip(params, work)]
    exp_avgs = [dense.write(m, d) for m, d in zip(exp_avgs, work)]
    exp_avg_sqs = [dense.write(v, d) for v, d in zip(exp_avg_sqs, work)]
    # written: the kernel leaves them unscaled (clipped), in their place as torch's; a gradient of another
    # dtype or whose elements share memory (expanded) is read through a copy, left as it was
    work_grads = [dense.write(g) if g.dtype == d and not may_overlap(g) else dense.read(g, d)
                  for g, d in zip(grads, work)]
    device = work_params[0].device
    inverse_scale = None if grad_scale is None else (1.0 / grad_scale).to(device, torch.float32)
    b1, b2 = hyper["betas"]
    adamw(work_params, work_grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, grad_scale=inverse_scale,
          found_inf=skip.to(device, torch.float32), amsgrad=False, beta1=b1, beta2=b2, lr=hyper["lr"],
          weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False)
    dense.write_back()
