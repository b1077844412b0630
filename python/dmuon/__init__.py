"""dmuon: distributed Muon computed by dmuon's C++ engine.

    import dmuon            # the engine: Orthogonalizer, plan_owners, tune, model_params (no torch needed)
    import dmuon.torch      # dmuon.torch.DMuon, a torch.optim optimizer over torch.distributed

libdmuon_c is loaded on first use (library_error() says whether it loads), so a torch-only install without it
still imports dmuon.torch and runs DMuon with its torch engine.

See docs/pytorch.md.
"""

from dmuon._capi import (
    DEVICE_CPU,
    DEVICE_CUDA,
    DTYPE_BF16,
    DTYPE_F32,
    DmuonError,
    Orthogonalizer,
    UnsupportedError,
    adamw_step,
    default_tune_cache_path,
    engine_bytes,
    library_error,
    model_params,
    muon_apply,
    muon_momentum,
    plan_owners,
    release_workspaces,
    supports,
    tune,
    tuning_chooses_dtype,
)

__version__ = "0.1.0"

__all__ = [
    "DEVICE_CPU", "DEVICE_CUDA", "DTYPE_BF16", "DTYPE_F32", "DmuonError", "Orthogonalizer", "UnsupportedError",
    "adamw_step", "default_tune_cache_path", "engine_bytes", "library_error", "model_params", "muon_apply",
    "muon_momentum", "plan_owners", "release_workspaces", "supports", "tune",
    "tuning_chooses_dtype",
]
