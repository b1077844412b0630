"""The one matrix model of dmuon.torch: which Muon matrices a parameter is, what each rank holds of each, who owns
it, how they are batched and how the planner costs them. The step (exchange.py), DMuon's plan (optimizer.py,
plan.py), the owner-held mode's costing (held/hold.py) and its TP/EP frame (held/tensor_parallel.py) all ask this
module, so a parameter is costed, held, split and updated as the same matrices.

The rule, for a Muon parameter `name` of global shape (d0, d1, …) and DMuon's `experts(name, shape)` predicate
(default params.is_expert_stack_by_default: a 3-D parameter with "expert" in a name component):
  2-D (m, n)                     one m × n matrix
  a stack of experts (E, m, n)   E matrices of m × n, one per expert (the predicate says so; a stack is 3-D)
  any other ≥ 3-D                one (d0, d1·d2…) matrix: a Conv1d's (out, in, k), a Conv2d's (out, in, kh, kw)
A matrix split for Newton–Schulz (MuonOptions.blocks: split_heads / split_sizes along split_dim) runs it per block.

Each matrix has one owner rank in the whole group, which alone runs its Newton–Schulz. Every rank holds a piece of
it (Piece: global rows × columns, from the parameter's layout, layout.py and placements.py: a dim-0 chunk under
FSDP2, a column block under row-wise tensor parallelism, an expert of a stack under expert parallelism, several
blocks under an uneven _StridedShard); ranks of one replica hold disjoint pieces that cover it.
"""

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from dmuon.torch.placements import Span
from dmuon.torch.variants import variant_of


def is_stack(name, global_shape, experts, where="DMuon"):
    """Whether parameter `name` is a stack of experts under the predicate `experts(name, global_shape)`;
    ValueError naming it (after `where`) when the predicate marks a parameter that is not 3-D."""
    stack = bool(experts(name, tuple(global_shape)))
    if stack and len(global_shape) != 3:
        raise ValueError(f"{where}: parameter '{name}' of shape {tuple(global_shape)} is marked a stack of experts "
                         "(the experts predicate); a stack is (E, rows, cols)")
    return stack


def stack_of(name, layout, experts):
    """is_stack for a parameter of this layout.Layout: an owner-held one is what hold_on_owners took it as (its own
    experts predicate, HeldParam.stack), so it is updated as the matrices it was costed and held as."""
    return layout.held.stack if layout.held is not None else is_stack(name, layout.global_shape, experts)


def matrices_of(global_shape, experts):
    """[(expert or None, rows, cols)]: the Muon matrices of a parameter of this shape; experts: it is
    an (E, m, n) stack of experts (else a ≥ 3-D parameter is one (out, in·k…) matrix, a conv filter)."""
    if experts:
        return [(e, global_shape[1], global_shape[2]) for e in range(global_shape[0])]
    return [(None, global_shape[0], math.prod(global_shape[1:]))]


def check_filter_layout(name, global_shape, stack, layout):
    """ValueError naming the parameter when it is one (out, in·k…) filter matrix whose layout splits its dims ≥ 1
    (piece_of takes a filter's pieces as rows of the whole filter)."""
    dims = range(1, len(global_shape))
    if len(global_shape) >= 3 and not stack and not all(h.whole_along(global_shape, dims) for h in layout.holdings):
        raise ValueError(f"DMuon: parameter '{name}' of shape {tuple(global_shape)} is one (out, in·k…) matrix for "
                         f"Muon (a filter), but its placements {layout.placements} split its dims ≥ 1 (dmuon takes "
                         "such a filter sharded on dim 0 only)")


def held_cost(name, global_shape, stack, options):
    """((rows, cols), blocks): how the owner planner costs a parameter held whole on one owner (hold_on_owners).
    (rows, cols): its matrix, or for a stack of E m × n experts (min(m, n), E·max(m, n)), the same Newton–Schulz
    flops and bytes as its E matrices together. blocks: None without split options (options None), else the
    (rows, cols) of every block of each of its matrices as the step splits them (MuonOptions.block_shapes), a
    matrix the options leave whole as one block."""
    matrices = matrices_of(global_shape, stack)
    _, rows, cols = matrices[0]
    shape = (min(rows, cols), len(matrices) * max(rows, cols)) if stack else (rows, cols)
    if options is None:
        return shape, None
    return shape, [block for _, m, n in matrices for block in options.block_shapes(m, n, name) or [(m, n)]]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one Muon matrix: its global rows and columns (placements.Span, in the order of
    the rank's local tensor) and, for an expert of a stack, the expert's local position in the stack."""

    rows: Span
    cols: Span
    position: object = None

    @property
    def count(self):
        return self.rows.count * self.cols.count

    @property
    def shape(self):
        return self.rows.count, self.cols.count


def piece_of(holding, expert, cols):
    """The Piece of a matrix `cols` wide (its place in the stack `expert`, or None) in a rank's Holding. A
    conv filter (≥ 3-D, not a stack) is held whole along its dims ≥ 1 (check_filter_layout refuses the rest)."""
    spans = holding.spans
    if expert is not None:
        position = spans[0].position_of(expert)
        return Piece(Span(()), Span(())) if position is None else Piece(spans[1], spans[2], position)
    if len(spans) == 2:
        return Piece(spans[0], spans[1])
    return Piece(spans[0], Span.whole(cols) if all(s.count for s in spans[1:]) else Span(()))


def take(matrix, piece):
    """The piece's part of matrix (rows, cols), shaped as the holder's local view and contiguous (a copy
    for a column block; the engine reads operands densely)."""
    if len(piece.rows.runs) == 1 and len(piece.cols.runs) == 1:
        (r, nr), (c, nc) = piece.rows.runs[0], piece.cols.runs[0]
        return matrix[r:r + nr, c:c + nc].contiguous()
    rows, cols = (torch.tensor(s.indices(), device=matrix.device) for s in (piece.rows, piece.cols))
    return matrix[rows[:, None], cols]


def put(matrix, piece, local):
    """Writes a holder's local view of the piece into its place in matrix (rows, cols)."""
    if len(piece.rows.runs) == 1 and len(piece.cols.runs) == 1:
        (r, nr), (c, nc) = piece.rows.runs[0], piece.cols.runs[0]
        matrix[r:r + nr, c:c + nc].copy_(local)
        return
    rows, cols = (torch.tensor(s.indices(), device=matrix.device) for s in (piece.rows, piece.cols))
    matrix[rows[:, None], cols] = local.to(matrix.dtype)


@dataclass
class MuonMatrix:
    index: int        # the parameter's position in the optimizer's agreed order
    expert: object    # its place in an (E, m, n) stack, None for a 2-D or conv parameter
    name: str         # the parameter's name, with [expert] for a stack
    layout: object    # layout.Layout of the parameter
    group: dict       # its param group (hyper-parameters are read at every step)
    rows: int         # m
    cols: int         # n
    options: object   # muon_options.MuonOptions, frozen from its group
    owner: int = -1   # group rank that runs its Newton–Schulz

    @property
    def scale(self):
        """s of DESIGN 1, from (m, n) and its options."""
        return self.options.scale_of(self.rows, self.cols)

    @property
    def blocks(self):
        """None, or (dim, sizes) of its split Newton–Schulz (muon_options.MuonOptions.blocks)."""
        return self.options.blocks(self.rows, self.cols, self.name)

    @property
    def block_shapes(self):
        """None, or the (rows, cols) of its blocks, what the owner planner costs it as (MuonOptions.block_shapes)."""
        return self.options.block_shapes(self.rows, self.cols, self.name)

    @property
    def variant(self):
        """Its Muon variant (variants/), by its options' name."""
        return variant_of(self.options)

    @property
    def width(self):
        """The columns of its variant's per-row state that travels with its pieces (0: none; Variant.width)."""
        return self.variant.width(self.options, self.rows, self.cols, self.name)

    @cached_property
    def pieces(self):
        """The Piece every group rank holds, in group rank order."""
        return tuple(piece_of(h, self.expert, self.cols) for h in self.layout.holdings)

    def holders(self):
        """Group ranks that hold all of it."""
        return [g for g, p in enumerate(self.pieces) if p.count == self.rows * self.cols]

    def local_view(self, t):
        """This rank's piece of the matrix in t, a local tensor laid out as the parameter's, as a view
        (writes reach t): (piece rows, piece cols), or t itself where its strides allow no such view (a
        channels_last filter; its row-major elements are the piece's, and muon_update.py hands the
        engine a dense copy)."""
        mine = self.pieces[self.layout.rank]
        if self.expert is not None:
            return t[mine.position]
        return t.view(mine.shape) if t.is_contiguous() else t

    def rows_view(self, r):
        """This rank's rows of the matrix in r, a local tensor laid out as the parameter's rows (the variant's
        per-row state: (rows, …) of a matrix, (E, rows, …) of a stack), as a view: (piece rows, width)."""
        return r[self.pieces[self.layout.rank].position] if self.expert is not None else r

    def rows_piece(self, group_rank):
        """The Piece of its per-row state (m, width) that a group rank holds: its rows, every column."""
        return Piece(self.pieces[group_rank].rows, Span.whole(self.width))

    @cached_property
    def u_travels(self):
        """Whether ranks of the owner's replica other than the owner hold parts of it (owner set)."""
        return self.pieces[self.owner].count < self.rows * self.cols

    @cached_property
    def o_travels(self):
        """Whether any rank other than the owner holds part of it (owner set)."""
        return any(p.count for g, p in enumerate(self.pieces) if g != self.owner)

    def replica_of(self, group_rank):
        return self.layout.holdings[group_rank].replica


def parameter_matrices(index, name, layout, group, options, stack):
    """The MuonMatrix of each non-empty matrix of parameter `index` (a stack's experts named name[e])."""
    return [MuonMatrix(index, expert, name + ("" if expert is None else f"[{expert}]"), layout, group, rows, cols,
                       options)
            for expert, rows, cols in matrices_of(layout.global_shape, stack) if rows and cols]


def assign_owners(matrices, world_size, plan):
    """Sets every matrix's owner. An owner-held one's is its holder's (hold_on_owners planned it; an expert of
    a stack held under expert parallelism: the rank of the owner's EP group that keeps it whole). One
    held whole by some ranks but not all (an expert of a stack
    sharded by experts) is owned by one of its holders, so its U never travels; an expert that no rank
    holds whole but only some ranks hold pieces of (expert parallelism × expert-FSDP) by one of those,
    so its pieces travel within them: in both cases the candidate with the fewest such matrices so far
    (in HSDP that spreads a shard's experts over its replicas). The others go to
    `plan([(rows, cols)], world_size, blocks)` (the planner, over all ranks; blocks: each one's block_shapes, the
    blocks its split Newton–Schulz runs on, None for a whole one)."""
    pinned = [0] * world_size
    free = []
    for k in matrices:
        if k.layout.held is not None:
            k.owner = k.holders()[0] if k.expert is not None else k.layout.held.owner
            pinned[k.owner] += 1
            continue
        candidates = k.holders()
        if not candidates and k.expert is not None:
            candidates = [g for g, p in enumerate(k.pieces) if p.count]
        if 0 < len(candidates) < world_size:
            k.owner = min(candidates, key=lambda g: (pinned[g], g))
            pinned[k.owner] += 1
        else:
            free.append(k)
    for k, owner in zip(free, plan([(k.rows, k.cols) for k in free], world_size, [k.block_shapes for k in free])):
        k.owner = owner


def step_bytes(rows, cols):
    """The bytes one rows × cols matrix of a Newton–Schulz batch counts for in a step's budget (DMuon(step_memory)):
    in float32, with m ≤ n its sides, its gathered U (m·n; O takes its place), its pieces of U and O on their way
    (m·n each at most: a rank sends or receives pieces of each matrix of a batch) and Newton–Schulz's iterates
    (2·m·n + 4·m², libdmuon_c's workspace per matrix of a batch on a GPU): 4·(5·m·n + 4·m²)."""
    m, n = min(rows, cols), max(rows, cols)
    return 4 * (5 * m * n + 4 * m * m)


DEFAULT_STEP_BATCHES = 2  # step_memory="auto": room for this many of the largest matrix's step_bytes,
DEFAULT_STEP_FLOOR = 256 << 20  # and never less than this: a small model's buckets stay one all-to-all each


def step_budget(matrices, step_memory):
    """The bytes a Newton–Schulz batch may count (step_bytes per matrix) on one owner, from DMuon's step_memory over
    all its Muon matrices: "auto" DEFAULT_STEP_BATCHES × the largest matrix's step_bytes or DEFAULT_STEP_FLOOR,
    the larger (cutting a small model's buckets would only add collectives), None or 0 no bound (None), else
    step_memory; ValueError naming the parameter of a matrix whose step_bytes alone exceed a budget given."""
    if not step_memory or not matrices:
        return None
    largest = max(matrices, key=lambda k: step_bytes(k.rows, k.cols))
    need = step_bytes(largest.rows, largest.cols)
    if step_memory == "auto":
        return max(DEFAULT_STEP_BATCHES * need, DEFAULT_STEP_FLOOR)
    if need > step_memory:
        raise ValueError(f"DMuon: step_memory={step_memory} bytes is below one matrix's step buffers: parameter "
                         f"'{largest.name}' ({largest.rows}×{largest.cols}) needs {need} (matrices.step_bytes); give "
                         f"step_memory ≥ {need}, or None for no bound")
    return step_memory


def buckets_of(matrices, state_dtype_of, budget=None):
    """Muon matrices batched by (rows, cols, momentum dtype, device, owner-held, options), largest
    Newton–Schulz work first (its communication then overlaps the smaller buckets' Newton–Schulz);
    ties in a fixed order. Owner-held matrices get buckets of their own, which move nothing. budget (step_budget's
    bytes; None: no bound) cuts each into consecutive buckets of at most budget // step_bytes matrices per owner."""
    by_key = {}
    for k in matrices:
        key = (k.rows, k.cols, str(state_dtype_of(k)), k.layout.local(k.layout.tensor).device.type,
               k.layout.held is not None, k.options)
        by_key.setdefault(key, []).append(k)

    def work(key):
        rows, cols = key[0], key[1]
        m, n = min(rows, cols), max(rows, cols)
        return (-len(by_key[key]) * m * m * n, key[:-1], repr(key[-1]))
    return [part for key in sorted(by_key, key=work) for part in _cut(by_key[key], budget)]


def _cut(bucket, budget):
    """bucket (same-shape matrices) as consecutive parts of at most budget // step_bytes matrices of each owner, in
    bucket order (each owner's j-th matrix in part j // that): [bucket] for budget None."""
    if budget is None:
        return [bucket]
    per_owner = max(1, budget // step_bytes(bucket[0].rows, bucket[0].cols))
    parts, seen = [], {}
    for k in bucket:
        j = seen.get(k.owner, 0)
        seen[k.owner] = j + 1
        if j // per_owner == len(parts):
            parts.append([])
        parts[j // per_owner].append(k)
    return parts


def newton_schulz_blocks(stack, owned, newton_schulz):
    """O in place of U on stack (K, rows, cols), contiguous: newton_schulz(matrices, names) of each matrix, or of
    each of its blocks (the bucket's split, MuonMatrix.blocks), all blocks of one shape in one call."""
    first = owned[0]
    if first.blocks is None:
        newton_schulz(list(stack), [k.name for k in owned])
        return
    dim, sizes = first.blocks
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    for size in dict.fromkeys(sizes):  # each distinct block size once, in order
        where = [(j, start) for j in range(len(owned)) for start, s in zip(starts, sizes) if s == size]
        views = [stack[j].narrow(dim, start, size) for j, start in where]  # (size, cols) or (rows, size)
        # row blocks are contiguous parts of the stack; column blocks are gathered and put back
        blocks = views if dim == 0 else list(torch.stack(views))
        newton_schulz(blocks, [f"{owned[j].name}:{('rows', 'cols')[dim]} {start}+{size}" for j, start in where])
        if dim == 1:
            for view, block in zip(views, blocks):
                view.copy_(block)


def scale_blocks(stack, first):
    """Each block of a split bucket's stack (K, rows, cols) times s(block) / s(matrix), as if each block were a
    parameter (the apply scales by s(matrix)); nothing for a whole matrix."""
    if first.blocks is None:
        return
    dim, sizes = first.blocks
    start = 0
    for size in sizes:
        block = stack.narrow(dim + 1, start, size)
        ratio = first.options.scale_of(*block.shape[1:]) / first.scale
        if ratio != 1.0:
            block.mul_(ratio)
        start += size
