"""dmuon.torch with the GPU-only build's libdmuon_c (cmake/gpu_only.cmake), configured as on the GPU machine with
every Debian library hidden (no OpenBLAS, CBC or nlohmann-json); run by tests/project/gpu_only_build_test.cmake with
PYTHONPATH=<that build>/python on this machine without a GPU. What the library lacks is said, nothing fails quietly:
it has no CPU backend (CPU tensors are refused by the C ABI, naming OpenBLAS), `import dmuon.torch; DMuon(model)`
steps CPU tensors with the torch engine after one warning, the milp balancer falls back to LPT, a tuning cache file
is left alone, and a model manifest cannot be read. Exit status 0 when every check holds."""

import os
import pathlib
import sys
import tempfile
import warnings

import torch

import dmuon
from dmuon.torch import DMuon


def raises(fn, kind, *words):
    """fn() raises `kind` whose message holds every word."""
    try:
        fn()
    except kind as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, f"{kind.__name__} without {missing}: {e}"
        return
    raise AssertionError(f"no {kind.__name__} from {fn}")


assert dmuon.library_error() is None, dmuon.library_error()
assert "DMUON_C_LIBRARY" not in os.environ  # the library beside the package, in the GPU-only build's python/
assert not dmuon.supports(dmuon.DEVICE_CPU, dmuon.DTYPE_F32) and not dmuon.supports(dmuon.DEVICE_CPU, dmuon.DTYPE_BF16)
assert not dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_BF16)  # no GPU here

# The C ABI refuses CPU tensors, naming what the build lacks.
u = torch.randn(16, 32)
ns = dmuon.Orthogonalizer(tune_cache=None)
raises(lambda: ns.run([u], [torch.empty_like(u)], 16, 32), dmuon.UnsupportedError, "no CPU backend", "OpenBLAS")

# The planner without CBC: milp falls back to LPT (longest first: the 64x64 matrices on different ranks).
owners, tuned = dmuon.plan_owners([(64, 64), (64, 64), (8, 8)], 2, balancer="milp", costs="flop")
assert sorted(owners[:2]) == [0, 1] and not tuned, owners

# Without nlohmann-json: no manifest, and a tuning cache file is neither read nor replaced.
raises(lambda: dmuon.model_params("qwen2.5-0.5b"), dmuon.UnsupportedError, "qwen2.5-0.5b", "nlohmann-json")
with tempfile.TemporaryDirectory() as folder:
    cache = pathlib.Path(folder) / "tune.json"
    cache.write_text('{"format": "dmuon-tune"}')
    with_cache = dmuon.Orthogonalizer(tune_cache=str(cache))
    assert "no JSON library" in with_cache.warning and str(cache) in with_cache.warning, with_cache.warning
    assert cache.read_text() == '{"format": "dmuon-tune"}'

# import dmuon.torch; DMuon(model): on CPU tensors the torch engine, with one warning saying why.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = DMuon(model)
assert opt.engine.name == "torch", opt.engine.name
assert [w for w in caught if "device cpu: this build of libdmuon_c has no Newton-Schulz backend for it (it runs on no "
        "device of this machine)" in str(w.message) and "engine='torch'" in str(w.message)], [str(w.message) for w in caught]
before = [p.detach().clone() for p in model.parameters()]
model(torch.randn(4, 32)).square().mean().backward()
opt.step()
assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
assert opt.last_stats["ns_matrices"] == 2
# engine="dmuon" cannot run on CPU tensors here: refused with the reason.
raises(lambda: DMuon(model, engine="dmuon").step(), Exception, "device cpu", "no Newton-Schulz backend")
print("gpu_only_capi_check: the GPU-only libdmuon_c says what it lacks, and DMuon steps with the torch engine")
sys.exit(0)
