"""The Muon half of one DMuon step (DESIGN 1 and 3): every matrix's update is computed once, by its
owner, in batches of same-shape matrices (buckets), and each bucket's communication overlaps the
Newton–Schulz of the next.

Replicated bucket (the parameter is whole on every rank, gradients identical):
  launch:  the owner forms U = momentum/nesterov of its matrices into a (K, rows, cols) stack
           (K: the most matrices any rank owns in this bucket)
  compute: Newton–Schulz of its own matrices; all_gather of the stacks (one collective, async)
  finish:  every rank applies every matrix's O: W ← W·(1 − lr·wd) − lr·s·O
Sharded bucket (dim-0 chunks, momentum sharded like the parameter):
  launch:  every rank forms U on its rows; all_to_all_single sends each matrix's rows to its owner (async)
  compute: the owner assembles its full matrices, runs Newton–Schulz, all_to_all_single sends each
           rank its rows of O (async)
  finish:  every rank applies its rows of O
Order: launch(0); then for each bucket b: launch(b+1), compute(b), finish(b−1); so bucket b+1's rows
travel while bucket b's Newton–Schulz runs.
"""

import time
from dataclasses import dataclass

import torch

import dmuon


@dataclass
class MuonSlot:
    index: int        # the parameter's position in the optimizer's agreed order
    name: str
    layout: object    # layout.Layout
    group: dict       # its param group (hyper-parameters are read at every step)
    rows: int         # global_shape[0]
    cols: int         # product of the other dimensions
    owner: int        # rank that runs its Newton–Schulz
    scale: float      # s of DESIGN 1


def muon_scale(rows, cols, kind):
    if kind == "original":
        return max(1.0, rows / cols) ** 0.5
    return 0.2 * max(rows, cols) ** 0.5


def engine_target(tensor):
    """(device code, dtype code, torch dtype, stream) for Newton–Schulz on tensor's device; raises
    dmuon.UnsupportedError naming the device when this build has no backend for it."""
    kind = tensor.device.type
    if kind == "cpu":
        return dmuon.DEVICE_CPU, dmuon.DTYPE_F32, torch.float32, None
    if kind == "cuda":
        for code, dtype in ((dmuon.DTYPE_BF16, torch.bfloat16), (dmuon.DTYPE_F32, torch.float32)):
            if dmuon.supports(dmuon.DEVICE_CUDA, code):
                return dmuon.DEVICE_CUDA, code, dtype, torch.cuda.current_stream(tensor.device).cuda_stream
    raise dmuon.UnsupportedError(f"device {tensor.device}: this build of libdmuon_c has no Newton-Schulz backend "
                                 "for it (it runs float32 on cpu)")


class MuonStep:
    """One step's Muon updates. `state(slot)` is the slot's optimizer state dict, `grads[index]` the
    local gradient (None: zeros), `grad_scale` the clipping factor, `ns` a dmuon.Orthogonalizer."""

    def __init__(self, comm, ns, state, grads, grad_scale):
        self.comm, self.ns, self.state, self.grads, self.grad_scale = comm, ns, state, grads, grad_scale
        self.ns_seconds = 0.0
        self.ns_matrices = 0

    def run(self, buckets):
        buckets = [b for b in buckets if b]
        if not buckets:
            return
        launched = self._launch(buckets[0])
        previous = None
        for k in range(len(buckets)):
            following = self._launch(buckets[k + 1]) if k + 1 < len(buckets) else None
            current = self._compute(buckets[k], launched)
            if previous is not None:
                self._finish(*previous)
            previous = (buckets[k], current)
            launched = following
        self._finish(*previous)

    # ---- per matrix ----

    def _local(self, slot):
        """(this rank's values of the parameter as (local rows, cols), its gradient likewise)."""
        p = slot.layout.local(slot.layout.tensor)
        g = self.grads[slot.index]
        values = p.view(-1, slot.cols) if p.numel() else p.reshape(0, slot.cols)
        grad = torch.zeros_like(values) if g is None else g.reshape(values.shape)
        return values, grad

    def _momentum_into(self, slot, out):
        """M ← β·M + (1−β)·g; out ← nesterov ? (1−β)·g + β·M : M, on this rank's rows (DESIGN 1)."""
        values, grad = self._local(slot)
        if self.grad_scale != 1.0:
            grad = grad * self.grad_scale
        st = self.state(slot)
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(slot.layout.local(slot.layout.tensor))
        buf = st["momentum_buffer"].view(values.shape)
        beta = slot.group["momentum"]
        buf.lerp_(grad, 1.0 - beta)
        if slot.group["nesterov"]:
            if out.dtype == grad.dtype:
                torch.lerp(grad, buf, beta, out=out)
            else:
                out.copy_(grad.lerp(buf, beta))
        else:
            out.copy_(buf)

    def _apply(self, slot, values, update):
        lr, wd = slot.group["lr"], slot.group["weight_decay"]
        if wd:
            values.mul_(1.0 - lr * wd)
        values.add_(update.view(values.shape), alpha=-lr * slot.scale)

    def _orthogonalize(self, stack, slots):
        """Newton–Schulz in place on stack (k, rows, cols), contiguous, in the engine's dtype."""
        k = stack.shape[0]
        if k == 0:
            return
        device, dtype_code, _, stream = engine_target(stack)
        rows, cols = stack.shape[1], stack.shape[2]
        step = rows * cols * stack.element_size()
        ptrs = [stack.data_ptr() + j * step for j in range(k)]
        t0 = time.perf_counter()
        self.ns.run(ptrs, ptrs, rows, cols, device=device, dtype=dtype_code, stream=stream,
                    names=[s.name for s in slots])
        self.ns_seconds += time.perf_counter() - t0
        self.ns_matrices += k

    def _engine_stack(self, k, slot):
        like = slot.layout.local(slot.layout.tensor)
        _, _, dtype, _ = engine_target(like)
        return torch.empty((k, slot.rows, slot.cols), dtype=dtype, device=like.device)

    # ---- per bucket ----

    def _launch(self, bucket):
        c = self.comm
        if not bucket[0].layout.sharded:
            mine = [s for s in bucket if s.owner == c.rank]
            per_rank = max(sum(1 for s in bucket if s.owner == r) for r in range(c.world))
            stack = self._engine_stack(per_rank, bucket[0])
            for j, s in enumerate(mine):
                self._momentum_into(s, stack[j])
            stack[len(mine):].zero_()
            return stack, mine
        wire = bucket[0].layout.local(bucket[0].layout.tensor)
        parts, in_numel = [], [0] * c.world
        for dest in range(c.world):
            for s in bucket:
                if s.owner != dest:
                    continue
                count = s.layout.rows[c.rank][1]
                if count:
                    u = torch.empty((count, s.cols), dtype=wire.dtype, device=wire.device)
                    self._momentum_into(s, u)
                    parts.append(u.view(-1))
                    in_numel[dest] += count * s.cols
                else:
                    self._momentum_into(s, wire.new_empty((0, s.cols)))  # keeps its state in step
        mine = [s for s in bucket if s.owner == c.rank]
        out_numel = [sum(s.layout.rows[src][1] * s.cols for s in mine) for src in range(c.world)]
        send = torch.cat(parts) if parts else wire.new_empty(0)
        recv, work = c.all_to_all(send, out_numel, in_numel)
        return recv, work, mine

    def _compute(self, bucket, launched):
        c = self.comm
        if not bucket[0].layout.sharded:
            stack, mine = launched
            self._orthogonalize(stack[: len(mine)], mine)
            return c.all_gather(stack, async_op=True)
        recv, work, mine = launched
        if work is not None:
            work.wait()
        full = self._engine_stack(len(mine), bucket[0])
        offset = 0
        for src in range(c.world):
            for j, s in enumerate(mine):
                start, count = s.layout.rows[src]
                n = count * s.cols
                full[j, start:start + count].copy_(recv[offset:offset + n].view(count, s.cols))
                offset += n
        self._orthogonalize(full, mine)
        parts, in_numel = [], [0] * c.world
        for dest in range(c.world):
            for j, s in enumerate(mine):
                start, count = s.layout.rows[dest]
                if count:
                    parts.append(full[j, start:start + count].reshape(-1).to(recv.dtype))
                    in_numel[dest] += count * s.cols
        out_numel = [sum(s.layout.rows[c.rank][1] * s.cols for s in bucket if s.owner == src) for src in range(c.world)]
        send = torch.cat(parts) if parts else recv.new_empty(0)
        return c.all_to_all(send, out_numel, in_numel)

    def _finish(self, bucket, computed):
        c = self.comm
        received, work = computed
        if work is not None:
            work.wait()
        if not bucket[0].layout.sharded:
            for r in range(c.world):
                for j, s in enumerate([s for s in bucket if s.owner == r]):
                    self._apply(s, self._local(s)[0], received[r][j])
            return
        offset = 0
        for src in range(c.world):
            for s in bucket:
                if s.owner != src:
                    continue
                n = s.layout.rows[c.rank][1] * s.cols
                if n:
                    self._apply(s, self._local(s)[0], received[offset:offset + n])
                offset += n
