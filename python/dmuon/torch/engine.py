"""The engine seam of dmuon.torch: who computes Muon's update of a step, behind one protocol.

exchange.py decides what each rank computes and moves the pieces; an engine does the arithmetic, on this rank's
tensors, in calls batched per bucket and param group:

  newton_schulz(options)  a handle of one Newton–Schulz setting (MuonOptions.newton_schulz; DMuon.ns_of keeps one
                          per distinct setting)
  ns_dtype(device, dtype) the torch dtype of a Newton–Schulz stack of U of `dtype` on `device` (bfloat16 on an
                          accelerator or for bfloat16 U, else float32); dmuon.UnsupportedError naming the device
                          where the engine cannot run
  momentum(entries, beta, nesterov, values, u_dtype)   M and U of (index, M, grad) entries; returns the U tensors
                          (u_dtype; computed in float32, M rounded once into its own dtype)
  orthogonalize(ns, matrices, names)               O in place of U on same-shape contiguous 2-D tensors
  apply(entries, lr, weight_decay, values, cautious_wd)    W ← W·(1 − lr·wd) − lr·s·O of (index, W, O, s) entries
  update(ns, entries, rows, cols, group, scale, cautious_wd, values, names)
                          all three for matrices held whole here, (index, W, M, grad) entries
values is the step's muon_update.StepValues (the keep flags and the clipping factor, device tensors). Each engine
keeps `ns_ran`, (id of the Newton–Schulz handle, rows, cols, batch) → the compute dtype ("float32", "bfloat16") its Newton–Schulz ran them in
(DMuon.ns_dtypes_ran), so a benchmark reports the precision beside the time.

Two engines: DmuonEngine, libdmuon_c's C++ engine (muon_update.py's calls: the CPU backend, or for CUDA tensors its
CUDA backend on torch's current stream; tuned kernels), and TorchEngine, the same rules and recurrences in torch ops
(torch_engine.py) on any device torch has. make_engine picks one for DMuon(engine=...).
"""

import warnings

import torch

import dmuon
from dmuon.torch import muon_update
from dmuon.torch import torch_engine

ENGINES = ("auto", "dmuon", "torch")

_advised = False  # the one line of DmuonEngine._ran (once per process)


def _advise_tuning(rows, cols, batch):
    """Once per process: an untuned shape ran in float32 on a CPU where dmuon.tune would time bfloat16 too."""
    global _advised
    if _advised:
        return
    _advised = True
    warnings.warn(f"DMuon: Newton-Schulz of {rows}x{cols} (batch {batch}) and any other shape the tuning cache lacks "
                  "runs untuned in float32 (ns_dtype=None); this CPU computes in bfloat16 too, which may be faster: "
                  "`dmuon tune --model ...` or dmuon.tune([(rows, cols, batch), ...]) times both per shape, and "
                  "DMuon then runs the faster (docs/ns.md, \"Compute dtype\")", stacklevel=2)


def _stack_dtype(device, dtype):
    """The storage of a Newton–Schulz stack: bfloat16 where the iterates are (an accelerator's, DESIGN 6) or the data
    is, else float32."""
    return torch.bfloat16 if device.type != "cpu" or dtype == torch.bfloat16 else torch.float32


class DmuonEngine:
    """libdmuon_c. threads: BLAS threads of each Newton–Schulz call; tune_cache: its tuning cache (DMuon's);
    ns_dtype: the compute dtype asked for ("float32", "bfloat16"; None: the device's default)."""

    name = "dmuon"

    def __init__(self, threads, tune_cache, ns_dtype, advise=False):
        self.threads, self.tune_cache, self.dtype = threads, tune_cache, ns_dtype
        self.advise = advise  # _advise_tuning where a shape runs untuned though tuning would time bfloat16 (rank 0)
        self.ns_ran = {}

    def _ran(self, ns, device, dtype_code, rows, cols, batch):
        """Notes the compute dtype of a call (first of each (rows, cols, batch)), advising tuning where it is untuned
        float32 asked for by nobody on a CPU where dmuon.tune times bfloat16 too."""
        if (id(ns), rows, cols, batch) in self.ns_ran:
            return
        compute, tuned = ns.call_dtype(rows, cols, batch, device, dtype_code)
        self.ns_ran[id(ns), rows, cols, batch] = compute
        if (self.advise and not tuned and self.dtype is None and device == dmuon.DEVICE_CPU
                and compute == "float32" and dmuon.tuning_chooses_dtype()):
            _advise_tuning(rows, cols, batch)

    def newton_schulz(self, options):
        # check_finite=False: the GradientCheck has checked every gradient, so a bucket's Newton–Schulz on a GPU need
        # not wait for its inputs' norms (the next bucket's all-to-all overlaps it).
        coeffs, algo, steps = options.newton_schulz
        return dmuon.Orthogonalizer(coeffs=coeffs, algo=algo, steps=steps, check_finite=False, threads=self.threads,
                                    tune_cache=self.tune_cache, dtype=self.dtype)

    def ns_dtype(self, device, dtype):
        return self._target(device, dtype)[2]

    @staticmethod
    def _target(device, dtype):
        """(device code, dtype code, torch dtype, stream) of Newton–Schulz of U of `dtype` on `device`: the stack's
        dtype where this build runs it, else float32. Raises dmuon.UnsupportedError naming the device when this build
        has no backend for it."""
        code, stream = muon_update.engine_device(device)
        wanted = _stack_dtype(device, dtype)
        choices = ([(dmuon.DTYPE_BF16, torch.bfloat16)] if wanted == torch.bfloat16 else []) + [
            (dmuon.DTYPE_F32, torch.float32)]
        for dtype_code, ns_dtype in choices:
            if dmuon.supports(code, dtype_code):
                return code, dtype_code, ns_dtype, stream
        runs = [name for name, where in (("cpu", dmuon.DEVICE_CPU), ("cuda", dmuon.DEVICE_CUDA))
                if dmuon.supports(where, dmuon.DTYPE_F32) or dmuon.supports(where, dmuon.DTYPE_BF16)]
        raise dmuon.UnsupportedError(f"device {device}: this build of libdmuon_c has no Newton-Schulz backend "
                                     f"for it (it runs on {' and '.join(runs) or 'no device of this machine'})")

    def momentum(self, entries, beta, nesterov, values, u_dtype):
        return muon_update.muon_momentum(entries, beta, nesterov, values, u_dtype)

    def orthogonalize(self, ns, matrices, names):
        device, dtype_code, _, stream = self._target(matrices[0].device, matrices[0].dtype)
        rows, cols = matrices[0].shape
        self._ran(ns, device, dtype_code, rows, cols, len(matrices))
        ns.run(matrices, matrices, rows, cols, device=device, dtype=dtype_code, stream=stream, names=names)

    def apply(self, entries, lr, weight_decay, values, cautious_wd):
        muon_update.muon_apply(entries, lr, weight_decay, values, cautious_wd)

    def update(self, ns, entries, rows, cols, group, scale, cautious_wd, values, names):
        # dmuon_muon_update's iterates: a GPU's default is bfloat16 whatever the storage, as for bfloat16 data
        self._ran(ns, muon_update.engine_device(entries[0][1].device)[0], dmuon.DTYPE_BF16, rows, cols, len(entries))
        muon_update.muon_update(ns, entries, rows, cols, group, scale, cautious_wd, values, names)


class TorchEngine:
    """torch ops (torch_engine.py) on any device. ns_dtype as DmuonEngine's. No tuning: algo "auto" is the untuned
    rule (Gram when n ≥ 2m)."""

    name = "torch"

    def __init__(self, ns_dtype):
        self.dtype = ns_dtype
        self.ns_ran = {}

    def newton_schulz(self, options):
        coeffs, algo, steps = options.newton_schulz
        return torch_engine.TorchNewtonSchulz(coeffs, algo, steps, self.dtype)

    def ns_dtype(self, device, dtype):
        if device.type == "meta":
            raise dmuon.UnsupportedError(f"device {device}: its tensors have no storage (build the optimizer after "
                                         "to_empty())")
        return _stack_dtype(device, dtype)

    def momentum(self, entries, beta, nesterov, values, u_dtype):
        return torch_engine.momentum([(m, g) for _, m, g in entries], beta, nesterov,
                                     values.keep_of([i for i, _, _ in entries]), values.clip_factor, u_dtype)

    def orthogonalize(self, ns, matrices, names):
        stack = torch.stack(matrices)
        self._ran(ns, ns.compute_dtype(stack.device, stack.dtype), stack.shape)
        for matrix, o in zip(matrices, ns.run(stack).unbind()):
            matrix.copy_(o)

    def apply(self, entries, lr, weight_decay, values, cautious_wd):
        torch_engine.apply([(w, o, s) for _, w, o, s in entries], muon_update.host_number(lr), weight_decay,
                           values.keep_of([i for i, _, _, _ in entries]), cautious_wd)

    def _ran(self, ns, compute, shape):
        self.ns_ran.setdefault((id(ns), shape[-2], shape[-1], shape[0]), str(compute).removeprefix("torch."))

    def update(self, ns, entries, rows, cols, group, scale, cautious_wd, values, names):
        self._ran(ns, ns.compute_dtype(entries[0][1].device, torch.bfloat16), (len(entries), rows, cols))
        torch_engine.update(ns, [(w, m, g) for _, w, m, g in entries], group["momentum"], group["nesterov"],
                            muon_update.host_number(group["lr"]), group["weight_decay"], scale, cautious_wd,
                            values.keep_of([i for i, _, _, _ in entries]), values.clip_factor)


def _refusal(engine, devices):
    """None when `engine` runs Newton–Schulz on every device of `devices`, else why not (libdmuon_c: also when it
    cannot be loaded)."""
    if isinstance(engine, DmuonEngine) and dmuon.library_error() is not None:
        return dmuon.library_error()
    for device in devices:
        try:
            engine.ns_dtype(device, torch.float32)
        except dmuon.UnsupportedError as e:
            return str(e)
    return None


def make_engine(choice, devices, threads, tune_cache, ns_dtype, warn):
    """The engine of a DMuon whose Muon parameters lie on `devices` (torch.device objects): choice "dmuon"
    (libdmuon_c; ValueError when it cannot be loaded) or "torch", or "auto": libdmuon_c where it runs on every one of
    them, else the torch engine where that does, with one warning (when `warn`) naming the engine it would have used
    and why not (where neither runs, libdmuon_c: the caller's check names the parameter); `warn` also lets
    libdmuon_c's engine advise tuning once (DmuonEngine._ran). threads, tune_cache, ns_dtype: DMuon's."""
    ours, torch_ops = DmuonEngine(threads, tune_cache, ns_dtype, advise=warn), TorchEngine(ns_dtype)
    if choice == "torch":
        return torch_ops
    if choice == "dmuon":
        error = dmuon.library_error()
        if error is not None:
            raise ValueError(f"DMuon: engine='dmuon' needs libdmuon_c: {error}")
        return ours
    missing = _refusal(ours, devices)
    if missing is None or _refusal(torch_ops, devices) is not None:
        return ours
    if warn:
        warnings.warn(f"DMuon: engine='auto' would use libdmuon_c (engine='dmuon'), but {missing}; Muon's update "
                      "runs in torch ops instead (engine='torch')", stacklevel=4)
    return torch_ops
