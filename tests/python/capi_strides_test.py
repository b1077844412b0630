"""The C ABI refuses strided memory by name (include/dmuon/dmuon_c.h: every tensor argument with a contiguity
flag), single process (pytest; numpy and torch):

  arrays     strided numpy arrays (a column slice, a transposed matrix) and torch tensors (transposed,
             channels_last) given to dmuon_ns_run, dmuon_muon_momentum, dmuon_muon_apply,
             dmuon_muon_update and dmuon_adamw_step through python/dmuon: DmuonError naming the argument
             ("w[1] is not dense row-major memory"), and no array changed; the same arrays made dense run
  raw calls  the exported functions through ctypes with a contiguity flag 0 name the argument, and a NULL
             flag array names the flag array
"""

import ctypes

import numpy as np
import pytest
import torch

import dmuon
from dmuon import _capi

F32 = dmuon.DTYPE_F32


def rng_array(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def strided_numpy(rows, cols, seed, kind):
    """A (rows, cols) float32 array that is not C-contiguous: a column slice or a transposed matrix."""
    if kind == "column slice":
        return rng_array((rows, 2 * cols), seed)[:, ::2]
    return rng_array((cols, rows), seed).T


def strided_torch(rows, cols, seed, kind):
    if kind == "transposed":
        return torch.randn(cols, rows, generator=torch.Generator().manual_seed(seed)).t()
    # channels_last (rows, cols/4, 2, 2): as a flat tensor its elements are in another order
    t = torch.randn(rows, cols // 4, 2, 2, generator=torch.Generator().manual_seed(seed))
    return t.contiguous(memory_format=torch.channels_last)


def snapshot(arrays):
    return [np.array(a, copy=True) if isinstance(a, np.ndarray) else a.clone() for a in arrays]


def unchanged(arrays, before):
    return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else torch.equal(a, b) for a, b in zip(arrays, before))


def call(function, tensors):
    """Calls C ABI `function` through python/dmuon on tensors {argument: [arrays]} of 4×8 float32 matrices."""
    keep, n = None, len(tensors["w"])
    if function == "ns_run":
        dmuon.Orthogonalizer(threads=1, tune_cache=None).run(tensors["grads"], tensors["w"], 4, 8)
    elif function == "muon_momentum":
        dmuon.muon_momentum([32] * n, tensors["grads"], tensors["momenta"], tensors["w"], keep, None, 0.9, True)
    elif function == "muon_apply":
        dmuon.muon_apply([32] * n, tensors["w"], tensors["grads"], keep, 0.02, 0.01, [1.0] * n)
    elif function == "muon_update":
        dmuon.Orthogonalizer(threads=1, tune_cache=None).muon_update(
            tensors["grads"], tensors["momenta"], tensors["w"], 4, 8, keep, None, 0.9, True, 0.02, 0.01, 1.0)
    elif function == "adamw_step":  # one tensor each: the last ones
        dmuon.adamw_step(tensors["w"][-1], tensors["grads"][-1], tensors["momenta"][-1], tensors["v"][-1], 32, 1,
                         1e-3, (0.9, 0.999), 1e-8, 0.0)


# What each function calls its tensor arguments, for the test's names grads, momenta, w, v.
NAMES = {
    "ns_run": {"grads": "in[{i}]", "w": "out[{i}]"},
    "muon_momentum": {"grads": "grads[{i}]", "momenta": "momenta[{i}]", "w": "u[{i}]"},
    "muon_apply": {"grads": "o[{i}]", "w": "w[{i}]"},
    "muon_update": {"grads": "grads[{i}]", "momenta": "momenta[{i}]", "w": "w[{i}]"},
    "adamw_step": {"grads": "grad", "momenta": "exp_avg", "v": "exp_avg_sq", "w": "p"},
}


def dense_tensors(library, seed):
    make = (lambda s: rng_array((4, 8), s)) if library == "numpy" else \
        (lambda s: torch.randn(4, 8, generator=torch.Generator().manual_seed(s)))
    return {arg: [make(seed + 10 * k + i) for i in range(2)] for k, arg in enumerate(("grads", "momenta", "w", "v"))}


@pytest.mark.parametrize("function", NAMES)
@pytest.mark.parametrize("library, kind", [("numpy", "column slice"), ("numpy", "transposed"),
                                           ("torch", "transposed"), ("torch", "channels_last")])
def test_a_strided_array_is_refused_by_name_and_nothing_changes(function, library, kind):
    for argument, spelled in NAMES[function].items():
        tensors = dense_tensors(library, 0)
        strided = strided_numpy(4, 8, 99, kind) if library == "numpy" else strided_torch(4, 8, 99, kind)
        tensors[argument][1] = strided  # the second tensor of this argument
        everything = [t for ts in tensors.values() for t in ts]
        before = snapshot(everything)
        with pytest.raises(dmuon.DmuonError, match=r"\b" + spelled.format(i=1).replace("[", r"\[").replace("]", r"\]")
                           + " is not dense row-major memory"):
            call(function, tensors)
        assert unchanged(everything, before), (function, argument)


@pytest.mark.parametrize("function", NAMES)
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_the_same_arrays_made_dense_run(function, library):
    tensors = dense_tensors(library, 0)
    before = snapshot(tensors["w"])
    call(function, tensors)
    assert not unchanged(tensors["w"][-1:], before[-1:])


def test_raw_calls_name_a_strided_argument_and_missing_flags():
    lib = _capi.library()
    w, o = rng_array((2, 8), 1), rng_array((2, 8), 2)
    sizes = _capi._i64_array([16])
    pointers = _capi._pointers
    dtypes = _capi._ints([F32])
    for w_flag, o_flag, needle in ((1, 0, "o[0] is not dense row-major memory"),
                                   (0, 1, "w[0] is not dense row-major memory")):
        code = lib.dmuon_muon_apply(dmuon.DEVICE_CPU, None, 1, sizes, pointers([w.ctypes.data]), dtypes,
                                    _capi._ints([w_flag]), pointers([o.ctypes.data]), dtypes, _capi._ints([o_flag]),
                                    None, 0.02, 0.0, (ctypes.c_double * 1)(1.0), 0)
        assert code == 1 and needle in lib.dmuon_last_error().decode()
    code = lib.dmuon_muon_apply(dmuon.DEVICE_CPU, None, 1, sizes, pointers([w.ctypes.data]), dtypes, None,
                                pointers([o.ctypes.data]), dtypes, _capi._ints([1]), None, 0.02, 0.0,
                                (ctypes.c_double * 1)(1.0), 0)
    assert code == 1 and "w_dense (the contiguity flags of w) must be given" in lib.dmuon_last_error().decode()
    flags = _capi._ints([1, 1, 0, 1])
    code = lib.dmuon_adamw_step(dmuon.DEVICE_CPU, F32, None, w.ctypes.data, o.ctypes.data, w.ctypes.data,
                                o.ctypes.data, flags, 16, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0)
    assert code == 1 and "dmuon_adamw_step: exp_avg is not dense" in lib.dmuon_last_error().decode()
    assert np.array_equal(w, rng_array((2, 8), 1)) and np.array_equal(o, rng_array((2, 8), 2))
