"""The torch engine: Muon's update (DESIGN 1) and Newton–Schulz (DESIGN 2.1, 2.2) as torch ops, for any device
torch runs on (ROCm, XPU, MPS, or a CUDA machine whose libdmuon_c has no CUDA backend). engine.py puts it behind
the seam beside libdmuon_c; tests and benchmarks use newton_schulz() as their torch Newton–Schulz.

It runs the recurrences of the C++ engine (src/ns/newton_schulz.cpp) step for step: the same products with the
same alpha/beta (one batched torch.baddbmm where the engine calls gemm with beta), the same coefficient schedules
(src/ns/coefficients.cpp), the same normalisation X = U·float32(1 / (‖U‖_F·safety + 1e-7)) with ‖U‖ in float64, the
same algorithm choice ("auto": Gram when n ≥ 2m) and Gram restarts ([2] in float32, [1, 3] in bfloat16). Only the
products' summation order differs (no SYRK or tiled symmetric products here: torch has none), so in float32 the two
engines agree within rounding. Iterates are stored in the compute dtype: float32, or bfloat16 with torch's float32
accumulation inside each product (CUDA's and ROCm's bf16 GEMMs; on the CPU oneDNN's), as our CUDA backend: bf16
products run with torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction off (torch's default lets cuBLAS
sum partial products in bf16; our backend forbids it, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION).

The update rules compute in float32 as the engine's (src/backend/rules: torch's lerp, each operation rounded once)
and round once into each tensor's own dtype; a tensor whose keep flag is 0 is left as it was, bit for bit.
"""

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

from dmuon.torch import torch_private
from dmuon.torch.devices import wide_dtype

# The coefficient tables p(x) = a·x + b·x³ + c·x⁵ (DESIGN 2.4, src/ns/coefficients.cpp); past a table's end its last
# row repeats.
KELLER = ((3.4445, -4.7750, 2.0315),)
YOU = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
       (2.8366, -3.0525, 1.2012))
# Amsel et al., "The Polar Express" (arXiv 2505.16932), degree 5, ℓ = 1e-3; its last row is the converged polynomial.
POLAR_EXPRESS = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
                 (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
                 (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
                 (3.3184196573706015, -2.488488024314874, 0.51004894012372),
                 (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
                 (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
                 (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
                 (1.875, -1.25, 0.375))
TABLES = {"keller": KELLER, "you": YOU, "polar-express": POLAR_EXPRESS}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_safety(coeffs):
    return 1.01 if coeffs == "polar-express" else 1.0


def schedule(coeffs, steps, safety):
    """[(a, b, c)] of `steps` steps, each row but polar-express's converged last one mapped by the safety factor s
    to (a/s, b/s³, c/s⁵) (ns_schedule)."""
    rows = TABLES[coeffs]
    scaled = len(rows) - 1 if coeffs == "polar-express" else len(rows)
    out = []
    for t in range(steps):
        i = min(t, len(rows) - 1)
        a, b, c = rows[i]
        out.append((a / safety, b / safety ** 3, c / safety ** 5) if i < scaled else (a, b, c))
    return out


def resolve_algo(algo, rows, cols):
    """"auto" → "gram" when n ≥ 2m (m ≤ n the sides), else "standard" (ns_resolve_algo)."""
    if algo != "auto":
        return algo
    m, n = min(rows, cols), max(rows, cols)
    return "gram" if n >= 2 * m else "standard"


def newton_schulz(u, coeffs="keller", steps=5, algo="auto", dtype=torch.float32, restarts=None, eps=1e-7):
    """O = orth(U) of every matrix of u (..., rows, cols), any float dtype, computed with iterates of `dtype`
    (float32, bfloat16 with float32 accumulation, or float64 for a reference); returns O (..., rows, cols) in `dtype`.
    restarts: the Gram recurrence's restart steps (None: [2] in float32 and float64, [1, 3] in bfloat16); eps: the
    normalisation's (the engine's 1e-7; another for a peer's contract)."""
    rows, cols = u.shape[-2:]
    algo = resolve_algo(algo, rows, cols)
    safety = default_safety(coeffs)
    tall = rows > cols
    batch = u.reshape(-1, rows, cols)
    x = batch.mT if tall else batch  # (K, m, n), m ≤ n
    norms = torch.linalg.vector_norm(batch, dim=(-2, -1), dtype=wide_dtype(u.device))  # (K,), float64 but on MPS
    inverse = (1.0 / (norms * safety + eps))[:, None, None]
    if dtype == torch.float64:
        x = x.to(dtype) * inverse
    else:  # the engine's: X stored in dtype, scaled in float32 by float32(1 / (‖U‖·safety + 1e-7)), rounded once
        x = (x.to(dtype).to(torch.float32) * inverse.to(torch.float32)).to(dtype)
    steps_abc = schedule(coeffs, steps, safety)
    with _float32_sums(dtype):
        if algo == "gram":
            if restarts is None:
                restarts = (1, 3) if dtype == torch.bfloat16 else (2,)
            x = _gram(x, steps_abc, restarts)
        else:
            x = _standard(x, steps_abc)
    return (x.mT if tall else x).reshape(u.shape)


@contextlib.contextmanager
def _float32_sums(dtype):
    """bf16 products inside sum their partials in float32 only (the flag off, then as it was)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    if dtype == torch.bfloat16:
        matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def _symmetric(s):
    """The (K, m, m) product s made exactly symmetric, its upper triangle mirrored, as the engine's symmetric
    products (SYRK, the tiled upper triangle) leave theirs: a GEMM's two triangles may differ by rounding, and the
    Gram recurrence amplifies an asymmetry (measured: twice the distance to float64 without this)."""
    return torch.triu(s) + torch.triu(s, 1).mT


def _standard(x, steps_abc):
    """DESIGN 2.1 on X (K, m, n), m ≤ n, normalised."""
    for a, b, c in steps_abc:
        gram = _symmetric(torch.bmm(x, x.mT))                                # A = X·Xᵀ        (K, m, m)
        poly = _symmetric(torch.baddbmm(gram, gram, gram, beta=b, alpha=c))  # B = b·A + c·A·A (K, m, m)
        x = torch.baddbmm(x, poly, x, beta=a)                                # X ← a·X + B·X   (K, m, n)
    return x


def _gram(x, steps_abc, restarts):
    """DESIGN 2.2 on X (K, m, n), m ≤ n, normalised: the iterates X_t = Q_t·X on (K, m, m) matrices, X and
    R = X·Xᵀ formed again at each restart step. Every (K, m, m) product is symmetric (its factors commute)."""
    def restart_at(step):
        return step > 0 and step in restarts

    r = _symmetric(torch.bmm(x, x.mT))  # R = X·Xᵀ
    q = None
    for step, (a, b, c) in enumerate(steps_abc):
        if restart_at(step):
            x = torch.bmm(q, x)  # X ← Q·X
            r = _symmetric(torch.bmm(x, x.mT))
            q = None
        z = _symmetric(torch.baddbmm(r, r, r, beta=b, alpha=c))  # Z = b·R + c·R·R
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = Z + a·I
        else:
            q = _symmetric(torch.baddbmm(q, q, z, beta=a))  # Q ← Q·Z + a·Q
        if step + 1 < len(steps_abc) and not restart_at(step + 1):
            rz = _symmetric(torch.baddbmm(r, r, z, beta=a))  # RZ = R·Z + a·R
            r = _symmetric(torch.baddbmm(rz, z, rz, beta=a))  # R ← Z·RZ + a·RZ
    return x if q is None else torch.bmm(q, x)  # O = Q·X


def ns_default_dtype_rule(bf16_units, forced):
    """Newton–Schulz's compute dtype on the CPU where none is asked for, libdmuon_c's rule (include/dmuon/backend.hpp,
    ns_default_dtype_rule) with the machine's answer given (tests fake it): `forced`, DMUON_NS_DEFAULT_DTYPE's value,
    when set ("bf16" or "f32"; None or "": unset; another value raises ValueError naming the variable), else bfloat16
    exactly when `bf16_units`."""
    if not forced:
        return torch.bfloat16 if bf16_units else torch.float32
    if forced not in ("bf16", "f32"):
        raise ValueError(f"DMUON_NS_DEFAULT_DTYPE must be bf16 or f32 (or unset: the machine's default), "
                         f"got {forced!r}")
    return torch.bfloat16 if forced == "bf16" else torch.float32


@functools.cache
def cpu_ns_default_dtype():
    """The torch engine's Newton–Schulz compute dtype on the CPU where none is asked for: bfloat16 where the CPU has
    bf16 matrix units torch's products run on (AMX), float32 elsewhere; DMUON_NS_DEFAULT_DTYPE (bf16, f32)
    forces either, as it does libdmuon_c's default. Read once per process."""
    return ns_default_dtype_rule(torch_private.cpu_has_bf16_matrix_units(), os.environ.get("DMUON_NS_DEFAULT_DTYPE"))


@dataclass(frozen=True)
class TorchNewtonSchulz:
    """One Newton–Schulz setting of the torch engine (a MuonOptions.newton_schulz): coeffs, algo, steps, and the
    compute dtype asked for ("float32", "bfloat16"; None: on the CPU cpu_ns_default_dtype(), elsewhere the data's
    storage type, as libdmuon_c's device default). No tuning: algo "auto" is the rule of resolve_algo."""

    coeffs: str
    algo: str
    steps: int
    dtype: object = None
    tuned_entries = 0

    def compute_dtype(self, device, storage):
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return cpu_ns_default_dtype() if device.type == "cpu" else storage

    def run(self, stack):
        """O of every matrix of stack (K, rows, cols) of float32 or bfloat16, in the stack's dtype."""
        dtype = self.compute_dtype(stack.device, stack.dtype)
        return newton_schulz(stack, self.coeffs, self.steps, self.algo, dtype).to(stack.dtype)


def _float(t):
    return t.to(torch.float32)


def momentum(entries, beta, nesterov, keep, grad_scale, out_dtype=None):
    """M ← lerp(M, g, 1−β) in place and U = nesterov ? lerp(g, M, β) : M for each (momentum, grad) of `entries`
    (grad None: zeros; g = grad·grad_scale, grad_scale None or a float32 () tensor), computed in float32; keep: a
    float32 (len(entries),) tensor of flags, 0: M as it is and U = M. Returns the U tensors, each the momentum's
    dtype (out_dtype None) or out_dtype."""
    out = []
    for (m, grad), flag in zip(entries, keep.unbind()):
        m32 = _float(m)
        g = torch.zeros_like(m32) if grad is None else _float(grad).reshape(m32.shape)
        if grad_scale is not None:
            g = g * grad_scale
        new = torch.lerp(m32, g, 1.0 - beta)
        u = torch.lerp(g, new, beta) if nesterov else new
        kept = flag != 0
        m.copy_(torch.where(kept, new, m32))
        out.append(torch.where(kept, u, m32).to(out_dtype or m.dtype))
    return out


def apply(entries, lr, weight_decay, keep, cautious_wd):
    """W ← W·(1 − lr·wd) − lr·(O·scale) in place for each (W, O, scale) of `entries` whose keep flag is not 0
    (cautious_wd: the decay only where W·O ≥ 0), in float32 rounded once to W's dtype."""
    # A Python number in torch's arithmetic on a float32 tensor is taken as float32: the rules' float32 constants.
    decay, neg_lr = 1.0 - lr * weight_decay, -lr
    for (w, o, scale), flag in zip(entries, keep.unbind()):
        w32, o32 = _float(w), _float(o).reshape(w.shape)  # O row-major as W's elements (a channels_last filter too)
        decayed = w32 * decay
        if cautious_wd:
            decayed = torch.where(w32 * o32 >= 0, decayed, w32)
        new = decayed + neg_lr * (o32 * scale)
        w.copy_(torch.where(flag != 0, new, w32))


def update(ns, entries, beta, nesterov, lr, weight_decay, scale, cautious_wd, keep, grad_scale):
    """The whole update of same-shape matrices held whole, for each (W, momentum, grad) of `entries` (views of
    shape (rows, cols)): the momentum, U kept in float32, O = orth(U) by the TorchNewtonSchulz `ns` in one batched
    call, and the apply with `scale`."""
    u = momentum([(m, g) for _, m, g in entries], beta, nesterov, keep, grad_scale, out_dtype=torch.float32)
    stack = torch.stack(u)  # (K, rows, cols) float32
    # the device's default iterates as libdmuon_c's dmuon_muon_update: float32 on the CPU, bfloat16 elsewhere
    o = newton_schulz(stack, ns.coeffs, ns.steps, ns.algo, ns.compute_dtype(stack.device, torch.bfloat16))
    apply([(w, o_k, scale) for (w, _, _), o_k in zip(entries, o.unbind())], lr, weight_decay, keep, cautious_wd)

