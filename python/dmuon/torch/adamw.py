"""AdamW on one tensor, torch.optim.AdamW's rule (bias-corrected, decoupled decay): one fused pass in
the engine where libdmuon_c supports the tensor's device and dtype (float32 on the CPU in this build),
else the same rule in torch ops (seven passes; bf16 on the CPU, CUDA until its backend exists)."""

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


def adamw_update(p, grad, state, hyper, grad_scale):
    """p, grad: this rank's values and gradient (grad None: zeros); state: the parameter's optimizer
    state (step, exp_avg, exp_avg_sq, created here); hyper: its param group."""
    grad = torch.zeros_like(p) if grad is None else grad
    if "step" not in state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    state["step"] += 1
    lr, betas, eps, wd = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    engine = _engine(p)
    if engine is not None and p.is_contiguous() and grad.is_contiguous() and grad.dtype == p.dtype:
        device, dtype, stream = engine
        dmuon.adamw_step(p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), state["step"], lr,
                         betas, eps, wd, grad_scale, device=device, dtype=dtype, stream=stream)
        return
    if grad_scale != 1.0:
        grad = grad * grad_scale
    if wd:
        p.mul_(1.0 - lr * wd)
    m.lerp_(grad, 1.0 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1.0 - betas[1])
    bias1 = 1.0 - betas[0] ** state["step"]
    bias2 = 1.0 - betas[1] ** state["step"]
    denom = v.sqrt().div_(math.sqrt(bias2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bias1)
