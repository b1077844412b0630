"""The Muon half of one DMuon step (DESIGN 1, 3 and 7 "all-to-all after the fact") for every layout: pieces of U
to the owners, O back, and the matrices' variant (variants/) called on the owner; it names no variant.

The matrices, their pieces, owners and buckets are matrices.py's (a bucket: same-shape matrices, at most DMuon's
step_memory's share of them per owner, matrices.buckets_of). Per bucket:
  launch:  every rank forms momentum and U on its local pieces (the momentum mirrors the parameter's
           local layout on every replica); the ranks of the owner's replica send their pieces of U to
           the owner (one all_to_all_single over the group, uneven splits, async)
  compute: the owner assembles its full matrices, runs Newton–Schulz once for all of them (one
           batched engine call; per block for a split matrix, matrices.newton_schulz_blocks), then the
           variant's after_orthogonalize, then the blocks' scales, and sends every other rank holding a piece
           of a matrix, in every replica, its piece of O (a second all_to_all_single, async)
  finish:  every rank applies its pieces of O: W ← W·(1 − lr·wd) − lr·s·O
A variant with per-row state (Variant.row_state) has each holder's rows of it ride with its piece of U
to the owner and back with its piece of O, in those two all-to-alls (in U's dtype there, exactly; on the way back
in the state's dtype, rounded as the owner stores its own, packed bit for bit into O's dtype).
Each phase is one engine call (engine.py): per param group of the bucket the momentum of every
local part and the apply of every local part, per bucket the Newton–Schulz of the owner's stack. A
bucket of which nothing travels (each matrix held by its owner alone: owner-held ones, every bucket of a one-rank
group) skips the phases, on each owner for its own matrices and with no collective (so every rank meets the same
collectives in the same order): one engine call per param group does momentum, Newton–Schulz and apply (three
for a split matrix or a variant that rewrites O), while the first travelling bucket's pieces are in flight.
Owner-held TP slices (held/tensor_parallel.py) are pieces like any other: those of the owner's TP
group travel to the owner and back, and a rank that keeps none of a bucket's matrices still joins its
exchanges (with nothing to send).
So every matrix is orthogonalized once in the whole job and all replicas apply the same O (their
weights stay bit-identical). A matrix its owner holds whole (a replicated parameter, an expert of a
stack sharded by experts) sends no U; a collective with nothing to move on any rank is not called.
Order: launch(0); then for each bucket b: launch(b+1), compute(b), finish(b−1); so bucket b+1's pieces
travel while bucket b's Newton–Schulz runs.
"""


import torch

from dmuon.torch.matrices import newton_schulz_blocks, put, scale_blocks, take
from dmuon.torch.muon_update import StepValues
from dmuon.torch.ns_clock import NsClock


def packed_numel(count, dtype, message_dtype):
    """Elements of message_dtype that carry `count` elements of dtype (pack)."""
    return -(-count * dtype.itemsize // message_dtype.itemsize)


def pack(t, message_dtype):
    """t's elements as a 1-D tensor of message_dtype, bit for bit (a float32 v in a bfloat16 message of O: two
    elements each; zero bytes pad the last)."""
    flat = t.reshape(-1)
    if flat.dtype == message_dtype:
        return flat
    raw = flat.contiguous().view(torch.uint8)
    pad = packed_numel(flat.numel(), flat.dtype, message_dtype) * message_dtype.itemsize - raw.numel()
    return torch.cat([raw, raw.new_zeros(pad)]).view(message_dtype)


def unpack(part, dtype, count):
    """The `count` elements of dtype that pack() put in part (1-D, message dtype)."""
    if part.dtype == dtype:
        return part
    return part.contiguous().view(torch.uint8)[:count * dtype.itemsize].clone().view(dtype)


class Exchange:
    """One step's Muon updates. `momentum(index)` is the parameter's local momentum buffer (state
    dtype), `grads[index]` its local gradient (None: zeros), `check` the step's GradientCheck (its
    clipping factor, and per parameter whether it is updated: device tensors), `engine` the arithmetic
    (engine.py), `ns_of(options)` its Newton–Schulz handle of a matrix's MuonOptions (a bucket's matrices share
    theirs), `dtypes_of(matrix)` (its state's dtype, its U's: plan.work_dtype, float32 for bfloat16 state of a
    float32 parameter), `row_state(matrix)` its parameter's local per-row state of its variant (Variant.row_state; state
    dtype), read for matrices whose width is > 0."""

    def __init__(self, comm, engine, ns_of, momentum, grads, check, dtypes_of, row_state):
        self.comm, self.engine, self.ns_of, self.momentum, self.grads = comm, engine, ns_of, momentum, grads
        self.dtypes_of, self.row_state = dtypes_of, row_state
        self.values = StepValues(check)
        self.ns_clock = NsClock()  # Newton–Schulz's time (device time on CUDA, not the enqueueing's)
        self.ns_matrices = 0

    def run(self, buckets):
        me = self.comm.rank
        buckets = [b for b in buckets if b]
        moving = [any(k.u_travels or k.o_travels for k in b) for b in buckets]
        travelling = [b for b, m in zip(buckets, moving) if m]
        launched = [self._launch(travelling[0])] if travelling else []  # _compute takes (and frees) each
        for bucket in (b for b, m in zip(buckets, moving) if not m):  # while the first bucket's pieces travel
            mine = [k for k in bucket if k.owner == me]
            if mine:
                self._update_held(mine)
        previous = None
        for k in range(len(travelling)):
            if k + 1 < len(travelling):
                launched.append(self._launch(travelling[k + 1]))
            current = self._compute(travelling[k], launched.pop(0))
            if previous is not None:
                self._finish(*previous)
            previous = (travelling[k], current)
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

    def _form_u(self, matrices):
        """{id(k): U} of the matrices k of which this rank holds a piece, on its local view of each (so a
        parameter whose matrices a budget put in several buckets forms each piece once), in U's dtype (dtypes_of,
        its bucket's): one engine call per param group."""
        me = self.comm.rank
        held = [k for k in matrices if not k.layout.held_elsewhere and k.pieces[me].count]
        u = {}
        for part in self._by_group(held, lambda k: k.group):
            group = part[0].group
            entries = [(k.index, k.local_view(self.momentum(k.index)),
                        None if self.grads[k.index] is None else k.local_view(self.grads[k.index])) for k in part]
            u.update(zip(map(id, part), self.engine.momentum(entries, group["momentum"], group["nesterov"],
                                                             self.values, self.dtypes_of(part[0])[1])))
        return u

    def _apply(self, pairs):
        """The update of this rank's pieces of matrices from their pieces of O, for (k, O piece) pairs: one
        engine call per param group."""
        for part in self._by_group(pairs, lambda pair: pair[0].group):
            group = part[0][0].group
            entries = [(k.index, k.local_view(k.layout.local(k.layout.tensor)), update, k.scale) for k, update in part]
            self.engine.apply(entries, group["lr"], group["weight_decay"], self.values, part[0][0].options.cautious_wd)

    def _rows(self, k):
        """This rank's rows of k's per-row state, a view (piece rows, width)."""
        return k.rows_view(self.row_state(k))

    def _update_held(self, bucket):
        """The whole update of matrices this rank holds whole and alone (nothing travels): momentum,
        Newton–Schulz and apply in one engine call per param group (three for matrices split in blocks or
        of a variant that rewrites O between Newton–Schulz and the apply)."""
        if bucket[0].blocks is not None or bucket[0].variant.rewrites_o:
            u = self._form_u(bucket)
            like = next(iter(u.values()))
            ns_dtype = self.engine.ns_dtype(like.device, like.dtype)
            full = torch.stack([u[id(k)] for k in bucket]).to(ns_dtype)
            rows = torch.stack([self._rows(k).to(like.dtype) for k in bucket]) if bucket[0].width else None
            self._orthogonalize(full, bucket, rows)
            if rows is not None:
                for k, r in zip(bucket, rows):
                    self._rows(k).copy_(r)
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

    def _orthogonalize(self, stack, owned, rows):
        """O in place of U on stack (K, rows, cols), contiguous, in the engine's dtype: Newton–Schulz of each
        matrix, or of each of its blocks (matrices.newton_schulz_blocks), all blocks of one shape in one engine
        call; then the variant's after_orthogonalize with the matrices' per-row state, rows (K, rows, width) or
        None, updated in place; each block then scaled by s(block) / s(matrix) (the apply scales by s(matrix))."""
        if stack.shape[0] == 0:
            return
        t0 = self.ns_clock.start(stack.device)
        first = owned[0]
        newton_schulz_blocks(stack, owned, lambda matrices, names: self.engine.orthogonalize(
            self.ns_of(first.options), matrices, names))
        first.variant.after_orthogonalize(stack, rows, first, lambda: self.values.keep_of([k.index for k in owned]))
        scale_blocks(stack, first)
        self.ns_clock.stop(t0)
        self.ns_matrices += stack.shape[0]

    # ---- per bucket (same rows, cols, momentum dtype, device and options) ----

    def _like(self, bucket, u):
        """A tensor of U's dtype and device for the bucket (this rank may hold none of its matrices: an
        owner-held TP matrix of another TP group)."""
        if u:
            return next(iter(u.values()))
        k = bucket[0]
        return torch.empty(0, dtype=self.dtypes_of(k)[1], device=k.layout.local(k.layout.tensor).device)

    def _launch(self, bucket):
        c, me = self.comm, self.comm.rank
        u = self._form_u(bucket)
        # what _compute reads of U (the owner's own pieces); the rest is freed once sent
        mine = {id(k): u[id(k)] for k in bucket if k.owner == me and id(k) in u}
        if not any(k.u_travels for k in bucket):
            return mine, None, None
        # Send: my piece of U of every matrix whose owner is another rank of my replica (and then my rows of its
        # per-row state, in U's dtype); the owner receives, per source rank in rank order, that
        # rank's pieces of its matrices in bucket order.
        to_owner = [[] for _ in range(c.world)]
        out_numel = [0] * c.world
        for k in bucket:
            if k.owner == me:
                for src, piece in enumerate(k.pieces):
                    if src != me and k.replica_of(src) == k.replica_of(me):
                        out_numel[src] += piece.count + k.rows_piece(src).count
            elif k.replica_of(k.owner) == k.replica_of(me) and k.pieces[me].count:
                to_owner[k.owner].append(u[id(k)].reshape(-1))
                if k.width:
                    to_owner[k.owner].append(self._rows(k).reshape(-1).to(u[id(k)].dtype))
        parts = [t for dest in to_owner for t in dest]
        in_numel = [sum(t.numel() for t in dest) for dest in to_owner]
        like = self._like(bucket, u)
        send = torch.cat(parts) if parts else like.new_empty(0)
        recv, work = c.all_to_all(send, out_numel, in_numel)
        return mine, recv, work

    def _compute(self, bucket, launched):
        c, me = self.comm, self.comm.rank
        u, recv, work = launched
        if work is not None:
            work.wait()
        owned = [k for k in bucket if k.owner == me]
        width = bucket[0].width  # the bucket's matrices share their options, so their variant and width
        like = self._like(bucket, u)
        ns_dtype = self.engine.ns_dtype(like.device, like.dtype)
        full = torch.empty((len(owned), bucket[0].rows, bucket[0].cols), dtype=ns_dtype, device=like.device)
        # the owned matrices' per-row state (K, rows, width), in U's dtype
        rows = like.new_empty((len(owned), bucket[0].rows, width)) if width else None
        offset = 0
        for src in range(c.world):  # the order of _launch's receive: by source, then bucket order
            for j, k in enumerate(owned):
                piece = k.pieces[src]
                if not piece.count:
                    continue
                if src == me:
                    put(full[j], piece, u[id(k)])
                    if width:
                        put(rows[j], k.rows_piece(src), self._rows(k))
                elif k.replica_of(src) == k.replica_of(me):
                    put(full[j], piece, recv[offset:offset + piece.count].view(piece.shape))
                    offset += piece.count
                    if width:
                        held = k.rows_piece(src)
                        put(rows[j], held, recv[offset:offset + held.count].view(held.shape))
                        offset += held.count
        del launched, u, recv, like  # U's pieces are in full now: freed before Newton–Schulz
        self._orthogonalize(full, owned, rows)
        if not any(k.o_travels for k in bucket):
            return full, owned, rows, None, None
        # Send every other rank its piece of O of my matrices (and then its rows of their per-row state, in the
        # state's dtype, packed in O's); receive, per owner in rank order, my pieces of its matrices in bucket order.
        parts, in_numel = [], [0] * c.world
        for dest in range(c.world):
            if dest == me:
                continue
            for j, k in enumerate(owned):
                piece = k.pieces[dest]
                if piece.count:
                    parts.append(take(full[j], piece).reshape(-1))
                    in_numel[dest] += piece.count
                    if width:
                        stored = take(rows[j], k.rows_piece(dest)).to(self.dtypes_of(k)[0])
                        parts.append(pack(stored, full.dtype))
                        in_numel[dest] += parts[-1].numel()
        out_numel = [0] * c.world
        for k in bucket:
            if k.owner != me:
                out_numel[k.owner] += k.pieces[me].count + packed_numel(k.rows_piece(me).count, self.dtypes_of(k)[0],
                                                                        full.dtype)
        send = torch.cat(parts) if parts else full.new_empty(0)
        received, work = c.all_to_all(send, out_numel, in_numel)
        return full, owned, rows, received, work

    def _finish(self, bucket, computed):
        c, me = self.comm, self.comm.rank
        full, owned, rows, received, work = computed
        if work is not None:
            work.wait()
        pairs = []  # (matrix, this rank's piece of its O)
        for j, k in enumerate(owned):
            if k.pieces[me].count:
                pairs.append((k, take(full[j], k.pieces[me])))
                if rows is not None:
                    self._rows(k).copy_(take(rows[j], k.rows_piece(me)))
        by_owner = [[] for _ in range(c.world)]
        for k in bucket:
            if k.owner != me and k.pieces[me].count:
                by_owner[k.owner].append(k)
        offset = 0
        for k in (k for owner in by_owner for k in owner):
            piece = k.pieces[me]
            pairs.append((k, received[offset:offset + piece.count].view(piece.shape)))
            offset += piece.count
            if k.width:
                mine = self._rows(k)
                numel = packed_numel(mine.numel(), mine.dtype, received.dtype)
                mine.copy_(unpack(received[offset:offset + numel], mine.dtype, mine.numel()).view(mine.shape))
                offset += numel
        if pairs:
            self._apply(pairs)
