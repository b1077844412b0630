"""dmuon.torch.DMuon: Muon for hidden matrices + AdamW for the rest, as a torch.optim optimizer over
torch.distributed, with Newton–Schulz in dmuon's C++ engine, or in torch ops on devices it lacks (engine.py;
docs/pytorch.md).

Semantics are DESIGN section 1 and the C++ optimizers': one global gradient norm (clipping and the
non-finite check, agreed across ranks), AdamW as torch.optim.AdamW (bias-corrected, decoupled decay),
Muon's lerp momentum with Nesterov, Newton–Schulz, the chosen scale, decoupled decay with the
unscaled lr. Each Muon matrix (an expert of an (E, m, n) stack is one) has one owner rank in the
whole group, which alone runs its Newton–Schulz (matrices.py, exchange.py).

DMuon is the torch.optim shell around a plan and a step. The plan (plan.py), made at construction and by
add_param_group (collective): each parameter's layout (layout.py), its Muon matrices, their owners and
buckets (matrices.py), its state; load_state_dict checks and writes a saved one (checkpoint.py). step()
runs its phases over the plan: the step hooks' before_step (step_hooks.py: the owner-held schedules), the
gradient check (gradient_check.py: one all-reduce, which carries the hooks' extras), AdamW (adamw.py), the
Muon exchange (exchange.py, calling each matrix's variant, variants/), the step hooks' after_step in reverse
order (QK-clip, the schedules).

Optimizer state follows torch.optim.AdamW under FSDP2, so torch.distributed.checkpoint saves and
reshards it: state[param] holds tensors laid out as the parameter (DTensors with its mesh and
placements for a DTensor parameter, full tensors for a replicated one), created at construction.
"""

import weakref

import torch

import dmuon
from dmuon.torch.adamw import adamw_phase
from dmuon.torch.agreement import agree_on_parameters
from dmuon.torch.arguments import check_arguments, check_group, state_dtype_value
from dmuon.torch.checkpoint import checked_entries, load_entry, load_group_values
from dmuon.torch.collectives import Group
from dmuon.torch.dtensors import as_placed
from dmuon.torch.engine import make_engine
from dmuon.torch.exchange import Exchange
from dmuon.torch.frameworks import replaced_parameters
from dmuon.torch.gradient_check import GradientCheck
from dmuon.torch.held.hold import adopt_replaced
from dmuon.torch.matrices import buckets_of, step_budget
from dmuon.torch.muon_options import DEFAULTS as MUON_DEFAULTS, MuonOptions
from dmuon.torch.ns_clock import NsClock
from dmuon.torch.params import is_expert_stack_by_default, module_groups, split_groups
from dmuon.torch.plan import (convert_state, describe_groups, matrix_dtypes, plan_matrices, state_dtype,
                              torch_groups_of, work_dtype, zero_state)

_COUNTERS = ("updates", "skipped_steps")  # kept in every param group, so checkpoints carry them


class DMuon(torch.optim.Optimizer):
    """Distributed Muon + AdamW (docs/pytorch.md: the routing rule, param groups, options, defaults and checkpoints).

    params: the model (routed by name and module type), model.named_parameters() (by name, params.py), tensors (by
        shape, with a warning) or param groups (use_muon=True/False or routed); plain (replicated), DTensor (any mix of
        Replicate, Shard and _StridedShard: FSDP2, HSDP, TP, EP; layout.py) or dmuon.torch.Sharded.
    lr: the learning rate of every parameter (AdamW's too unless adamw_lr is given).
    momentum: Muon's momentum (lerp), in [0, 1).
    nesterov: Muon's Nesterov momentum.
    weight_decay: decoupled weight decay with the unscaled lr, of every parameter (AdamW's too unless
        adamw_weight_decay is given).
    adamw_lr: AdamW's learning rate (None: lr's).
    adamw_betas: AdamW's betas (a group's "betas").
    adamw_eps: AdamW's eps (a group's "eps").
    adamw_weight_decay: AdamW's decoupled weight decay (None: weight_decay's).
    balancer: the owner planner's balancer, "milp", "lpt" or "rr" (dmuon.plan_owners).
    process_group: the torch.distributed group of the ranks (None: the default group).
    clip_grad_norm: clip the global gradient norm to this (None: no clipping).
    nonfinite: a non-finite gradient skips the step; "error" raises FloatingPointError, "skip" counts skipped_steps.
    state_dtype: the dtype of Muon's momentum, NorMuon's v and AdamW's moments, a group's key (float32, bfloat16 or
        None: each parameter's own; the step computes in float32 at least, rounding each store; a change converts).
    experts: experts(name, global_shape) -> bool, which 3-D Muon parameters are stacks of experts (default: "expert"
        in a name component); every other ≥ 3-D one is one (out, in·k…) matrix (matrices.py).
    tune_cache: the Newton–Schulz tuning cache ("" the default path, None none, else a path; dmuon.tune).
    ns_dtype: Newton–Schulz's compute dtype, "float32" or "bfloat16" or the torch dtypes (None: the dtype the tuner
        measured faster for a shape tune_cache has, else the device's default; `ns_dtypes_ran`: what this rank ran).
    engine: who computes Muon's update, "dmuon" (libdmuon_c), "torch" (torch ops) or "auto" (libdmuon_c where it
        runs on the Muon parameters' devices, else torch ops, with a warning; engine.py); the resolved one: `engine`.
    step_memory: bytes per Newton–Schulz batch of an owner ("auto": twice the largest matrix's, at least 256 MiB;
        None or 0: no bound; matrices.step_budget; the same result bit for bit).
    options: Muon's options as keywords, the keys of muon_options.DEFAULTS (the Newton–Schulz, its split, the
        scale, cautious weight decay, the variant and each variant's own); any other keyword is a TypeError.

    Each param group is all-Muon (lr, momentum, nesterov, weight_decay, Muon's options) or all-AdamW (lr, betas,
    eps, weight_decay), so LR schedulers set its "lr" as torch.optim's; `defaults` holds every keyword's value.
    Construction, add_param_group and step() are collective over process_group; state_dict() and load_state_dict()
    are local, as torch's (save and reshard with torch.distributed.checkpoint). The counters `updates` and
    `skipped_steps` live in every param group.
    """

    # The defaults, and where they differ from the C++ engine's on purpose: docs/pytorch.md, "Defaults".
    def __init__(self, params, *, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, adamw_lr=None,
                 adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=None, balancer="milp",
                 process_group=None, clip_grad_norm=None, nonfinite="error", state_dtype=torch.float32,
                 experts=is_expert_stack_by_default, tune_cache="", ns_dtype=None, engine="auto", step_memory="auto",
                 **options):
        ns_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(ns_dtype, ns_dtype)
        muon = {**MUON_DEFAULTS, **options}  # Muon's options: muon_options.DEFAULTS, the one table
        check_arguments(options, ns_dtype, lr, momentum, weight_decay, adamw_lr, adamw_betas, adamw_eps,
                        adamw_weight_decay, muon, balancer, nonfinite, engine, clip_grad_norm, state_dtype, step_memory)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, adamw_lr=adamw_lr,
                        adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
                        state_dtype=state_dtype_value(state_dtype, "DMuon"), **muon)
        self.comm = Group(process_group)
        self.clip_grad_norm = clip_grad_norm
        self.nonfinite = nonfinite
        self.experts = experts
        self._balancer = balancer
        # the budget: step_budget's, set when matrices are planned
        self._step_memory, self._step_budget = step_memory, None
        self._tune_cache = tune_cache
        self._threads = torch.get_num_threads()
        self._ns_dtype = ns_dtype  # Newton–Schulz's compute dtype, every group's (None: the device's default)
        self._engine_choice, self.engine = engine, None  # the engine: resolved by the first _parse
        self.param_groups_names, self._layouts, self._groups = [], [], []
        self._matrices, self.owners = [], {}  # every Muon matrix, in parameter order; its owner by name
        self._state_dtypes = {}  # id(param group) → the state_dtype its parameters' state is kept in

        self._model = None  # DMuon(model): a weak reference to it, where _follow_replaced_parameters reads
        if isinstance(params, torch.nn.Module):
            self._model = weakref.ref(params)
            adopt_replaced(params)  # parameter objects that .to_empty() replaced get their held marks
            params = module_groups(params)
        torch_groups, layouts = self._parse(params, defaults, first_group=0)
        self._constructed = False
        super().__init__(torch_groups, defaults)  # its add_param_group calls only append them
        self._constructed = True
        self._step_hooks = []  # (key, step_hooks.StepHook): the held schedules (_track), a QKClip (add_step_hook)
        self._ns = {}  # MuonOptions.newton_schulz → the engine's Newton–Schulz handle (ns_of)
        self.ns = self.ns_of(MuonOptions.of_group(defaults))  # the constructor's setting
        self._pending = []  # (GradientCheck, step hooks, sizes of their extras) of steps not settled yet, oldest first
        self._last_grad_norm = 0.0
        self._last_ns = (NsClock(), 0)  # the last step's Newton–Schulz clock and matrix count (last_stats)
        self._last_extra = {}  # the rest of last_stats: what the step hooks reported ("qk_clip_skipped")
        self._track(layouts)

    @property
    def last_stats(self):
        """This rank's last step: {"ns_s": seconds of Newton–Schulz (on CUDA the device's time between events around
        it; reading it waits for that work), "ns_matrices": matrices orthogonalized, and where a QKClip joined
        "qk_clip_skipped" (a 0-dim bool tensor: whether it skipped this step)}."""
        clock, matrices = self._last_ns
        return {"ns_s": clock.seconds(), "ns_matrices": matrices, **self._last_extra}

    def add_param_group(self, param_group):
        """Adds parameters to optimize from the next step(): a param group as DMuon's `params` takes
        one (tensors, (name, tensor) pairs or Sharded; use_muon; hyper-parameters, the rest from
        `defaults`). A group without use_muon is split as at construction, so param_groups may grow
        by two. Collective, like construction: every rank calls it with the same parameter names and
        shapes, and a difference, a parameter the optimizer has already, or a bad value raises the
        same exception on every rank. The new Muon matrices' owners are planned among themselves
        (on rank 0, with the optimizer's balancer); existing owners, and the state they hold, stay.
        """
        if not self._constructed:  # torch.optim.Optimizer.__init__ registering the groups _parse made
            self.param_groups.append(param_group)
            return
        self._settle()
        torch_groups, layouts = self._parse(param_group, self.defaults, first_group=len(self.param_groups))
        self.param_groups.extend(torch_groups)
        self._track(layouts)

    def _parse(self, params, defaults, first_group):
        """(torch param groups, [(name, Layout, torch group)]) from DMuon's `params`, or from
        add_param_group's one group when first_group > 0 (collective).

        Every rank parses its parameters; errors and the parameter lists are then compared across
        ranks, so a problem on one rank becomes the same exception on all of them (no hang)."""
        groups, layouts, error = [], [], None
        named_groups = "param_names" in self.param_groups[0] if first_group else None
        try:
            groups = split_groups(params, defaults, first_group, warn=self.comm.rank == 0, named_groups=named_groups)
            seen = {id(l.tensor): n for n, l in zip(self.param_groups_names, self._layouts)}
            layouts = describe_groups(self.comm, groups, seen, self.experts)
            muon_devices = [(name, l.local(l.tensor).device, work_dtype(g, l.tensor))
                            for name, l, g in layouts if g["use_muon"]]  # (name, device, U's dtype)
            if self.engine is None:
                self.engine = make_engine(self._engine_choice, {d for _, d, _ in muon_devices}, self._threads,
                                          self._tune_cache, self._ns_dtype, warn=self.comm.rank == 0)
            for name, device, dtype in muon_devices:
                try:
                    self.engine.ns_dtype(device, dtype)
                except dmuon.UnsupportedError as e:
                    raise ValueError(f"DMuon: parameter '{name}': {e}") from None
        except (ValueError, TypeError, dmuon.DmuonError) as e:
            error = (TypeError, str(e)) if isinstance(e, TypeError) else str(e)  # torch.optim's kinds
        agree_on_parameters(self.comm, error, [(n, l.global_shape, l.holdings, g["use_muon"]) for n, l, g in layouts])
        return torch_groups_of(groups, layouts)

    def _track(self, layouts):
        """Appends _parse's parameters, their groups registered in param_groups, to the optimizer's
        agreed order, plans the owners of their Muon matrices (collective) and creates their state.
        New groups take the optimizer's counters."""
        counters = {key: next((g[key] for g in self.param_groups if key in g), 0) for key in _COUNTERS}
        for g in self.param_groups:
            for key, value in counters.items():
                g.setdefault(key, value)
            self._state_dtypes.setdefault(id(g), g["state_dtype"])
        first = len(self._layouts)
        for name, layout, group in layouts:
            self.param_groups_names.append(name)
            self._layouts.append(layout)
            self._groups.append(group)
            if layout.held is not None:  # its schedule reduces its gradient before a step, refreshes it after
                self.add_step_hook(layout.held.schedule)
        matrices = plan_matrices(self.comm, [(first + j, *t) for j, t in enumerate(layouts)], self.experts,
                                 self._balancer, self._threads, self._tune_cache)
        self._step_budget = step_budget(self._matrices + matrices, self._step_memory)
        self._matrices.extend(matrices)
        self.owners.update((k.name, k.owner) for k in matrices)
        for k in matrices:
            self.ns_of(k.options)
        self._buckets = buckets_of(self._matrices, matrix_dtypes, self._step_budget)
        for i in range(first, len(self._layouts)):
            self._zero_state(i)

    def _follow_replaced_parameters(self):
        """Tracks anew the tensors a framework put in param_groups after construction (accelerate's FSDP2
        preparation; frameworks.replaced_parameters says when and which), as if DMuon had been built over them:
        their layouts, owners (collective: every rank meets the same replacement at the same call), zero state."""
        model = self._model() if self._model is not None else None
        updated = bool(self._pending) or any(self.param_groups[0][key] for key in _COUNTERS)
        groups = replaced_parameters(self.param_groups, self.param_groups_names, [l.tensor for l in self._layouts],
                                     model, updated)
        if groups is None:
            return
        self.param_groups_names, self._layouts, self._groups, self._matrices, self.owners = [], [], [], [], {}
        self.state.clear()
        torch_groups, layouts = self._parse(groups, self.defaults, first_group=0)
        old_of = {id(new): old for new, old in zip(torch_groups, self.param_groups)}
        for new, old in zip(torch_groups, self.param_groups):
            old["params"] = new["params"]  # the tensors described (the model's, where it was given)
        self._track([(name, layout, old_of[id(group)]) for name, layout, group in layouts])

    def ns_of(self, options):
        """The engine's Newton–Schulz handle of a MuonOptions' setting (a dmuon.Orthogonalizer for libdmuon_c), one
        per distinct setting."""
        if options.newton_schulz not in self._ns:
            self._ns[options.newton_schulz] = self.engine.newton_schulz(options)
        return self._ns[options.newton_schulz]

    @property
    def ns_dtypes_ran(self):
        """The compute dtypes ("bfloat16", "float32") this rank's Newton–Schulz ran in so far, sorted: per shape the
        one asked for (ns_dtype), else the tuned choice or the device's default (the engine's ns_ran)."""
        return sorted(set(self.engine.ns_ran.values()))

    def _refreeze_options(self):
        """Every Muon matrix's options from its param group again (after load_state_dict), and the buckets."""
        for k in self._matrices:
            k.options = MuonOptions.of_group(k.group)
            self.ns_of(k.options)
        self._buckets = buckets_of(self._matrices, matrix_dtypes, self._step_budget)

    @property
    def updates(self):
        """Updates applied."""
        self._settle()
        return self.param_groups[0]["updates"]

    @property
    def skipped_steps(self):
        """Updates skipped for a non-finite gradient (nonfinite="skip")."""
        self._settle()
        return self.param_groups[0]["skipped_steps"]

    def _count(self, key):
        value = self.param_groups[0][key] + 1
        for g in self.param_groups:
            g[key] = value

    def _zero_state(self, i):
        layout = self._layouts[i]
        self.state[layout.tensor] = zero_state(self.param_groups_names[i], layout, self._groups[i], self.experts,
                                               state_dtype(self._groups[i], layout.tensor))

    def _follow_state_dtypes(self):
        """Converts the state of the param groups whose state_dtype changed since their state was made or last
        converted into it (each value rounded to nearest even: torch's .to), and batches the buckets anew."""
        changed = [g for g in self.param_groups if self._state_dtypes.get(id(g)) != g["state_dtype"]]
        for g in changed:
            for i in (i for i, group in enumerate(self._groups) if group is g):
                convert_state(self.state[self._layouts[i].tensor], state_dtype(g, self._layouts[i].tensor))
            self._state_dtypes[id(g)] = g["state_dtype"]
        if changed:
            self._buckets = buckets_of(self._matrices, matrix_dtypes, self._step_budget)

    # ---- the step ----

    @torch.compiler.disable  # a clean graph break under torch.compile: libdmuon_c is called through ctypes
    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient on some rank (collective). Nothing here
        waits for the device: the gradient norm, the clipping factor and the non-finite check stay
        device tensors (gradient_check.py), and the host reads them once they have arrived: at the end
        of a CPU step; on a GPU at a later step() that finds them there, or when updates,
        skipped_steps, last_grad_norm or state_dict() are read (those wait for them). A non-finite
        gradient skips the step on the device either way; with nonfinite="error" the call that
        settles it raises FloatingPointError naming it. So does a maximum logit QK-clip cannot take
        (qk_clip.py: NaN, inf, or large enough to scale weights to 0) under "error"; under "skip" that
        step updates without the clip, counted in the QKClip's skipped_steps.

        A step that raises changes nothing: everything that can raise on the host runs before the first
        write (the "checks" phase below), and what is known on the device alone (non-finite gradients and
        maxima) masks every write of the step (weights, momentum, AdamW's moments and step count,
        NorMuon's v, QK-clip's rescale), so the call that settles it raises with every tensor as it was (state whose
        group's state_dtype was set since the last step is converted first, as that setting asks)."""
        self._settle(arrived_only=True)
        self._follow_replaced_parameters()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_group_values()  # everything that can raise on the host runs before the first write
        self._follow_state_dtypes()  # a group's state_dtype set since the last step: its state converted
        hooks = [hook for _, hook in self._step_hooks]
        for hook in hooks:  # 1. hooks before (the held schedules: their gradients reduced)
            hook.before_step()
        grads = [l.local(as_placed(l.tensor.grad, l.tensor)) if l.tensor.grad is not None and not l.held_elsewhere
                 else None for l in self._layouts]
        taking_part = [l.tensor.requires_grad for l in self._layouts]
        check, extras = self._check_gradients(grads, taking_part, hooks)  # 2. the gradient check
        self._pending.append((check, hooks, [None if e is None else e.numel() for e in extras]))
        # ---- writes, masked on the device by the step's check (keep, finite) ----
        adamw_phase(self._groups, self._layouts, self.state, grads, taking_part, check)  # 3. AdamW
        self._muon_phase(grads, taking_part, check)  # 4. the Muon exchange
        for hook, extra in reversed(list(zip(hooks, extras))):  # 5. hooks after (QK-clip, the held schedules)
            self._last_extra.update(hook.after_step(extra, check.finite) or {})
        self._settle(arrived_only=True)
        return loss

    def _check_gradients(self, grads, taking_part, hooks):
        """(the step's GradientCheck, each hook's part of its all-reduced extras): the all-reduce, launched, with
        every hook's extra(); on a CPU step, also the check that every rank takes part in the same parameters."""
        counted = [l.mine.replica == 0 for l in self._layouts]
        device = next((g.device for g in grads if g is not None), None) or self._layouts[0].tensor.device
        parts = [hook.extra(self.comm.rank, self.comm.world) for hook in hooks]
        given = [t for t in parts if t is not None]
        check = GradientCheck(self.comm, grads, counted, taking_part, self.clip_grad_norm, device,
                              torch.cat(given) if given else None)
        if check.arrived():  # a CPU step can afford the check that keeps its all-to-alls in step (a GPU's cannot)
            disagreement = check.first_disagreement()
            if disagreement is not None:
                i, ranks = disagreement
                raise ValueError(f"DMuon: parameter '{self.param_groups_names[i]}' requires grad on {ranks} of "
                                 f"{self.comm.world} ranks; every rank must set requires_grad alike")
        extras, offset = [], 0
        for t in parts:
            extras.append(None if t is None else check.extra[offset:offset + t.numel()])
            offset += 0 if t is None else t.numel()
        if self.nonfinite == "error":  # a hook's veto (QK-clip: a maximum it cannot take) skips the whole step
            for hook, extra in zip(hooks, extras):
                ok = hook.veto(extra)
                if ok is not None:
                    check.veto(ok)  # the whole step changes nothing; settling it raises
        return check, extras

    def _muon_phase(self, grads, taking_part, check):
        """The Muon parameters' step: the exchange (exchange.py) over the buckets."""
        def momentum(i):
            layout = self._layouts[i]
            return layout.local(self.state[layout.tensor]["momentum_buffer"])

        def row_state(k):
            return k.layout.local(self.state[k.layout.tensor][k.variant.row_state])

        muon = Exchange(self.comm, self.engine, self.ns_of, momentum, grads, check, matrix_dtypes, row_state)
        me = self.comm.rank
        # Every matrix that may have a gradient takes part (whether it has one anywhere is known on the
        # device only); owner-held buckets (their own, see matrices.buckets_of) run on the owner alone, where
        # nothing travels; held TP slices travel within the owner's TP group, in an exchange every rank joins.
        muon.run([[k for k in bucket if taking_part[k.index]
                   and (k.layout.held is None or k.owner == me or k.u_travels or k.o_travels)]
                  for bucket in self._buckets])
        self._last_ns, self._last_extra = (muon.ns_clock, muon.ns_matrices), {}

    def _check_group_values(self):
        """Every param group's hyper-parameters (a scheduler or the user may have set them since the last
        step), by torch.optim's checks: ValueError naming the group before anything is written."""
        name_of = {id(l.tensor): n for n, l in zip(self.param_groups_names, self._layouts)}
        for g in self.param_groups:
            if g["params"]:
                check_group(g, name_of[id(g["params"][0])], options=False)  # options: frozen per matrix

    def add_step_hook(self, hook, key=None):
        """Joins `hook` (step_hooks.StepHook's protocol) to every later step(): its before_step in the order hooks
        joined, after_step in reverse order. A hook joins once; one given a key takes the place of the hook that
        joined with that key (a QKClip's "qk_clip": one per optimizer). QKClip joins so, and each owner-held
        parameter's schedule when DMuon tracks it."""
        keys = [k for k, _ in self._step_hooks]
        if key is not None and key in keys:
            self._step_hooks[keys.index(key)] = (key, hook)
        elif all(h is not hook for _, h in self._step_hooks):
            self._step_hooks.append((key, hook))

    def layouts(self):
        """Every parameter's layout.Layout, in the optimizer's order (param_groups_names'): what a step hook reads."""
        return tuple(self._layouts)

    def _settle(self, arrived_only=False):
        """Reads the pending steps' GradientChecks in order (arrived_only: those that need no wait):
        counts each update or skipped step, sets last_grad_norm, raises FloatingPointError for a
        non-finite gradient or a problem a step hook found in its extra (QK-clip: a maximum logit it could not
        take) under nonfinite="error"; under "skip" the skipped step is counted (a hook counts what it skipped)."""
        while self._pending and (not arrived_only or self._pending[0][0].arrived()):
            check, hooks, sizes = self._pending.pop(0)
            verdict = check.settle()
            update = self.param_groups[0]["updates"] + 1
            problems, offset = [], 0
            for hook, size in zip(hooks, sizes):
                if size is not None:
                    problems += hook.settle(verdict.extra[offset:offset + size], update)
                    offset += size
            if verdict.bad or problems:
                if self.nonfinite == "skip":
                    if verdict.bad:
                        self._count("skipped_steps")
                        continue
                else:
                    where = ", ".join(f"'{self.param_groups_names[i]}' on rank {r}" for r, i in verdict.bad)
                    problems = ([f"non-finite gradient in parameter {where}"] if verdict.bad else []) + problems
                    raise FloatingPointError(f"DMuon: {'; '.join(problems)} at update {update} (that step was "
                                             "skipped: nothing changed)")
            self._last_grad_norm = verdict.norm
            if verdict.any_gradient:
                self._count("updates")

    @property
    def last_grad_norm(self):
        """The global gradient norm of the last step (before clipping; of the finite gradients)."""
        self._settle()
        return self._last_grad_norm

    def state_dict(self):
        self._settle()
        self._follow_replaced_parameters()
        return super().state_dict()

    # ---- checkpoints (state_dict() is torch.optim.Optimizer's: local, keyed by index) ----

    @torch._disable_dynamo
    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Loads a state_dict() of a DMuon over parameters of the same groups, kinds and layouts, with
        or without names: parameters are matched by position in param_groups, as torch.optim.Optimizer
        does (so DCP's set_state_dict, whose keys are parameter names, works), and saved tensors are
        copied into this optimizer's state (a DTensor into a DTensor of the same mesh and placements).
        The saved groups' values replace the groups' own (their "param_names" too, as torch's). Runs
        the load_state_dict pre- and post-hooks as torch.optim.Optimizer does. Local."""
        self._settle()
        self._follow_replaced_parameters()
        state_dict = state_dict.copy()  # shallow, as torch's: a pre-hook may change it in place
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        entries = checked_entries(self.param_groups, state_dict, self._layouts, self.param_groups_names,
                                  self._matrices, self.state)  # before anything is written: a refused one loses nothing
        for i, entry, dtype in entries:  # saved values cast into the state_dtype of the loaded groups
            convert_state(self.state[self._layouts[i].tensor], dtype)
            if entry is None:
                self._zero_state(i)
            else:
                load_entry(self._layouts[i], self.state[self._layouts[i].tensor], entry)
        load_group_values(self.param_groups, state_dict["param_groups"])
        self._follow_state_dtypes()  # zero state made in a group's former state_dtype
        self._refreeze_options()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---- copies (copy.deepcopy, pickle) ----

    def __getstate__(self):
        """torch.optim.Optimizer's (defaults, state, param_groups) and DMuon's own attributes, but the
        Newton–Schulz engine handles (rebuilt by __setstate__) and the hooks (a copy has none, as torch's). The
        process group is shared by a deep copy and pickled as the default group (collectives.Group)."""
        if any(layout.held is not None for layout in self._layouts):
            raise TypeError("DMuon over owner-held parameters (dmuon.torch.hold_on_owners) cannot be copied or "
                            "pickled: their hooks and buffers belong to the model; save its state_dict() instead")
        self._settle()
        state = super().__getstate__()
        state.update((k, v) for k, v in self.__dict__.items()
                     if k not in ("ns", "_ns", "_model") and not k.startswith("_optimizer_"))
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._model = None  # a copy follows its own param_groups
        self._state_dtypes = {id(g): g["state_dtype"] for g in self.param_groups}  # the copy's own groups
        self._ns = {}
        self.engine.ns_ran = {}  # keyed by the handles, which a copy makes anew
        self.ns = self.ns_of(MuonOptions.of_group(self.defaults))

