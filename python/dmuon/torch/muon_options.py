"""Muon's options per param group (docs/pytorch.md, "Muon options per param group"): what a Muon matrix's
update does besides the hyper-parameters a scheduler may change. Every option is a key of a Muon param
group, the constructor's value its default; when the optimizer tracks a matrix it freezes its group's
values into a MuonOptions, which picks the matrix's Newton–Schulz (one engine handle per distinct
setting), its update scale and its apply rule, and is part of its bucket's key (a bucket batches only
matrices with equal options).

Update scales s (W ← W·(1 − lr·wd) − lr·s·O, O = orth(U) of an m × n matrix), times extra_scale_factor:
  original         √max(1, m/n)        KellerJordan/Muon; torch.optim.Muon adjust_lr_fn="original";
                                        Megatron scale_mode="shape_scaling"
  match_rms_adamw  0.2·√max(m, n)      Moonlight; torch.optim.Muon "match_rms_adamw"; dion adjust_lr="rms_norm"
  spectral         √(m/n)              O's RMS→RMS operator norm 1 (Scion): torch.optim.Muon
                                        "spectral_unclamped", dion "spectral_norm", Megatron "unit_rms_norm"
  unit_rms         √max(m, n)          O's element RMS 1 (O has min(m, n) unit singular values):
                                        Megatron's scale_mode="spectral" (its name, our "unit_rms")
Split Newton–Schulz (split_heads=H or split_sizes=[...], along split_dim 0: rows, 1: columns): O is the
Newton–Schulz of each block of the matrix on its own (q/k/v by their heads' output rows, o by its heads'
input columns, a fused qkv or gate_up by given sizes), each block scaled by its own shape's s, as if each
block were a parameter of its own (microsoft/dion's num_heads and split_sizes, which split rows only).
cautious_wd: the decay W·(1 − lr·wd) only where W·O ≥ 0 (update and weight agree in sign; Chen et al. 2025,
arXiv 2510.12402, as microsoft/dion's muon.py masks it), W as it is elsewhere: a flag of the engine's MuonApply.
variant: a name of variants.VARIANTS: "muon", or "normuon" (NorMuon, arXiv 2510.05491, as microsoft/dion's
normuon.py): O normalized per row by a running second moment with decay normuon_beta2 before the scale
(variants/normuon.py; per block for a split matrix). Each variant's own options (normuon_beta2) are keys of every
Muon param group too, with the defaults its module declares.
"""

from dataclasses import dataclass

from dmuon.torch.variants import VARIANTS

COEFFS = ("keller", "you", "polar-express")
ALGOS = ("auto", "standard", "gram")
SCALES = ("original", "match_rms_adamw", "spectral", "unit_rms")

# The keys of a Muon param group that MuonOptions freezes, with the constructor's defaults (DMuon's and
# hold_on_owners' split): this module's, then each variant's own (variants/).
VARIANT_OPTIONS = {key: value for variant in VARIANTS.values() for key, value in variant.options.items()}
DEFAULTS = dict(ns_steps=5, coeffs="keller", algo="auto", scale="match_rms_adamw", extra_scale_factor=1.0,
                cautious_wd=False, split_heads=None, split_sizes=None, split_dim=0, variant="muon", **VARIANT_OPTIONS)
KEYS = tuple(DEFAULTS)


def muon_scale(rows, cols, kind):
    """s of this module's table for an m × n = rows × cols matrix; ValueError for an unknown kind."""
    if kind == "original":
        return max(1.0, rows / cols) ** 0.5
    if kind == "match_rms_adamw":
        return 0.2 * max(rows, cols) ** 0.5
    if kind == "spectral":
        return (rows / cols) ** 0.5
    if kind == "unit_rms":
        return max(rows, cols) ** 0.5
    raise ValueError(f"DMuon: scale must be one of {', '.join(SCALES)}; got {kind!r}")


def check_options(values, where):
    """ValueError naming `where` (a param group, or "DMuon") for a bad value of any key of KEYS in `values`."""
    def choice(key, choices):
        if key in values and values[key] not in choices:
            raise ValueError(f"{where}: {key} must be one of {', '.join(choices)}; got {values[key]!r}")

    choice("coeffs", COEFFS)
    choice("algo", ALGOS)
    choice("scale", SCALES)
    choice("variant", tuple(VARIANTS))
    for variant in VARIANTS.values():
        variant.check(values, where)
    steps = values.get("ns_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{where}: ns_steps must be an integer >= 1, got {steps!r}")
    factor = values.get("extra_scale_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
        raise ValueError(f"{where}: extra_scale_factor must be a finite number > 0, got {factor!r}")
    if not isinstance(values.get("cautious_wd", False), bool):
        raise ValueError(f"{where}: cautious_wd must be True or False, got {values['cautious_wd']!r}")
    heads, sizes = values.get("split_heads"), values.get("split_sizes")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"{where}: split_heads must be an integer >= 1 or None, got {heads!r}")
    if sizes is not None and (not isinstance(sizes, (list, tuple)) or len(sizes) < 2 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)):
        raise ValueError(f"{where}: split_sizes must be a list of two or more integers >= 1 or None, got {sizes!r}")
    if heads is not None and sizes is not None:
        raise ValueError(f"{where}: split_heads and split_sizes are two ways of one split: set one")
    if values.get("split_dim", 0) not in (0, 1):
        raise ValueError(f"{where}: split_dim must be 0 (rows) or 1 (columns), got {values['split_dim']!r}")


@dataclass(frozen=True)
class MuonOptions:
    """A Muon matrix's options, frozen from its param group (hashable: part of a bucket's key)."""
    ns_steps: int
    coeffs: str
    algo: str
    scale: str
    extra_scale_factor: float
    cautious_wd: bool
    split_heads: object   # int or None
    split_sizes: object   # tuple of ints or None
    split_dim: int
    variant: str
    variant_options: tuple  # ((key, value), ...) of every variant's options, in DEFAULTS' order

    @classmethod
    def of_group(cls, group):
        values = {key: group[key] for key in KEYS if key not in VARIANT_OPTIONS}
        if values["split_sizes"] is not None:
            values["split_sizes"] = tuple(values["split_sizes"])
        return cls(**values, variant_options=tuple((key, group[key]) for key in VARIANT_OPTIONS))

    def option(self, key):
        """The value of a variant's option (VARIANT_OPTIONS)."""
        return dict(self.variant_options)[key]

    @property
    def newton_schulz(self):
        """The Newton–Schulz setting: matrices with equal ones share one engine handle."""
        return (self.coeffs, self.algo, self.ns_steps)

    def scale_of(self, rows, cols):
        return muon_scale(rows, cols, self.scale) * self.extra_scale_factor

    def blocks(self, rows, cols, name):
        """None (no split), or (dim, sizes): the blocks of a rows × cols matrix along dim. ValueError naming
        the matrix when the split does not fit it."""
        if self.split_heads is None and self.split_sizes is None:
            return None
        length = (rows, cols)[self.split_dim]
        what = f"DMuon: '{name}' ({rows}×{cols}) has {length} {('rows', 'columns')[self.split_dim]}"
        if self.split_heads is not None:
            if length % self.split_heads:
                raise ValueError(f"{what}, not a multiple of split_heads={self.split_heads}")
            return self.split_dim, (length // self.split_heads,) * self.split_heads
        if sum(self.split_sizes) != length:
            raise ValueError(f"{what}, but split_sizes {list(self.split_sizes)} sum to {sum(self.split_sizes)}")
        return self.split_dim, self.split_sizes

    def block_shapes(self, rows, cols, name):
        """None (no split), or the (rows, cols) of each of blocks()'s blocks, in order: what the owner planner
        costs the matrix as (dmuon.plan_owners's blocks)."""
        blocks = self.blocks(rows, cols, name)
        if blocks is None:
            return None
        dim, sizes = blocks
        return [(size, cols) if dim == 0 else (rows, size) for size in sizes]
