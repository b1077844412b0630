"""The engine's C ABI (include/dmuon/dmuon_c.h), loaded with ctypes.

The ABI reads every tensor as dense row-major memory and takes a contiguity flag with each (it refuses a
tensor flagged strided, naming the argument). Here a tensor argument is an array, whose flag is read from it
(a numpy array's C_CONTIGUOUS, a torch tensor's is_contiguous()), or a raw pointer (an int, or a (pointer,
DTYPE_*) pair), which the caller states is dense.

ctypes.CDLL releases the GIL for the duration of every foreign call, so Newton–Schulz on one thread
does not stop other Python threads (torch's communication threads run in C++ anyway). No torch import
here: arrays are read through their own methods, so any torch version (or none) can use it.
"""

import ctypes
import functools
import json
import os
import pathlib

ABI_VERSION = 8  # DMUON_C_ABI_VERSION

DEVICE_CPU, DEVICE_CUDA = 0, 1
DTYPE_F32, DTYPE_BF16 = 0, 1
# Newton–Schulz's compute dtype by name (dmuon_ns_set_dtype); None: the device's default.
NS_DTYPES = {None: -1, "float32": DTYPE_F32, "bfloat16": DTYPE_BF16}

_OK, _ERR_INVALID, _ERR_UNSUPPORTED, _ERR_FAILED = 0, 1, 2, 3


class DmuonError(RuntimeError):
    """An error reported by the engine (bad argument or failure); the message names what and where."""


class UnsupportedError(DmuonError):
    """A device or dtype this build of libdmuon_c does not support."""


def _library_path():
    override = os.environ.get("DMUON_C_LIBRARY")
    if override:
        return pathlib.Path(override)
    return pathlib.Path(__file__).with_name("libdmuon_c.so")


def _cpu_has_avx512():
    """Whether /proc/cpuinfo lists AVX-512 F, BW, DQ and VL (OpenBLAS's SkylakeX kernels' instructions)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= set(flags)


def _openblas_loaded():
    """Whether the OpenBLAS libdmuon_c links (libopenblas.so.0, not numpy's bundled copy) is in this process already:
    the dynamic loader's answer (RTLD_NOLOAD loads nothing)."""
    try:
        ctypes.CDLL("libopenblas.so.0", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return True
    except OSError:
        return False


def _choose_openblas_kernels():
    """OPENBLAS_CORETYPE=SkylakeX on a CPU with AVX-512 before libdmuon_c loads OpenBLAS, unless the environment
    names a core or OpenBLAS is loaded already: OpenBLAS picks its kernels when it loads, and on a model it does not
    know (OpenBLAS 0.3.21 on an Emerald Rapids Xeon) it falls back to its generic SSE3 ones, several times slower
    (docs/ns.md, "OpenBLAS's kernels"). SkylakeX's are those OpenBLAS runs on every AVX-512 CPU it knows."""
    if "OPENBLAS_CORETYPE" not in os.environ and _cpu_has_avx512() and not _openblas_loaded():
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"


@functools.cache
def library():
    """libdmuon_c, loaded on first use (so `import dmuon` and dmuon.torch's torch engine need no library); raises
    ImportError naming the file when it is missing, cannot be loaded or has another ABI version (not cached: a later
    call tries again)."""
    path = _library_path()
    if not path.exists():
        raise ImportError(f"dmuon: {path} not found (build the dmuon_c target, or set DMUON_C_LIBRARY)")
    _choose_openblas_kernels()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise ImportError(f"dmuon: {path} cannot be loaded: {e}") from None
    c_int, c_i64, c_char_p, c_void_p = ctypes.c_int, ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p
    c_size_t = ctypes.c_size_t
    p_i64 = ctypes.POINTER(c_i64)
    p_void, p_int = ctypes.POINTER(c_void_p), ctypes.POINTER(c_int)
    signatures = {
        "dmuon_abi_version": (c_int, []),
        "dmuon_last_error": (c_char_p, []),
        "dmuon_supports": (c_int, [c_int, c_int]),
        "dmuon_tuning_chooses_dtype": (c_int, []),
        "dmuon_ns_create": (c_int, [c_char_p, c_char_p, c_int, c_int, c_char_p, ctypes.POINTER(c_void_p)]),
        "dmuon_ns_destroy": (None, [c_void_p]),
        "dmuon_ns_tuned_entries": (c_i64, [c_void_p]),
        "dmuon_ns_warning": (c_char_p, [c_void_p]),
        "dmuon_ns_call_dtype": (c_int, [c_void_p, c_int, c_int, c_i64, c_i64, c_i64, p_int, p_int]),
        "dmuon_engine_bytes": (None, [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), c_int]),
        "dmuon_release_workspaces": (None, []),
        "dmuon_ns_set_check_finite": (c_int, [c_void_p, c_int]),
        "dmuon_ns_set_dtype": (c_int, [c_void_p, c_int]),
        "dmuon_ns_run": (c_int, [c_void_p, c_int, c_int, c_void_p, p_void, p_int, p_void, p_int, c_i64, c_i64, c_i64,
                                 ctypes.POINTER(c_char_p)]),
        "dmuon_muon_momentum": (c_int, [c_int, c_void_p, c_i64, p_i64, p_void, p_int, p_int, p_void, p_int, p_int,
                                        p_void, p_int, p_int, p_void, c_void_p, ctypes.c_double, c_int]),
        "dmuon_muon_apply": (c_int, [c_int, c_void_p, c_i64, p_i64, p_void, p_int, p_int, p_void, p_int, p_int, p_void,
                                     ctypes.c_double, ctypes.c_double, ctypes.POINTER(ctypes.c_double), c_int]),
        "dmuon_muon_update": (c_int, [c_void_p, c_int, c_void_p, c_i64, c_i64, c_i64, p_void, p_int, p_int, p_void,
                                      p_int, p_int, p_void, p_int, p_int, p_void, c_void_p, ctypes.c_double, c_int,
                                      ctypes.c_double, ctypes.c_double, ctypes.c_double, c_int,
                                      ctypes.POINTER(c_char_p)]),
        "dmuon_adamw_step": (c_int, [c_int, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, p_int, c_i64,
                                     c_i64,
                                     ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                                     ctypes.c_double, ctypes.c_float]),
        "dmuon_plan_owners": (c_int, [c_i64, p_i64, p_i64, c_int, c_char_p, c_char_p, c_char_p, c_int,
                                      ctypes.c_double, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(c_int)]),
        "dmuon_plan_owners_blocks": (c_int, [c_i64, p_i64, p_i64, p_i64, p_i64, p_i64, c_int, c_char_p, c_char_p,
                                             c_char_p, c_int, ctypes.c_double, ctypes.POINTER(ctypes.c_int32),
                                             ctypes.POINTER(c_int)]),
        "dmuon_tune": (c_int, [c_i64, p_i64, p_i64, ctypes.POINTER(ctypes.c_int32), c_int, c_int, c_char_p]),
        "dmuon_default_tune_cache_path": (c_int, [c_char_p, c_size_t, ctypes.POINTER(c_size_t)]),
        "dmuon_model_params_json": (c_int, [c_char_p, c_int, c_char_p, c_size_t, ctypes.POINTER(c_size_t)]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    version = lib.dmuon_abi_version()
    if version != ABI_VERSION:
        raise ImportError(f"dmuon: {path} has C ABI version {version}, this package expects {ABI_VERSION}")
    return lib


def library_error():
    """None when libdmuon_c loads, else why it does not (the ImportError's message)."""
    try:
        library()
    except ImportError as e:
        return str(e)
    return None


def _check(code):
    if code == _OK:
        return
    # The engine names the C++ field; the Python argument that sets it is tune_cache.
    message = library().dmuon_last_error().decode().replace("TuneSessionOptions.cache_path", "tune_cache")
    raise (UnsupportedError if code == _ERR_UNSUPPORTED else DmuonError)(message)


def _cache_arg(tune_cache):
    """None: no cache; "": the default path; else the path."""
    return None if tune_cache is None else os.fsencode(tune_cache)


def _i64_array(values):
    return (ctypes.c_int64 * len(values))(*values)


def _pointers(values):
    """A C array of pointers (ints; None for NULL)."""
    return (ctypes.c_void_p * max(len(values), 1))(*values)


def _ints(values):
    return (ctypes.c_int * max(len(values), 1))(*values)


def _names(names):
    return None if names is None else (ctypes.c_char_p * max(len(names), 1))(*[n.encode() for n in names])


def _read_string(fn, *args):
    needed = ctypes.c_size_t(0)
    fn(*args, None, 0, ctypes.byref(needed))  # fails (too small) but reports the length
    buf = ctypes.create_string_buffer(needed.value)
    _check(fn(*args, buf, needed.value, ctypes.byref(needed)))
    return buf.value.decode()


def supports(device, dtype):
    """Whether this build runs Newton–Schulz on `device` (DEVICE_*) with `dtype` (DTYPE_*)."""
    return bool(library().dmuon_supports(device, dtype))


def tuning_chooses_dtype():
    """Whether tune() times bfloat16 and float32 on this CPU, so that Orthogonalizer(dtype=None) runs each tuned shape
    in the faster (a CPU with bf16 instructions that oneDNN uses: AVX-512 BF16 or AMX; not under
    DMUON_NS_DEFAULT_DTYPE=f32); False: float32 alone is tuned. A shape the cache lacks runs in the CPU's default."""
    return bool(library().dmuon_tuning_chooses_dtype())


def engine_bytes(reset_peak=False):
    """(live, peak): the bytes of every buffer the engine holds now (its Newton–Schulz workspaces, pooled between
    calls, and what calls running allocate; every device) and the most since the last reset_peak=True (which then
    starts the peak from live). Memory the caller's allocator does not see (python/benchmarks/memory_count.py adds it
    to torch's)."""
    live, peak = ctypes.c_uint64(0), ctypes.c_uint64(0)
    library().dmuon_engine_bytes(ctypes.byref(live), ctypes.byref(peak), int(reset_peak))
    return live.value, peak.value


def release_workspaces():
    """Frees the Newton–Schulz workspaces the engine pools between calls (the next call allocates its own again)."""
    library().dmuon_release_workspaces()


class Orthogonalizer:
    """O_i = orth(U_i) for batches of same-shape row-major matrices (DESIGN 2), by the C++ engine.

    coeffs: "keller" | "you" | "polar-express"; algo: "auto" (tuned kernel when the tuning cache has
    the shape) | "standard" | "gram"; threads: BLAS threads per call; tune_cache: a path, "" for the
    default path, None for no tuning; check_finite: run() fails naming a non-finite input, which makes it wait
    for the input's norms (on a GPU, for everything queued before); False: no wait, and a non-finite input gives
    non-finite outputs, for callers that check their gradients first; dtype: Newton–Schulz's compute dtype (its
    iterates; products accumulate in float32), "float32" or "bfloat16", asked for explicitly and never taken from the
    data's storage type; None: on the CPU the dtype tune() measured faster for a shape the cache has (both timed where
    tuning_chooses_dtype()), else the device's default (the CPU: bfloat16 where it has bf16 matrix units, AMX,
    float32 elsewhere, DMUON_NS_DEFAULT_DTYPE=bf16|f32 forcing either; a GPU: the data's storage type).
    """

    _handle = None

    def __init__(self, coeffs="keller", algo="auto", steps=5, threads=1, tune_cache="", check_finite=True, dtype=None):
        if dtype not in NS_DTYPES:
            raise ValueError(f"Newton-Schulz dtype must be one of {sorted(NS_DTYPES, key=str)}, got {dtype!r}")
        handle = ctypes.c_void_p()
        _check(library().dmuon_ns_create(coeffs.encode(), algo.encode(), int(steps), int(threads),
                                    _cache_arg(tune_cache), ctypes.byref(handle)))
        self._handle = handle
        _check(library().dmuon_ns_set_check_finite(handle, int(bool(check_finite))))
        _check(library().dmuon_ns_set_dtype(handle, NS_DTYPES[dtype]))
        self.tuned_entries = library().dmuon_ns_tuned_entries(handle)
        self.warning = library().dmuon_ns_warning(handle).decode()

    def run(self, inputs, outputs, rows, cols, device=DEVICE_CPU, dtype=DTYPE_F32, stream=None, names=None):
        """inputs, outputs: sequences of rows·cols-element matrices, arrays or data pointers (ints)."""
        batch = len(inputs)
        if len(outputs) != batch:
            raise ValueError(f"{batch} inputs but {len(outputs)} outputs")
        ins = [_operand(x, dtype) for x in inputs]
        outs = [_operand(x, dtype) for x in outputs]
        name_arr = None if names is None else (ctypes.c_char_p * batch)(*[n.encode() for n in names])
        _check(library().dmuon_ns_run(self._handle, device, dtype, stream, *_pointers_and_flags(ins),
                                 *_pointers_and_flags(outs), batch, rows, cols, name_arr))

    def call_dtype(self, rows, cols, batch, device=DEVICE_CPU, dtype=DTYPE_F32):
        """(compute dtype name, tuned): the dtype a run() of `batch` rows×cols matrices stored as `dtype` on `device`
        computes in ("float32" or "bfloat16"), and whether a tuned entry gives its kernel."""
        compute, tuned = ctypes.c_int(), ctypes.c_int()
        _check(library().dmuon_ns_call_dtype(self._handle, device, dtype, int(rows), int(cols), int(batch),
                                             ctypes.byref(compute), ctypes.byref(tuned)))
        return ("float32", "bfloat16")[compute.value], bool(tuned.value)

    def muon_update(self, grads, momenta, params, rows, cols, keep, grad_scale, beta, nesterov, lr, weight_decay,
                    scale, cautious_wd=False, device=DEVICE_CPU, stream=None, names=None):
        """Muon's whole update of same-shape rows×cols matrices held here whole, in one call (dmuon_muon_update):
        grads, momenta, params are sequences of tensor arguments (arrays, or (pointer, DTYPE_*); a grad None or
        with pointer None: zeros); keep: None or one pointer per matrix to a float32 flag on the device; grad_scale:
        None or a pointer to one float32; cautious_wd as muon_apply's."""
        batch = len(params)
        _check(library().dmuon_muon_update(self._handle, device, stream, batch, rows, cols, *_operands(grads),
                                      *_operands(momenta), *_operands(params), _keep(keep, batch), grad_scale,
                                      float(beta), int(bool(nesterov)), float(lr), float(weight_decay), float(scale),
                                      int(bool(cautious_wd)), _names(names)))

    def close(self):
        if self._handle:
            library().dmuon_ns_destroy(self._handle)
            self._handle = None

    def __del__(self):
        self.close()


def _operand(x, dtype=None):
    """(pointer, DTYPE_*, contiguity flag) of one tensor argument: None (NULL); an array: a torch tensor (its
    data_ptr(), dtype, is_contiguous()) or a numpy array (its data, float32, C_CONTIGUOUS); or a raw pointer
    the caller states is dense: an int (of `dtype`) or a (pointer, DTYPE_*) pair."""
    if x is None:
        return None, DTYPE_F32, 1
    if isinstance(x, int):
        return x, dtype, 1
    if isinstance(x, tuple):
        return x[0], x[1], 1
    if hasattr(x, "data_ptr"):  # a torch tensor
        codes = {"torch.float32": DTYPE_F32, "torch.bfloat16": DTYPE_BF16}
        pointer, code, dense = x.data_ptr(), codes.get(str(x.dtype)), x.is_contiguous()
    else:  # a numpy array
        codes = {"float32": DTYPE_F32}
        pointer, code, dense = x.__array_interface__["data"][0], codes.get(str(x.dtype)), x.flags.c_contiguous
    if code is None or dtype not in (None, code):
        raise ValueError(f"an array of dtype {x.dtype}: the engine takes float32 and bfloat16, this call "
                         f"{'either' if dtype is None else ('float32', 'bfloat16')[dtype]}")
    return pointer, code, int(bool(dense))


def _pointers_and_flags(operands):
    """(pointers, contiguity flags) C arrays of _operand results."""
    return _pointers([p for p, _, _ in operands]), _ints([f for _, _, f in operands])


def _operands(xs):
    """(pointers, dtype codes, contiguity flags) C arrays of a sequence of tensor arguments (_operand)."""
    triples = [_operand(x) for x in xs]
    return _pointers([p for p, _, _ in triples]), _ints([d for _, d, _ in triples]), _ints([f for _, _, f in triples])


def _keep(keep, n):
    if keep is None:
        return None
    if len(keep) != n:
        raise ValueError(f"keep has {len(keep)} pointers for {n} tensors")
    return _pointers(keep)


def muon_momentum(sizes, grads, momenta, u, keep, grad_scale, beta, nesterov, device=DEVICE_CPU, stream=None):
    """Muon's momentum and U of tensors of `sizes` elements (dmuon_muon_momentum): grads, momenta, u are
    sequences of tensor arguments as Orthogonalizer.muon_update's (a grad None: zeros); keep, grad_scale too."""
    n = len(sizes)
    _check(library().dmuon_muon_momentum(device, stream, n, _i64_array(sizes), *_operands(grads), *_operands(momenta),
                                    *_operands(u), _keep(keep, n), grad_scale, float(beta), int(bool(nesterov))))


def muon_apply(sizes, params, updates, keep, lr, weight_decay, scales, cautious_wd=False, device=DEVICE_CPU,
               stream=None):
    """W ← W·(1 − lr·wd) − lr·(O·scale) of tensors of `sizes` elements (dmuon_muon_apply): params, updates are
    sequences of tensor arguments, scales one per tensor; keep as Orthogonalizer.muon_update's; cautious_wd: the
    decay only where W·O ≥ 0 (cautious weight decay), W as it is elsewhere."""
    n = len(sizes)
    _check(library().dmuon_muon_apply(device, stream, n, _i64_array(sizes), *_operands(params), *_operands(updates),
                                 _keep(keep, n), float(lr), float(weight_decay),
                                 (ctypes.c_double * max(n, 1))(*scales), int(bool(cautious_wd))))


def adamw_step(p, grad, exp_avg, exp_avg_sq, n, step, lr, betas, eps, weight_decay, grad_scale=1.0,
               device=DEVICE_CPU, dtype=DTYPE_F32, stream=None):
    """One fused AdamW step (torch.optim.AdamW's rule) on n elements of p, grad, exp_avg, exp_avg_sq: arrays or
    data pointers (ints) of `dtype`."""
    ops = [_operand(x, dtype) for x in (p, grad, exp_avg, exp_avg_sq)]
    _check(library().dmuon_adamw_step(device, dtype, stream, *[x for x, _, _ in ops], _ints([f for _, _, f in ops]),
                                 int(n), int(step), float(lr),
                                 float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(grad_scale)))


def plan_owners(shapes, world_size, balancer="milp", costs="auto", tune_cache="", threads=1, time_limit_s=2.0,
                blocks=None):
    """Owner rank of each (rows, cols) Muon matrix on world_size ranks (DESIGN 3.4).

    blocks: None (every matrix costed whole, dmuon_plan_owners), or one entry per matrix: None for a whole one, else
    the (rows, cols) of the blocks its split Newton–Schulz runs on (dmuon_plan_owners_blocks: the matrix costs the
    sum of its blocks' times, e.g. [(64, 896)] * 14 for a 896×896 q split in 14 heads).
    Returns (owners, used_tuned_costs). milp is time-limited, so call it on one rank and broadcast.
    """
    n = len(shapes)
    owners = (ctypes.c_int32 * max(n, 1))()
    used = ctypes.c_int(0)
    rows, cols = _i64_array([r for r, _ in shapes]), _i64_array([c for _, c in shapes])
    options = (int(world_size), balancer.encode(), costs.encode(), _cache_arg(tune_cache), int(threads),
               float(time_limit_s), owners, ctypes.byref(used))
    if blocks is None:
        _check(library().dmuon_plan_owners(n, rows, cols, *options))
    else:
        if len(blocks) != n:
            raise ValueError(f"plan_owners: blocks has {len(blocks)} entries for {n} matrices")
        listed = [b or () for b in blocks]
        flat = [block for b in listed for block in b]
        _check(library().dmuon_plan_owners_blocks(n, rows, cols, _i64_array([len(b) for b in listed]),
                                                  _i64_array([r for r, _ in flat]), _i64_array([c for _, c in flat]),
                                                  *options))
    return list(owners)[:n], bool(used.value)


def tune(requests, threads=1, rounds=3, tune_cache=""):
    """Tunes the (rows, cols, batch) requests the cache lacks and saves the cache (DESIGN 3.5) for calls that ask for
    no compute dtype (Orthogonalizer's dtype=None): where the CPU has bf16 instructions that oneDNN uses
    (tuning_chooses_dtype()) bfloat16 and float32 are timed and each request keeps the faster, else float32 alone.
    The planner's tuned costs read these timings."""
    n = len(requests)
    batch = (ctypes.c_int32 * max(n, 1))(*[b for _, _, b in requests])
    _check(library().dmuon_tune(n, _i64_array([r for r, _, _ in requests]), _i64_array([c for _, c, _ in requests]),
                           batch, int(threads), int(rounds), os.fsencode(tune_cache)))


def default_tune_cache_path():
    return _read_string(library().dmuon_default_tune_cache_path)


def model_params(name_or_path, layers=0):
    """A model manifest's parameters: [{"name", "shape", "role"}] (models/*.json, as `dmuon plan`)."""
    return json.loads(_read_string(library().dmuon_model_params_json, os.fsencode(name_or_path), int(layers)))
