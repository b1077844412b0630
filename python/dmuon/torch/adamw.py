"""AdamW on one tensor, torch.optim.AdamW's rule (bias-corrected, decoupled decay): one fused pass in
the engine where libdmuon_c supports the tensor's device and dtype (float32 or bfloat16; the CPU, or
CUDA in a build with it) and the moments share the parameter's dtype, else the same rule in torch ops,
computed in the moments' dtype and rounded once to the parameter's (bf16 parameters with float32 moments)."""

import math

import torch

import dmuon

_DTYPES = {torch.float32: dmuon.DTYPE_F32, torch.bfloat16: dmuon.DTYPE_BF16}


def _engine(p):
    """(device code, dtype code, stream) when the engine runs AdamW for p, else None."""
    dtype = _DTYPES.get(p.dtype)
    device = {"cpu": dmuon.DEVICE_CPU, "cuda": dmuon.DEVICE_CUDA}.get(p.device.type)
    if dtype is None or device is None or not dmuon.supports(device, dtype):
        return None
    stream = torch.cuda.current_stream(p.device).cuda_stream if device == dmuon.DEVICE_CUDA else None
    return device, dtype, stream


def adamw_update(p, grad, exp_avg, exp_avg_sq, step, hyper, grad_scale):
    """p, grad: this rank's values and gradient (grad None: zeros); exp_avg, exp_avg_sq: its moments
    (local tensors shaped as p); step: this update's number (1 for the first); hyper: its param group."""
    grad = torch.zeros_like(p) if grad is None else grad
    lr, betas, eps, wd = float(hyper["lr"]), hyper["betas"], hyper["eps"], hyper["weight_decay"]  # lr may be a tensor
    m, v = exp_avg, exp_avg_sq
    engine = _engine(p)
    if (engine is not None and p.is_contiguous() and grad.is_contiguous() and grad.dtype == p.dtype
            and m.dtype == p.dtype and v.dtype == p.dtype):
        device, dtype, stream = engine
        dmuon.adamw_step(p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), step, lr,
                         betas, eps, wd, grad_scale, device=device, dtype=dtype, stream=stream)
        return
    grad = grad.to(m.dtype)
    if grad_scale != 1.0:
        grad = grad * grad_scale
    wide = torch.promote_types(p.dtype, m.dtype)
    w = p if wide == p.dtype else p.to(wide)
    if wd:
        w.mul_(1.0 - lr * wd)
    m.lerp_(grad, 1.0 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1.0 - betas[1])
    bias1 = 1.0 - betas[0] ** step
    bias2 = 1.0 - betas[1] ** step
    denom = v.sqrt().div_(math.sqrt(bias2)).add_(eps)
    w.addcdiv_(m, denom, value=-lr / bias1)
    if w is not p:
        p.copy_(w)
