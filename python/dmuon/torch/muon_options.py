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
cautious_wd: the decay W·(1 − lr·wd) only where W·O ≥ 0 (update and weight agree in sign; Chen et al. 2025,
arXiv 2510.12402, as microsoft/dion's muon.py masks it), W as it is elsewhere: a flag of the engine's MuonApply.
"""

from dataclasses import dataclass

COEFFS = ("keller", "you", "polar-express")
ALGOS = ("auto", "standard", "gram")
SCALES = ("original", "match_rms_adamw", "spectral", "unit_rms")

# The keys of a Muon param group that MuonOptions freezes, with the constructor's defaults.
DEFAULTS = dict(ns_steps=5, coeffs="keller", algo="auto", scale="match_rms_adamw", extra_scale_factor=1.0,
                cautious_wd=False)
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
    steps = values.get("ns_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{where}: ns_steps must be an integer >= 1, got {steps!r}")
    factor = values.get("extra_scale_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"{where}: extra_scale_factor must be a number > 0, got {factor!r}")
    if not isinstance(values.get("cautious_wd", False), bool):
        raise ValueError(f"{where}: cautious_wd must be True or False, got {values['cautious_wd']!r}")


@dataclass(frozen=True, order=True)
class MuonOptions:
    """A Muon matrix's options, frozen from its param group (hashable and ordered: part of a bucket's key)."""
    ns_steps: int
    coeffs: str
    algo: str
    scale: str
    extra_scale_factor: float
    cautious_wd: bool

    @classmethod
    def of_group(cls, group):
        return cls(**{key: group[key] for key in KEYS})

    @property
    def newton_schulz(self):
        """The Newton–Schulz setting: matrices with equal ones share one engine handle."""
        return (self.coeffs, self.algo, self.ns_steps)

    def scale_of(self, rows, cols):
        return muon_scale(rows, cols, self.scale) * self.extra_scale_factor
