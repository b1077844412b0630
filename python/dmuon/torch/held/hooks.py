"""When owner-held matrices move (DESIGN 7 "owner-centric"): module hooks over HeldUnits.

A unit is one module (a transformer block, by default) and the buckets (buffer.py) of its owner-held
parameters. Every rank runs the same hooks in the same order, so every process group sees the same
sequence of collectives on all its ranks.

  forward pre-hook of unit i   make unit i's working copies present (broadcast from their owners, or
                               wait for the one already in flight) and register them on its modules,
                               then start unit i+1's broadcast so it travels while unit i computes;
                               HSDP: also unit i+2's stage 1
  forward post-hook of unit i  register the master / placeholder parameters again (autograd keeps its
                               own references to the working ones); outside the owners' columns, free
                               the working copies (reshard_after_forward, or always when no backward
                               will follow); hook the outputs so the unit's backward starts with its
                               working copies present
  pre-backward (outputs' grad) broadcast unit i's weights again where freed and register them (a
                               recompute of the module's forward, not its __call__, runs no hook:
                               transformers' gradient checkpointing), start unit i−1's
  post-accumulate-grad hooks   when the last of unit i's working gradients is complete: free the
                               working copies, post the gradient reduce to the owners (asynchronous),
                               and move older reduces on by one stage (HSDP: the stage across replicas)
  end of backward (autograd's final callback)  finish every reduce; the owner's .grad is the mean
                               gradient over the group (added to what .grad held), another rank's .grad
                               a HeldElsewhere placeholder that refuses reads
A recompute under activation checkpointing runs the forward pre-hook inside backward: it only makes
the weights present and registered (no prefetch, no free: the unit's backward follows); a recompute
that stops early runs no post-hook, so the unit's backward end registers the masters again.

Gradient accumulation: with set_requires_gradient_sync(False) a backward leaves each rank's local
gradients in the working parameters, and the next synced backward sends their sum.
unshard(): every unit's working copies present and registered until reshard() (an eval loop, or
reading parameters on every rank).
"""

import torch
import torch.utils._pytree as pytree

from dmuon.torch.dtensors import is_dtensor

from dmuon.torch.held.placeholder import HeldElsewhere, drop_scratch
from dmuon.torch.step_hooks import StepHook

FREE, STAGE1, STAGE2, READY = "free", "stage1", "stage2", "ready"


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _wait(works):
    for w in works:
        if w is not None:
            w.wait()


class HeldUnit:
    """One module's owner-held buckets and where its weights and gradients stand on this rank.
    slots: [(module, attribute, full name)] of each bucket parameter, in bucket order."""

    def __init__(self, index, name, module, buckets, slots):
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.slots = slots
        self.state = FREE
        self.stale = False  # HSDP: the column copies predate the owner's last update
        self.resolve_policy = None  # hold.py: reads fully_shard's policies at the first use
        self._works = []
        # one backward pass
        self.entered_backward = False
        self.accumulated = 0
        self.reduced = False

    @property
    def params(self):
        """The registered parameters (masters here, placeholders elsewhere), in bucket order."""
        return [p for b in self.buckets for p in b.params]

    @property
    def working(self):
        return [w for b in self.buckets for w in b.working]

    def adopt(self, marks):
        """Takes a parameter object that replaced a held one on its module by .to_empty() or .to()
        (nn.Module._apply makes a new Parameter when the storage kind changes, e.g. from meta): the
        owner's master as a plain tensor, a placeholder elsewhere, of the same shape. It gets the
        held parameter's marks and its place in the bucket. A held TP or EP slice (a DTensor) stays the
        same object, its contents swapped (torch.utils.swap_tensors, nn.Module._apply's way with tensor
        subclasses: its attributes are then the new tensor's): it gets its marks back from `marks` (full
        name → HeldParam). Anything else is
        left for check_registered to refuse. Called outside forward only (DMuon(model), held.params,
        state dicts, unshard): inside it, FSDP2 registers plain unsharded parameters of its own."""
        k = 0
        for b in self.buckets:
            for j, old in enumerate(b.params):
                module, attr, full = self.slots[k]
                k += 1
                now = module._parameters.get(attr)
                if now is old and getattr(now, "_dmuon_held", None) is None:
                    now._dmuon_held = marks[full]
                if now is old or now is None or any(now is w for w in b.working):
                    continue
                kind_ok = isinstance(now, HeldElsewhere) != b.is_owner and not is_dtensor(now)
                if not kind_ok or tuple(now.shape) != tuple(old.shape):
                    continue
                now._dmuon_held = old._dmuon_held
                b.params[j] = now

    # ---- weights: FREE → (STAGE1 →) STAGE2 → READY → FREE ----

    def post_unshard(self, stage2=True):
        if self.state != FREE:
            return
        if self.resolve_policy is not None:
            self.resolve_policy()
            self.resolve_policy = None
        if any([b.follow_masters() for b in self.buckets]) and any(b.keeps for b in self.buckets):
            self.stale = True
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
        """Frees the working copies outside the owners' columns (the column keeps them); a broadcast
        still in flight is waited for first (it writes into the storage)."""
        if self.state in (STAGE1, STAGE2):
            self.wait()
        for b in self.buckets:
            b.free()
        self.state = FREE

    # ---- which tensor the modules see ----

    def register_working(self):
        for (module, attr, _), p, w in zip(self.slots, self.params, self.working):
            w.requires_grad_(p.requires_grad)
            module._parameters[attr] = w

    def register_masters(self):
        for (module, attr, _), p in zip(self.slots, self.params):
            module._parameters[attr] = p

    def check_registered(self):
        """Raises when fully_shard (or anything) replaced a held parameter on its module."""
        working = {id(w) for w in self.working}
        for (module, attr, full), p in zip(self.slots, self.params):
            now = module._parameters.get(attr)
            if now is not p and id(now) not in working:
                raise RuntimeError(f"dmuon.torch.hold_on_owners: parameter '{full}' is no longer the module's "
                                   "parameter: fully_shard sharded it (pass ignored_params=held.params to every "
                                   "fully_shard call), or .to_empty()/.to() made a new one (build DMuon(model) or read "
                                   "held.params after moving the model: they take the new object)")


class HeldSchedule(StepHook):
    """The hooks of all units of one hold_on_owners call, and the reduces in flight."""

    def __init__(self, units, groups, reshard_after_forward):
        self.units = units
        self.groups = groups
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.unsharded = False  # unshard(): every unit stays present and registered
        self._pending = []      # [[unit, [(bucket, flat gradient, work)], stage]] in posting order
        self._callback_queued = False
        self._kept_local = False  # the last backward kept its gradients local (no sync)
        self._handles = []
        self.marks = {}  # full name → HeldParam (mark)

    # ---- installation ----

    def install(self):
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u)))
            self._handles.append(unit.module.register_forward_hook(
                lambda m, args, out, u=unit: self._post_forward(u, out)))
            for b in unit.buckets:
                b.on_gradient = lambda w, u=unit: self._accumulated(u)

    def remove(self):
        self.reshard()
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- forward ----

    def adopt(self):
        """Every unit's adopt(): after .to_empty() or .to() replaced parameter objects or their contents."""
        for unit in self.units:
            unit.adopt(self.marks)

    def mark(self, name, param, held):
        """Marks held parameter `name` (param._dmuon_held = held), kept here for adopt()."""
        self.marks[name] = param._dmuon_held = held

    @property
    def registry(self):
        """name → (registered parameter: the master here or a placeholder, whether this rank owns it)."""
        return {n: (p, b.is_owner) for u in self.units for b in u.buckets for n, p in zip(b.names, b.params)}

    def _pre_forward(self, unit):
        drop_scratch()
        unit.check_registered()
        if self.unsharded:
            return
        if _in_backward():  # a recompute (activation checkpointing): the unit's backward follows
            self._enter_backward(unit)
            unit.wait()
            unit.register_working()
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
        unit.register_working()

    def _post_forward(self, unit, output):
        if self.unsharded:
            return
        unit.register_masters()
        if _in_backward():
            return
        grad = torch.is_grad_enabled()
        if grad:
            tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda g, u=unit: self._pre_backward(u))
        if self.reshard_after_forward or not grad:
            unit.free()

    # ---- unshard (FSDPModule.unshard's counterpart) ----

    def unshard(self):
        """Every unit's working copies present (broadcast from the owners) and registered on the
        modules until reshard(): forwards then move nothing, and every rank reads the parameters.
        Collective. The masters (and placeholders) are registered again by reshard()."""
        if self.unsharded:
            return
        drop_scratch()
        self.adopt()
        self.drain()
        for unit in self.units:
            unit.post_unshard()
            unit.advance()
        for unit in self.units:
            unit.wait()
            unit.register_working()
        self.unsharded = True

    def reshard(self):
        if not self.unsharded:
            return
        self.unsharded = False
        for unit in self.units:
            unit.register_masters()
            unit.free()

    # ---- backward ----

    def _pre_backward(self, unit):
        if unit.entered_backward:
            return
        self._enter_backward(unit)
        unit.wait()
        unit.register_working()  # a recompute of the module's forward alone (transformers' checkpointing) runs no hook
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

    def _accumulated(self, unit):
        self._enter_backward(unit)  # under unshard() no pre-backward hook ran
        unit.accumulated += 1
        if unit.accumulated == sum(w.requires_grad for w in unit.working):
            self._post_backward(unit)

    def _post_backward(self, unit):
        if unit.reduced:
            return
        unit.reduced = True
        if not self.unsharded and all(w.requires_grad for w in unit.working):
            # (a frozen matrix of the unit may still be read by the backward of its input: then the end
            # of backward frees it)
            unit.register_masters()  # a recompute that stopped early (checkpointing) ran no post-hook
            unit.free()
        self._kept_local = not self.requires_gradient_sync
        if not self.requires_gradient_sync:
            return  # the working parameters keep their local gradients until a synced backward
        posted = []
        for b in unit.buckets:
            flat = b.local_gradients()  # (numel,) in the reduce dtype
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
                b.finish_gradients(flat)
            entry[2] = 3
        self._pending = [e for e in self._pending if e[2] < 3]


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
            if not self.unsharded and (unit.entered_backward or unit.state != FREE):
                unit.register_masters()
                unit.free()  # kept for a frozen matrix, or prefetched for a backward that never reached it
            unit.entered_backward = False
            unit.accumulated = 0
            unit.reduced = False

    # ---- the optimizer's step (step_hooks.StepHook) ----

    def before_step(self):
        """Before DMuon's step reads the owners' gradients (no communication: the end of backward
        finished the reduces already)."""
        if self._kept_local:
            raise RuntimeError("DMuon.step(): the last backward kept the owner-held gradients local "
                               "(set_requires_gradient_sync(False)); run the last micro-batch's backward "
                               "with gradient sync before step()")
        self.drain()

    def after_step(self, extra=None, written=None):
        """The owners changed their masters: every working copy is stale. Copies outside the columns
        are freed and, with replicas, the column copies are refreshed before their next use. No
        communication (and no extra of the step's all-reduce: StepHook)."""
        drop_scratch()
        self.drain()
        self.reshard()
        for unit in self.units:
            unit.free()
            unit.stale = self.groups.grid.replicas > 1
