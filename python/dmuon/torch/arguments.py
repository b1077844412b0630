"""DMuon's arguments and its param groups' values, checked as torch.optim's optimizers check theirs (their
messages, the parameter or group named), before any parameter is read or written."""

import torch

from dmuon.torch.engine import ENGINES
from dmuon.torch.muon_options import DEFAULTS as MUON_DEFAULTS, check_options

BALANCERS = ("milp", "lpt", "rr")  # the owner planner's (dmuon.plan_owners)


def check_arguments(options, ns_dtype, lr, momentum, weight_decay, adamw_lr, adamw_betas, adamw_eps,
                    adamw_weight_decay, muon, balancer, nonfinite, engine, clip_grad_norm, state_dtype, step_memory):
    """DMuon's keyword arguments, in this order; options: the keywords beyond its signature (Muon's options),
    muon: them over muon_options.DEFAULTS. TypeError for a keyword DMuon lacks, ValueError naming a bad value."""
    unknown = next((key for key in options if key not in MUON_DEFAULTS), None)
    if unknown is not None:  # Python's own message for a keyword the signature lacks
        raise TypeError(f"DMuon.__init__() got an unexpected keyword argument '{unknown}'")
    _check_choice("ns_dtype", ns_dtype, (None, "float32", "bfloat16"))
    _check_defaults(lr, momentum, weight_decay, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay)
    check_options(muon, "DMuon")
    _check_choice("balancer", balancer, BALANCERS)
    _check_choice("nonfinite", nonfinite, ("error", "skip"))
    _check_choice("engine", engine, ENGINES)
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"DMuon: clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
    state_dtype_value(state_dtype, "DMuon")
    if step_memory not in ("auto", None) and not (isinstance(step_memory, int) and not isinstance(step_memory, bool)
                                                 and step_memory >= 0):
        raise ValueError(f"DMuon: step_memory must be \"auto\", None or bytes (an int ≥ 0), got {step_memory!r}")


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def state_dtype_value(value, where):
    """A state_dtype as param groups keep it: its name, "float32" or "bfloat16" (torch.float32 and torch.bfloat16
    give theirs; a name, not a torch.dtype, because torch.distributed.checkpoint's full state dicts take only plain
    values), or None (each parameter's own dtype); ValueError naming `where` for another value."""
    if value is None or (isinstance(value, str) and value in STATE_DTYPES):
        return value
    names = {dtype: name for name, dtype in STATE_DTYPES.items()}
    if isinstance(value, torch.dtype) and value in names:
        return names[value]
    raise ValueError(f"{where}: state_dtype must be torch.float32, torch.bfloat16, 'float32', 'bfloat16' or None "
                     f"(the parameter's dtype), got {value!r}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"DMuon: {name} must be one of {', '.join(str(c) for c in choices)}; got {value!r}")


def check_group(g, name, options=True):
    """A param group's values (with Muon's options), torch.optim's checks (after check_arguments') with the group
    named by its first parameter; its state_dtype made its name in place (state_dtype_value)."""
    where = f"DMuon: param group of '{name}': "
    g["state_dtype"] = state_dtype_value(g["state_dtype"], where[:-2])
    if g["use_muon"]:
        _check_values(where, "", lr=g["lr"], momentum=g["momentum"], weight_decay=g["weight_decay"])
        if options:
            check_options(g, where[:-2])
    else:
        _check_values(where, "", lr=g["lr"], eps=g["eps"], betas=g["betas"], weight_decay=g["weight_decay"])


def _check_defaults(lr, momentum, weight_decay, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay):
    """DMuon's hyper-parameter arguments, checked before its parameters as torch.optim's optimizers do, with
    their messages (the adamw_ arguments named after them)."""
    _check_values("", "", lr=lr, momentum=momentum, weight_decay=weight_decay)
    _check_values("", " (adamw_lr)", lr=adamw_lr)
    _check_values("", " (adamw_eps)", eps=adamw_eps)
    _check_values("", " (adamw_betas)", betas=adamw_betas)
    _check_values("", " (adamw_weight_decay)", weight_decay=adamw_weight_decay)


def _check_values(prefix, suffix, lr=None, momentum=None, eps=None, betas=None, weight_decay=None):
    """ValueError with torch.optim's message (Adam's, SGD's) for the first bad value given (None: not
    given); a Muon momentum must also be below 1 and eps above 0."""
    def bad(message):
        raise ValueError(prefix + message + suffix)

    if torch.is_tensor(lr) and lr.numel() != 1:
        bad("Tensor lr must be 1-element")
    if lr is not None and not 0.0 <= lr:
        bad(f"Invalid learning rate: {lr}")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        bad(f"Invalid momentum value: {momentum} (Muon's momentum is in [0, 1))")
    if eps is not None and not 0.0 < eps:
        bad(f"Invalid epsilon value: {eps} (must be > 0)")
    if betas is not None:
        betas = tuple(betas)
        if len(betas) != 2:
            bad(f"betas must be a pair (beta1, beta2), got {betas}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                bad(f"Invalid beta parameter at index {i}: {beta}")
    if weight_decay is not None and not 0.0 <= weight_decay:
        bad(f"Invalid weight_decay value: {weight_decay}")
