"""When owner-held matrices move (DESIGN 7 "owner-centric"): module hooks over HeldUnits.

A unit is one module (a transformer block, by default) and the buckets (held_buffer.py) of its
owner-held parameters. Every rank runs the same hooks in the same order, so every process group
sees the same sequence of collectives on all its ranks.

  forward pre-hook of unit i   make unit i's weights present (broadcast from their owners, or wait
                               for the one already in flight), then start unit i+1's broadcast so
                               it travels while unit i computes; HSDP: also unit i+2's stage 1
  forward post-hook of unit i  outside the owners' columns, free the weights (reshard_after_forward,
                               or always when no backward will follow); hook the outputs so the
                               unit's backward starts with its weights present
  pre-backward (outputs' grad) broadcast unit i's weights again where freed, start unit i−1's
  post-accumulate-grad hooks   when the last of unit i's gradients is complete: free the weights,
                               post the gradient reduce to the owners (asynchronous), and move older
                               reduces on by one stage (HSDP: the stage across replicas)
  end of backward (autograd's final callback)  finish every reduce; the owner's .grad is the mean
                               gradient over the group, other ranks' .grad is None
A recompute under activation checkpointing runs the forward pre-hook inside backward: it only makes
the weights present (no prefetch, no free: the unit's backward follows).

Gradient accumulation: with set_requires_gradient_sync(False) a backward keeps each rank's local
gradients here (not in .grad) and the next synced backward sends their sum. The owner's .grad
between backwards is the reduced gradient, which the next backward adds to.
"""

import torch
import torch.utils._pytree as pytree

FREE, STAGE1, STAGE2, READY = "free", "stage1", "stage2", "ready"


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _wait(works):
    for w in works:
        if w is not None:
            w.wait()


class HeldUnit:
    """One module's owner-held buckets and where its weights and gradients stand on this rank."""

    def __init__(self, index, name, module, buckets):
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.params = [p for b in buckets for p in b.params]
        self.grad_params = sum(p.requires_grad for p in self.params)
        self.state = FREE
        self.stale = False  # HSDP: the column copies predate the owner's last update
        self._works = []
        # one backward pass
        self.entered_backward = False
        self.accumulated = 0
        self.reduced = False

    # ---- weights: FREE → (STAGE1 →) STAGE2 → READY → FREE ----

    def post_unshard(self, stage2=True):
        if self.state != FREE:
            return
        if self.stale:
            self._works = [b.broadcast_across_column() for b in self.buckets]
            self.state = STAGE1
        elif stage2:
            self._works = [b.broadcast_in_replica() for b in self.buckets]
            self.state = STAGE2

    def advance(self):
        if self.state == STAGE1:
            _wait(self._works)
            self.stale = False
            self._works = [b.broadcast_in_replica() for b in self.buckets]
            self.state = STAGE2

    def wait(self):
        self.post_unshard()
        self.advance()
        if self.state == STAGE2:
            _wait(self._works)
            self._works = []
            self.state = READY

    def free(self):
        """Frees the weights outside the owners' columns (no-op for the column); a broadcast still
        in flight is waited for first (it writes into the storage)."""
        if self.state in (STAGE1, STAGE2):
            self.wait()
        for b in self.buckets:
            b.free()
        self.state = FREE

    def check_registered(self, names_in_module):
        """Raises when fully_shard (or anything) replaced a held parameter on the module."""
        for (local, p), full in names_in_module:
            if self.module.get_parameter(local) is not p:
                raise RuntimeError(f"dmuon.torch.hold_on_owners: parameter '{full}' is no longer the module's "
                                   "parameter (fully_shard sharded it?): pass ignored_params=held.params to every "
                                   "fully_shard call")


class HeldSchedule:
    """The hooks of all units of one hold_on_owners call, and the reduces in flight."""

    def __init__(self, units, groups, reshard_after_forward):
        self.units = units
        self.groups = groups
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self._pending = []      # [[unit, [(bucket, flat gradient, work)], stage]] in posting order
        self._stash = {}        # owner: parameter → its .grad before this backward (the reduced sum so far)
        self._unreduced = {}    # parameter → its local gradient kept through backwards without sync
        self._callback_queued = False
        self._kept_local = False  # the last backward kept its gradients local (no sync)
        self._checked = set()
        self._handles = []

    # ---- installation ----

    def install(self, names_in_unit):
        """names_in_unit[i]: [((name in unit i's module, parameter), full name)]."""
        for unit, names in zip(self.units, names_in_unit):
            self._handles.append(unit.module.register_forward_pre_hook(
                lambda m, args, u=unit, n=names: self._pre_forward(u, n)))
            self._handles.append(unit.module.register_forward_hook(
                lambda m, args, out, u=unit: self._post_forward(u, out)))
            for p in unit.params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda p, u=unit: self._accumulated(u)))

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- forward ----

    def _pre_forward(self, unit, names):
        if unit.index not in self._checked:
            unit.check_registered(names)
            self._checked.add(unit.index)
        if _in_backward():  # a recompute (activation checkpointing): the unit's backward follows
            self._enter_backward(unit)
            unit.wait()
            return
        unit.post_unshard()
        unit.advance()
        following = self.units[unit.index + 1:unit.index + 3]
        if following:
            following[0].post_unshard()
            following[0].advance()
        if len(following) > 1:
            following[1].post_unshard(stage2=False)  # HSDP: its stage 1 travels during two units
        unit.wait()

    def _post_forward(self, unit, output):
        if _in_backward():
            return
        grad = torch.is_grad_enabled()
        if grad:
            tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda g, u=unit: self._pre_backward(u))
        if self.reshard_after_forward or not grad:
            unit.free()

    # ---- backward ----

    def _pre_backward(self, unit):
        if unit.entered_backward:
            return
        self._enter_backward(unit)
        unit.wait()
        if unit.index > 0:
            before = self.units[unit.index - 1]
            before.post_unshard()
            before.advance()

    def _enter_backward(self, unit):
        if unit.entered_backward:
            return
        unit.entered_backward = True
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        for b in unit.buckets:
            for p in b.params:
                if b.is_owner:
                    self._stash[p] = p.grad
                p.grad = self._unreduced.pop(p, None)

    def _accumulated(self, unit):
        unit.accumulated += 1
        if unit.accumulated == unit.grad_params:
            self._post_backward(unit)

    def _post_backward(self, unit):
        if unit.reduced:
            return
        unit.reduced = True
        unit.free()
        self._kept_local = not self.requires_gradient_sync
        if not self.requires_gradient_sync:
            for b in unit.buckets:
                for p in b.params:
                    if p.grad is not None:
                        self._unreduced[p] = p.grad
                    p.grad = self._stash.pop(p, None) if b.is_owner else None
            return
        posted = []
        for b in unit.buckets:
            flat = b.local_gradients()  # (numel,)
            for p in b.params:
                p.grad = None
            posted.append((b, flat, b.reduce_in_replica(flat)))
        for entry in list(self._pending):
            self._move_on(entry)
        self._pending.append([unit, posted, 1])

    def _move_on(self, entry):
        """One stage on for a reduce in flight: stage 1 done → post stage 2; stage 2 done → finish."""
        unit, posted, stage = entry
        if stage == 1:
            _wait(w for _, _, w in posted)
            entry[1] = [(b, flat, b.reduce_across_column(flat)) for b, flat, _ in posted]
            entry[2] = 2
        elif stage == 2:
            _wait(w for _, _, w in posted)
            for b, flat, _ in posted:
                self._finish(b, flat)
            entry[2] = 3
        self._pending = [e for e in self._pending if e[2] < 3]

    def _finish(self, bucket, flat):
        """The owner's .grad: the reduced sum over the group's ranks, divided by their number, added
        to what .grad held before this backward."""
        if not bucket.is_owner:
            return
        flat.div_(self.groups.world)
        for p, g in zip(bucket.params, bucket.gradient_views(flat)):
            before = self._stash.pop(p, None)
            p.grad = g if before is None else before.add_(g)

    def drain(self):
        """Finishes every reduce in flight (in posting order, stage by stage)."""
        while self._pending:
            self._move_on(self._pending[0])

    def _end_of_backward(self):
        self._callback_queued = False
        for unit in self.units:
            if unit.entered_backward and not unit.reduced:
                self._post_backward(unit)  # some of its parameters got no gradient: they count as zeros
        self.drain()
        for unit in self.units:
            if unit.state != FREE and not unit.entered_backward:
                unit.free()  # prefetched for a backward that never reached it
            unit.entered_backward = False
            unit.accumulated = 0
            unit.reduced = False

    # ---- the optimizer's step ----

    def ready_for_step(self):
        """Before DMuon's step reads the owners' gradients (no communication: the end of backward
        finished the reduces already)."""
        if self._kept_local:
            raise RuntimeError("DMuon.step(): the last backward kept the owner-held gradients local "
                               "(set_requires_gradient_sync(False)); run the last micro-batch's backward "
                               "with gradient sync before step()")
        self.drain()

    def after_step(self):
        """The owners changed the weights: copies outside the columns are freed (they are stale) and,
        with replicas, the column copies are refreshed before their next use. No communication."""
        self.drain()
        for unit in self.units:
            unit.free()
            unit.stale = self.groups.grid.replicas > 1
