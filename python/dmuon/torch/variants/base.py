"""A Muon variant's protocol, and plain Muon (DESIGN 1): what the step (exchange.py) and DMuon's state (optimizer.py)
ask of the variant a matrix's options name (variants/__init__.py), and nothing about where the pieces are.

  options                {key: default}: its own options, keys of a Muon param group (muon_options.DEFAULTS adds
                         them); check(values, where) refuses bad values of them, naming `where`
  row_state              None, or the key of its per-row state in the optimizer state: laid out as the
                         parameter's rows ((m, width) of a matrix, (E, m, width) of a stack, (out, width) of a
                         filter), a DTensor of the parameter's mesh where the parameter is one (zero_state makes
                         it). Every holder's rows of it travel to the owner with its piece of U and back with its
                         piece of O, so the owner sees the matrix's whole rows
  width(options, rows, cols, name)   its per-row state's columns (0: none)
  zero_state(layout, stack, width, dtype)   {key: zero tensor} of a parameter's state besides the momentum
  rewrites_o             whether after_orthogonalize changes O (else a matrix held whole here takes the engine's
                         one-call update: momentum, Newton–Schulz and apply)
  after_orthogonalize(o, rows, first, keep)   on the owner, after Newton–Schulz and before the blocks' scales:
                         o (K, m, n) the bucket's O, rows (K, m, width) their per-row state (None without), first
                         the bucket's first MuonMatrix (its options and blocks are the bucket's), keep() the
                         matrices' keep flags (K,) (0: leave their state as it was)
"""


class Muon:
    """Muon: O as Newton–Schulz leaves it, no state besides the momentum."""

    options = {}
    row_state = None
    rewrites_o = False

    def check(self, values, where):
        pass

    def width(self, options, rows, cols, name):
        return 0

    def zero_state(self, layout, stack, width, dtype):
        return {}

    def after_orthogonalize(self, o, rows, first, keep):
        pass
