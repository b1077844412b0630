"""The Muon half of one DMuon step (DESIGN 1, 3 and 7 "all-to-all after the fact") for every layout.

A Muon parameter is one or more matrices: a 2-D parameter is one (m, n) matrix, a 3-D (E, m, n)
stack of experts (the optimizer's `experts` predicate says which) is E matrices of (m, n), any other
≥ 3-D parameter (a Conv1d's (out, in, k), a Conv2d's (out, in, kh, kw)) one (out, in·k…) matrix. Each
matrix has one owner rank in the whole group, which alone runs its Newton–Schulz. Every rank holds a
piece of it (Piece: global rows × columns, from the parameter's layout, layout.py and placements.py:
a dim-0 chunk under FSDP2, a column block under row-wise tensor parallelism, an expert of a stack
under expert parallelism, several blocks under an uneven _StridedShard); ranks of one replica hold
disjoint pieces that cover it. Per bucket of same-shape matrices:
  launch:  every rank forms momentum and U on its local pieces (the momentum mirrors the parameter's
           local layout on every replica); the ranks of the owner's replica send their pieces of U to
           the owner (one all_to_all_single over the group, uneven splits, async)
  compute: the owner assembles its full matrices, runs Newton–Schulz once for all of them (one
           batched engine call), and sends every other rank holding a piece of a matrix, in every
           replica, its piece of O (a second all_to_all_single, async)
  finish:  every rank applies its pieces of O: W ← W·(1 − lr·wd) − lr·s·O
NorMuon's matrices (normuon.py) send their rows of v with their pieces of U and get them back, updated by the
owner's normalization of O, with their pieces of O (in those two all-to-alls).
Each phase is one engine call (engine.py): per param group of the bucket the momentum of every
local part and the apply of every local part, per bucket the Newton–Schulz of the owner's stack. A
bucket whose matrices this rank owns and alone holds (owner-held ones, every bucket of a one-rank
group) skips the phases: one engine call per param group does momentum, Newton–Schulz and apply,
while the first travelling bucket's pieces are in flight.
Owner-held TP slices (held/tensor_parallel.py) are pieces like any other: those of the owner's TP
group travel to the owner and back, and a rank that keeps none of a bucket's matrices still joins its
exchanges (with nothing to send).
So every matrix is orthogonalized once in the whole job and all replicas apply the same O (their
weights stay bit-identical). A matrix its owner holds whole (a replicated parameter, an expert of a
stack sharded by experts) sends no U; a collective with nothing to move on any rank is not called.
Order: launch(0); then for each bucket b: launch(b+1), compute(b), finish(b−1); so bucket b+1's pieces
travel while bucket b's Newton–Schulz runs.
"""

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from dmuon.torch.muon_update import StepValues
from dmuon.torch.normuon import block_views, normalize, pack, packed_numel, unpack
from dmuon.torch.normuon import width as normuon_width
from dmuon.torch.ns_clock import NsClock
from dmuon.torch.placements import Span


def matrices_of(global_shape, experts):
    """[(expert or None, rows, cols)]: the Muon matrices of a parameter of this shape; experts: it is
    an (E, m, n) stack of experts (else a ≥ 3-D parameter is one (out, in·k…) matrix, a conv filter)."""
    if experts:
        return [(e, global_shape[1], global_shape[2]) for e in range(global_shape[0])]
    return [(None, global_shape[0], math.prod(global_shape[1:]))]


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
    conv filter (≥ 3-D, not a stack) is held whole along its dims ≥ 1 (the optimizer refuses the rest)."""
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
    def width(self):
        """B, the columns of its NorMuon v (normuon.width)."""
        return normuon_width(self.options, self.rows, self.cols, self.name)

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

    def rows_view(self, v):
        """This rank's rows of the matrix's NorMuon v in v, the parameter's local v (normuon.py), as a view:
        (piece rows, B)."""
        return v[self.pieces[self.layout.rank].position] if self.expert is not None else v

    def v_piece(self, group_rank):
        """The Piece of its v (m, B) that a group rank holds: its rows, every column."""
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


class MuonStep:
    """One step's Muon updates. `momentum(index)` is the parameter's local momentum buffer (state
    dtype), `grads[index]` its local gradient (None: zeros), `check` the step's GradientCheck (its
    clipping factor, and per parameter whether it is updated: device tensors), `engine` the arithmetic
    (engine.py), `ns_of(options)` its Newton–Schulz handle of a matrix's MuonOptions (a bucket's matrices share
    theirs), `state_dtype_of(matrix)` its momentum's (U's) dtype, `variance(index)` a NorMuon parameter's local v
    (normuon.py; state dtype)."""

    def __init__(self, comm, engine, ns_of, momentum, grads, check, state_dtype_of, variance):
        self.comm, self.engine, self.ns_of, self.momentum, self.grads = comm, engine, ns_of, momentum, grads
        self.state_dtype_of, self.variance = state_dtype_of, variance
        self.values = StepValues(check)
        self.ns_clock = NsClock()  # Newton–Schulz's time (device time on CUDA, not the enqueueing's)
        self.ns_matrices = 0

    def run(self, buckets):
        me = self.comm.rank
        buckets = [b for b in buckets if b]
        alone = [all(k.owner == me and not k.u_travels and not k.o_travels for k in b) for b in buckets]
        travelling = [b for b, a in zip(buckets, alone) if not a]
        launched = self._launch(travelling[0]) if travelling else None
        for bucket in (b for b, a in zip(buckets, alone) if a):  # while the first bucket's pieces travel
            self._update_held(bucket)
        previous = None
        for k in range(len(travelling)):
            following = self._launch(travelling[k + 1]) if k + 1 < len(travelling) else None
            current = self._compute(travelling[k], launched)
            if previous is not None:
                self._finish(*previous)
            previous = (travelling[k], current)
            launched = following
        if previous is not None:
            self._finish(*previous)

    # ---- per parameter group of a bucket (hyper-parameters are the group's) ----

    @staticmethod
    def _by_group(items, group_of):
        """items split by param group, in first-seen order."""
        out = {}
        for item in items:
            out.setdefault(id(group_of(item)), []).append(item)
        return list(out.values())

    def _form_u(self, indices, groups):
        """{index: U} of parameters `indices` (groups[index] their param group) on this rank's local
        tensors, shaped as them, in the momentum's dtype: one engine call per param group."""
        u = {}
        for part in self._by_group(indices, lambda i: groups[i]):
            group = groups[part[0]]
            entries = [(i, self.momentum(i), self.grads[i]) for i in part]
            u.update(zip(part, self.engine.momentum(entries, group["momentum"], group["nesterov"], self.values)))
        return u

    def _apply(self, pairs):
        """The update of this rank's pieces of matrices from their pieces of O, for (k, O piece) pairs: one
        engine call per param group."""
        for part in self._by_group(pairs, lambda pair: pair[0].group):
            group = part[0][0].group
            entries = [(k.index, k.local_view(k.layout.local(k.layout.tensor)), update, k.scale) for k, update in part]
            self.engine.apply(entries, group["lr"], group["weight_decay"], self.values, part[0][0].options.cautious_wd)

    def _update_held(self, bucket):
        """The whole update of matrices this rank holds whole and alone (nothing travels): momentum,
        Newton–Schulz and apply in one engine call per param group (three for matrices split in blocks or
        NorMuon's, normalized between Newton–Schulz and the apply)."""
        if bucket[0].blocks is not None or bucket[0].options.normuon:
            u = self._form_u(list({k.index: None for k in bucket}), {k.index: k.group for k in bucket})
            like = next(iter(u.values()))
            ns_dtype = self.engine.ns_dtype(like.device, like.dtype)
            full = torch.stack([k.local_view(u[k.index]) for k in bucket]).to(ns_dtype)
            variance = None
            if bucket[0].options.normuon:
                variance = torch.stack([k.rows_view(self.variance(k.index)) for k in bucket])
            self._orthogonalize(full, bucket, variance)
            if variance is not None:
                for k, v in zip(bucket, variance):
                    k.rows_view(self.variance(k.index)).copy_(v)
            self._apply(list(zip(bucket, full)))
            return
        for part in self._by_group(bucket, lambda k: k.group):
            entries = []
            for k in part:
                grad = self.grads[k.index]
                entries.append((k.index, k.local_view(k.layout.local(k.layout.tensor)),
                                k.local_view(self.momentum(k.index)), None if grad is None else k.local_view(grad)))
            t0 = self.ns_clock.start(entries[0][1].device)
            self.engine.update(self.ns_of(part[0].options), entries, part[0].rows, part[0].cols, part[0].group,
                               part[0].scale, part[0].options.cautious_wd, self.values, [k.name for k in part])
            self.ns_clock.stop(t0)
            self.ns_matrices += len(part)

    def _orthogonalize(self, stack, owned, variance=None):
        """O in place of U on stack (K, rows, cols), contiguous, in the engine's dtype: Newton–Schulz of each
        matrix, or of each of its blocks (the bucket's split, MuonMatrix.blocks), all blocks of one shape in one
        engine call; NorMuon's normalized (normuon.py) with their v, variance (K, rows, B), updated in place;
        each block then scaled by s(block) / s(matrix) (the apply scales by s(matrix))."""
        if stack.shape[0] == 0:
            return
        t0 = self.ns_clock.start(stack.device)
        first = owned[0]
        if first.blocks is None:
            self._newton_schulz(list(stack), [k.name for k in owned], first.options)
        else:
            dim, sizes = first.blocks
            starts = [sum(sizes[:b]) for b in range(len(sizes))]
            for size in dict.fromkeys(sizes):  # each distinct block size once, in order
                where = [(j, start) for j in range(len(owned)) for start, s in zip(starts, sizes) if s == size]
                views = [stack[j].narrow(dim, start, size) for j, start in where]  # (size, cols) or (rows, size)
                # row blocks are contiguous parts of the stack; column blocks are gathered and put back
                blocks = views if dim == 0 else list(torch.stack(views))
                self._newton_schulz(blocks, [f"{owned[j].name}:{('rows', 'cols')[dim]} {start}+{size}"
                                             for j, start in where], first.options)
                if dim == 1:
                    for view, block in zip(views, blocks):
                        view.copy_(block)
        if variance is not None:
            keep = self.values.keep_of([k.index for k in owned])
            for o, v in block_views(stack, variance, first.blocks):
                normalize(o, v, first.options.normuon_beta2, keep)
        if first.blocks is not None:
            for start, size in zip(starts, sizes):
                block = stack.narrow(dim + 1, start, size)
                ratio = first.options.scale_of(*block.shape[1:]) / first.scale
                if ratio != 1.0:
                    block.mul_(ratio)
        self.ns_clock.stop(t0)
        self.ns_matrices += stack.shape[0]

    def _newton_schulz(self, matrices, names, options):
        """Newton–Schulz in place on same-shape contiguous 2-D tensors, one engine call."""
        self.engine.orthogonalize(self.ns_of(options), matrices, names)

    # ---- per bucket (same rows, cols, momentum dtype, device and options) ----

    def _like(self, bucket, u):
        """A tensor of U's dtype and device for the bucket (this rank may hold none of its matrices: an
        owner-held TP matrix of another TP group)."""
        if u:
            return next(iter(u.values()))
        k = bucket[0]
        return torch.empty(0, dtype=self.state_dtype_of(k), device=k.layout.local(k.layout.tensor).device)

    def _launch(self, bucket):
        c, me = self.comm, self.comm.rank
        groups = {k.index: k.group for k in bucket if not k.layout.held_elsewhere}
        u = self._form_u(list(groups), groups)
        if not any(k.u_travels for k in bucket):
            return u, None, None
        # Send: my piece of U of every matrix whose owner is another rank of my replica (NorMuon's: and then
        # my rows of its v, in U's dtype, the state's); the owner receives, per source rank in rank order, that
        # rank's pieces of its matrices in bucket order.
        normuon = bucket[0].options.normuon
        to_owner = [[] for _ in range(c.world)]
        out_numel = [0] * c.world
        for k in bucket:
            if k.owner == me:
                for src, piece in enumerate(k.pieces):
                    if src != me and k.replica_of(src) == k.replica_of(me):
                        out_numel[src] += piece.count + (k.v_piece(src).count if normuon else 0)
            elif k.replica_of(k.owner) == k.replica_of(me) and k.pieces[me].count:
                to_owner[k.owner].append(k.local_view(u[k.index]).reshape(-1))
                if normuon:
                    to_owner[k.owner].append(k.rows_view(self.variance(k.index)).reshape(-1))
        parts = [t for dest in to_owner for t in dest]
        in_numel = [sum(t.numel() for t in dest) for dest in to_owner]
        like = self._like(bucket, u)
        send = torch.cat(parts) if parts else like.new_empty(0)
        recv, work = c.all_to_all(send, out_numel, in_numel)
        return u, recv, work

    def _compute(self, bucket, launched):
        c, me = self.comm, self.comm.rank
        u, recv, work = launched
        if work is not None:
            work.wait()
        owned = [k for k in bucket if k.owner == me]
        normuon = bucket[0].options.normuon
        like = self._like(bucket, u)
        ns_dtype = self.engine.ns_dtype(like.device, like.dtype)
        full = torch.empty((len(owned), bucket[0].rows, bucket[0].cols), dtype=ns_dtype, device=like.device)
        # NorMuon: the owned matrices' v (K, rows, B), in the state's dtype (U's)
        variance = like.new_empty((len(owned), bucket[0].rows, bucket[0].width)) if normuon else None
        offset = 0
        for src in range(c.world):  # the order of _launch's receive: by source, then bucket order
            for j, k in enumerate(owned):
                piece = k.pieces[src]
                if not piece.count:
                    continue
                if src == me:
                    put(full[j], piece, k.local_view(u[k.index]))
                    if normuon:
                        put(variance[j], k.v_piece(src), k.rows_view(self.variance(k.index)))
                elif k.replica_of(src) == k.replica_of(me):
                    put(full[j], piece, recv[offset:offset + piece.count].view(piece.shape))
                    offset += piece.count
                    if normuon:
                        rows = k.v_piece(src)
                        put(variance[j], rows, recv[offset:offset + rows.count].view(rows.shape))
                        offset += rows.count
        self._orthogonalize(full, owned, variance)
        if not any(k.o_travels for k in bucket):
            return full, owned, variance, None, None
        # Send every other rank its piece of O of my matrices (NorMuon's: and then its rows of v, packed in O's
        # dtype); receive, per owner in rank order, my pieces of its matrices in bucket order.
        parts, in_numel = [], [0] * c.world
        for dest in range(c.world):
            if dest == me:
                continue
            for j, k in enumerate(owned):
                piece = k.pieces[dest]
                if piece.count:
                    parts.append(take(full[j], piece).reshape(-1))
                    in_numel[dest] += piece.count
                    if normuon:
                        parts.append(pack(take(variance[j], k.v_piece(dest)), full.dtype))
                        in_numel[dest] += parts[-1].numel()
        out_numel = [0] * c.world
        for k in bucket:
            if k.owner != me:
                out_numel[k.owner] += k.pieces[me].count + self._v_numel(k, like.dtype, full.dtype)
        send = torch.cat(parts) if parts else full.new_empty(0)
        received, work = c.all_to_all(send, out_numel, in_numel)
        return full, owned, variance, received, work

    def _v_numel(self, k, dtype, message_dtype):
        """Elements of message_dtype that carry this rank's rows of k's v (none but NorMuon's)."""
        if not k.options.normuon:
            return 0
        return packed_numel(k.v_piece(self.comm.rank).count, dtype, message_dtype)

    def _finish(self, bucket, computed):
        c, me = self.comm, self.comm.rank
        full, owned, variance, received, work = computed
        if work is not None:
            work.wait()
        pairs = []  # (matrix, this rank's piece of its O)
        for j, k in enumerate(owned):
            if k.pieces[me].count:
                pairs.append((k, take(full[j], k.pieces[me])))
                if variance is not None:
                    k.rows_view(self.variance(k.index)).copy_(take(variance[j], k.v_piece(me)))
        by_owner = [[] for _ in range(c.world)]
        for k in bucket:
            if k.owner != me and k.pieces[me].count:
                by_owner[k.owner].append(k)
        offset = 0
        for k in (k for owner in by_owner for k in owner):
            piece = k.pieces[me]
            pairs.append((k, received[offset:offset + piece.count].view(piece.shape)))
            offset += piece.count
            if k.options.normuon:
                mine = self.variance(k.index)
                numel = self._v_numel(k, mine.dtype, received.dtype)
                rows = k.rows_view(mine)
                rows.copy_(unpack(received[offset:offset + numel], mine.dtype, rows.numel()).view(rows.shape))
                offset += numel
        if pairs:
            self._apply(pairs)
