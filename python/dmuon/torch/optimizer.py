"""dmuon.torch.DMuon: Muon for hidden matrices + AdamW for the rest, as a torch.optim optimizer over
torch.distributed, with Newton–Schulz in dmuon's C++ engine, or in torch ops on devices it lacks (engine.py;
docs/pytorch.md).

Semantics are DESIGN section 1 and the C++ optimizers': one global gradient norm (clipping and the
non-finite check, agreed across ranks), AdamW as torch.optim.AdamW (bias-corrected, decoupled decay),
Muon's lerp momentum with Nesterov, Newton–Schulz, the chosen scale, decoupled decay with the
unscaled lr. Each Muon matrix (an expert of an (E, m, n) stack is one) has one owner rank in the
whole group, which alone runs its Newton–Schulz (muon_step.py).

Optimizer state follows torch.optim.AdamW under FSDP2, so torch.distributed.checkpoint saves and
reshards it: state[param] holds tensors laid out as the parameter (DTensors with its mesh and
placements for a DTensor parameter, full tensors for a replicated one), created at construction.
"""

import copy
import math
import weakref

import torch

import dmuon
from dmuon.torch.adamw import adamw_step
from dmuon.torch.agreement import agree_on_parameters, plan_on_rank0
from dmuon.torch.collectives import Group
from dmuon.torch.dense import check_writable
from dmuon.torch.engine import ENGINES, make_engine
from dmuon.torch.gradient_check import GradientCheck
from dmuon.torch.layout import as_placed, describe, is_dtensor
from dmuon.torch.muon_options import MuonOptions, check_options
from dmuon.torch.muon_step import MuonMatrix, MuonStep, assign_owners, matrices_of
from dmuon.torch.normuon import width, zero_variance
from dmuon.torch.ns_clock import NsClock
from dmuon.torch.params import MUON_ONLY, without_compile_prefix, is_expert_stack_by_default, module_groups, split_groups

_BALANCERS = ("milp", "lpt", "rr")
_COUNTERS = ("updates", "skipped_steps")  # kept in every param group, so checkpoints carry them


class DMuon(torch.optim.Optimizer):
    """Distributed Muon + AdamW. `params`: the model itself (routed by name and module type),
    model.named_parameters() (routed by name: hidden ≥2-D matrices → Muon; embeddings, head, 1-D →
    AdamW; params.py states the rule), tensors (routed by shape alone, with a warning), or param
    groups, with use_muon=True/False or without. Parameters may be plain (replicated: DDP or single
    process), DTensors (any mix of Replicate(), Shard(d) and _StridedShard on a mesh of the optimizer's
    group's ranks, or a named slice of one: FSDP2, HSDP, tensor and expert parallelism, FSDP2 over TP;
    layout.py) or dmuon.torch.Sharded descriptions of dim-0 chunks.

    `defaults` holds the per-group hyper-parameters and options under their keyword names (lr, momentum,
    nesterov, weight_decay, Muon's options ns_steps, coeffs, algo, scale, extra_scale_factor, cautious_wd,
    split_heads, split_sizes, split_dim, variant, normuon_beta2, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay). Each param
    group is all-Muon (keys lr, momentum, nesterov, weight_decay and Muon's options) or all-AdamW (lr,
    betas, eps, weight_decay), so a group's "lr" is the lr of every parameter in it and LR schedulers set
    it as torch.optim's. Muon's options (muon_options.py: the Newton–Schulz and its split, the update
    scale, cautious weight decay, NorMuon) are read from a group when its matrices are tracked (construction,
    add_param_group) and when a state_dict is loaded. lr and weight_decay, given to DMuon or in a group,
    reach every parameter;
    adamw_lr and adamw_weight_decay (None: lr's, weight_decay's) only AdamW's, before them.
    A user group becomes one param group, or two (Muon's, then AdamW's) when it has no use_muon and
    holds both kinds; named parameters put "param_names" in their groups (split_groups in params.py;
    docs/pytorch.md, "Param groups"). Schedulers that cycle momentum (OneCycleLR, CyclicLR with
    cycle_momentum) find "momentum" in defaults and write group["momentum"] in every group: Muon
    groups follow it; AdamW groups keep their betas (the key is ignored there).

    experts(name, global_shape) -> bool: which 3-D Muon parameters are stacks of experts (E
    matrices of m×n); by default those with "expert" in a name component. Every other ≥ 3-D
    parameter is one (out, in·k…) matrix, as a convolution's filter.

    tune_cache: the Newton–Schulz tuning cache (`dmuon tune`, dmuon.tune) that picks each bucket's kernel
    (algo="auto") and the owner planner's costs: "" the default path (dmuon.default_tune_cache_path()),
    None none (untuned kernels, flop costs), else a path. Give hold_on_owners the same one.

    ns_dtype: Newton–Schulz's compute dtype (its iterates; products accumulate in float32), chosen explicitly:
    "float32" or "bfloat16" (torch.float32 / torch.bfloat16 too), whatever the parameters' dtype; None (the default):
    the device's default: on the CPU bfloat16 where it has bf16 matrix units (AMX), float32 elsewhere, except
    that a shape tune_cache has (dmuon tune's default, dmuon.tune) runs in the dtype the tuner measured faster there;
    on a GPU the engine's bfloat16 (docs/pytorch.md, "Defaults").

    state_dtype: the dtype of Muon's momentum and AdamW's moments (float32 by default, so bf16
    parameters keep float32 state; None: each parameter's own dtype).

    engine: who computes Muon's update (engine.py): "dmuon" libdmuon_c's C++ engine (its CPU backend, its CUDA
    backend for CUDA tensors; tuned kernels), "torch" the same rules and recurrences in torch ops on any device
    torch has, "auto" (the default) libdmuon_c where it loads and runs on the Muon parameters' devices, else torch
    ops, with one warning naming the engine it would have used. The resolved one is `engine` (its .name).

    Construction, add_param_group and step() are collective over process_group (every rank, same
    parameter names and shapes). state_dict() is local, as torch's optimizers': {"state": {index:
    state}, "param_groups": [...]} with this rank's tensors (DTensors for DTensor parameters); use
    torch.distributed.checkpoint (get_state_dict/set_state_dict, dcp.save/dcp.load) to save and to
    load at another world size, or torch.save of state_dict() per rank to resume at the same one.
    load_state_dict() is local. The counters `updates` and `skipped_steps` live in every param group.
    """

    # Defaults, and where they differ from the C++ engine's on purpose (docs/pytorch.md, "Defaults"): Muon's
    # lr, momentum and Nesterov equal MuonHyper's (optim.hpp). AdamW parameters take the same lr unless
    # adamw_lr is given, for scale="match_rms_adamw" gives Muon's updates AdamW's RMS (Moonlight), so the two
    # halves share one lr and schedule; AdamW's betas (0.9, 0.95) are the usual setting of the transformer
    # AdamW this optimizer replaces. optim.hpp's AdamWHyper keeps torch.optim.AdamW's own defaults (lr 1e-3,
    # betas (0.9, 0.999)) and MuonScale::original is KellerJordan/Muon's, the definitions the golden tensors
    # pin; trainer.hpp's 3e-3 is the GPT example's.
    def __init__(self, params, *, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, adamw_lr=None,
                 adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=None, ns_steps=5, coeffs="keller",
                 algo="auto", scale="match_rms_adamw", extra_scale_factor=1.0, cautious_wd=False, split_heads=None,
                 split_sizes=None, split_dim=0, variant="muon", normuon_beta2=0.95, balancer="milp",
                 process_group=None, clip_grad_norm=None, nonfinite="error", state_dtype=torch.float32,
                 experts=is_expert_stack_by_default, tune_cache="", ns_dtype=None, engine="auto"):
        ns_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(ns_dtype, ns_dtype)
        _check_choice("ns_dtype", ns_dtype, (None, "float32", "bfloat16"))
        _check_defaults(lr, momentum, weight_decay, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay)
        muon = dict(ns_steps=ns_steps, coeffs=coeffs, algo=algo, scale=scale, extra_scale_factor=extra_scale_factor,
                    cautious_wd=cautious_wd, split_heads=split_heads, split_sizes=split_sizes, split_dim=split_dim,
                    variant=variant, normuon_beta2=normuon_beta2)
        check_options(muon, "DMuon")
        _check_choice("balancer", balancer, _BALANCERS)
        _check_choice("nonfinite", nonfinite, ("error", "skip"))
        _check_choice("engine", engine, ENGINES)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"DMuon: clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
        if state_dtype is not None and not (isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point):
            raise ValueError(f"DMuon: state_dtype must be a floating-point torch.dtype or None, got {state_dtype!r}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, adamw_lr=adamw_lr,
                        adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
                        **muon)
        self.comm = Group(process_group)
        self.clip_grad_norm = clip_grad_norm
        self.nonfinite = nonfinite
        self.state_dtype = state_dtype
        self.experts = experts
        self._balancer = balancer
        self._tune_cache = tune_cache
        self._threads = torch.get_num_threads()
        self._ns_dtype = ns_dtype  # Newton–Schulz's compute dtype, every group's (None: the device's default)
        self._engine_choice, self.engine = engine, None  # the engine: resolved by the first _parse
        self.param_groups_names, self._layouts, self._groups = [], [], []
        self._matrices, self.owners = [], {}  # every Muon matrix, in parameter order; its owner by name

        self._model = None  # DMuon(model): a weak reference to it, where _follow_replaced_parameters reads
        if isinstance(params, torch.nn.Module):
            self._model = weakref.ref(params)
            for schedule in params.__dict__.get("_dmuon_held_schedules", ()):
                schedule.adopt()  # parameter objects that .to_empty() replaced get their held marks
            params = module_groups(params)
        torch_groups, layouts = self._parse(params, defaults, first_group=0)
        self._constructed = False
        super().__init__(torch_groups, defaults)  # its add_param_group calls only append them
        self._constructed = True
        self._ns = {}  # MuonOptions.newton_schulz → the engine's Newton–Schulz handle (ns_of)
        self.ns = self.ns_of(MuonOptions.of_group(defaults))  # the constructor's setting
        self._pending = []  # the GradientChecks of steps not settled yet, oldest first
        self._last_grad_norm = 0.0
        self._last_ns = (NsClock(), 0)  # the last step's Newton–Schulz clock and matrix count (last_stats)
        self._last_extra = {}  # the rest of last_stats: "qk_clip_skipped" where a QKClip joined
        self._qk_clip = None  # the QKClip (qk_clip.py) that joined this optimizer, run after each step
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
        muon_devices = []  # (name, device, state dtype) of each Muon parameter
        try:
            groups = split_groups(params, defaults, first_group, warn=self.comm.rank == 0, named_groups=named_groups)
            seen = {id(l.tensor): n for n, l in zip(self.param_groups_names, self._layouts)}
            for g in groups:
                _check_hyper(g, g["named"][0][0])
                for name, p in g["named"]:
                    layout = describe(name, p, self.comm.pg, self.comm.ranks, self.comm.rank)
                    if not layout.held_elsewhere:
                        check_writable(name, layout.local(layout.tensor))
                    if id(layout.tensor) in seen:
                        raise ValueError(f"DMuon: some parameters appear in more than one parameter group: "
                                         f"'{name}' (also '{seen[id(layout.tensor)]}')")
                    seen[id(layout.tensor)] = name
                    if g["use_muon"] and self.experts(name, layout.global_shape) and len(layout.global_shape) != 3:
                        raise ValueError(f"DMuon: parameter '{name}' of shape {layout.global_shape} is marked a "
                                         "stack of experts (the experts predicate); a stack is (E, rows, cols)")
                    if g["use_muon"] and len(layout.global_shape) >= 3 and not self.experts(name, layout.global_shape) \
                            and not all(h.whole_along(layout.global_shape, range(1, len(layout.global_shape)))
                                        for h in layout.holdings):
                        raise ValueError(f"DMuon: parameter '{name}' of shape {layout.global_shape} is one (out, in·k…) "
                                         f"matrix for Muon (a filter), but its placements {layout.placements} split "
                                         "its dims ≥ 1 (dmuon takes such a filter sharded on dim 0 only)")
                    if g["use_muon"]:
                        for expert, rows, cols in matrices_of(layout.global_shape,
                                                              self.experts(name, layout.global_shape)):
                            MuonOptions.of_group(g).blocks(rows, cols, name)
                    if layout.held is not None and not g["use_muon"]:
                        raise ValueError(f"DMuon: parameter '{name}' is held on its owner "
                                         "(dmuon.torch.hold_on_owners) for Muon, but its param group is AdamW's")
                    if g["use_muon"]:
                        muon_devices.append((name, layout.local(layout.tensor).device,
                                             self._state_dtype_of(layout.tensor)))
                    layouts.append((name, layout, g))
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
        signature = [(n, l.global_shape, l.holdings, g["use_muon"]) for n, l, g in layouts]
        agree_on_parameters(self.comm, error, signature)

        torch_groups, torch_group_of = [], {}
        for g in groups:
            hyper = {k: v for k, v in g.items() if k not in ("named", "param_names")}
            hyper["params"] = [l.tensor for n, l, gg in layouts if gg is g]
            if g["param_names"]:
                hyper["param_names"] = [n for n, _ in g["named"]]
            torch_groups.append(hyper)
            torch_group_of[id(g)] = hyper
        return torch_groups, [(n, l, torch_group_of[id(g)]) for n, l, g in layouts]

    def _track(self, layouts):
        """Appends _parse's parameters, their groups registered in param_groups, to the optimizer's
        agreed order, plans the owners of their Muon matrices (collective) and creates their state.
        New groups take the optimizer's counters."""
        counters = {key: next((g[key] for g in self.param_groups if key in g), 0) for key in _COUNTERS}
        for g in self.param_groups:
            for key, value in counters.items():
                g.setdefault(key, value)
        first = len(self._layouts)
        matrices = []
        for name, layout, group in layouts:
            i = len(self._layouts)
            self.param_groups_names.append(name)
            self._layouts.append(layout)
            self._groups.append(group)
            if group["use_muon"]:
                for expert, rows, cols in matrices_of(layout.global_shape, self.experts(name, layout.global_shape)):
                    if rows == 0 or cols == 0:
                        continue  # an empty matrix: nothing to orthogonalize or update
                    matrices.append(MuonMatrix(i, expert, name + ("" if expert is None else f"[{expert}]"), layout,
                                               group, rows, cols, MuonOptions.of_group(group)))
        assign_owners(matrices, self.comm.world,
                      lambda shapes, world, blocks: plan_on_rank0(self.comm, shapes, self._balancer, self._threads,
                                                                  self._tune_cache, blocks))
        self._matrices.extend(matrices)
        self.owners.update((k.name, k.owner) for k in matrices)
        for k in matrices:
            self.ns_of(k.options)
        self._buckets = _buckets(self._matrices, lambda k: self._state_dtype_of(k.layout.tensor))
        for i in range(first, len(self._layouts)):
            self._zero_state(i)

    def _follow_replaced_parameters(self):
        """Follows a framework that replaced the tensors in param_groups after construction: accelerate's
        FSDP2 preparation (Accelerator.prepare(model, optimizer), as Hugging Face Trainer calls it with the
        optimizer built before the model is sharded) puts each parameter's sharded DTensor in its place
        (fsdp2_switch_optimizer_parameters). Before the first update DMuon then describes the new tensors
        under the old names (collective: every rank meets the same replacement at the same call), plans
        their owners and starts from zero state, as if it had been built over them; after an update the
        state held for the old tensors would be lost, so it refuses, naming the fix. Built from the model
        (DMuon(model)), it takes the tensors the model registers under those names: accelerate matches
        parameters by data pointer, which owner-held placeholders (no storage) do not have, so its switch
        puts another parameter in their place."""
        current = [p for g in self.param_groups for p in g["params"]]
        tracked = list({id(p): p for p in current}.values())  # a parameter repeated in more groups once
        if len(tracked) == len(self._layouts) and all(p is l.tensor for p, l in zip(tracked, self._layouts)):
            return  # the tracked parameters, some perhaps repeated in more groups (as torch.optim allows)
        model = self._model() if self._model is not None else None
        if model is not None and len(current) == len(self._layouts):
            registered = {without_compile_prefix(n): p for n, p in model.named_parameters()}
            if all(n in registered for n in self.param_groups_names):
                current = [registered[n] for n in self.param_groups_names]
        if len(current) != len(self._layouts):
            raise ValueError(f"DMuon: param_groups hold {len(current)} parameters, DMuon was built over "
                             f"{len(self._layouts)}; add parameters with add_param_group()")
        if self._pending or any(self.param_groups[0][key] for key in _COUNTERS):
            raise ValueError("DMuon: the tensors in param_groups were replaced after its first update (by a "
                             "framework wrapping the model, such as accelerate's FSDP2 preparation); build DMuon "
                             "before the model is wrapped and prepare both at once (Accelerator.prepare(model, "
                             "optimizer)), or build it over the wrapped model")
        groups, first = [], 0
        for g in self.param_groups:
            keys = ("lr", "weight_decay") + (MUON_ONLY if g["use_muon"] else ("betas", "eps"))
            names = self.param_groups_names[first:first + len(g["params"])]
            groups.append({"params": list(zip(names, current[first:first + len(names)])), "use_muon": g["use_muon"],
                           **{k: g[k] for k in keys}})
            first += len(g["params"])
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

    def _refreeze_options(self):
        """Every Muon matrix's options from its param group again (after load_state_dict), and the buckets."""
        for k in self._matrices:
            k.options = MuonOptions.of_group(k.group)
            self.ns_of(k.options)
        self._buckets = _buckets(self._matrices, lambda k: self._state_dtype_of(k.layout.tensor))

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

    def _state_dtype_of(self, param):
        return param.dtype if self.state_dtype is None else self.state_dtype

    def _zero_state(self, i):
        """Parameter i's state before its first update, laid out as the parameter (a DTensor
        parameter gets DTensors of the same mesh and placements)."""
        p = self._layouts[i].tensor
        if self._layouts[i].held_elsewhere:  # its state lives on its owner; an empty entry here lets
            self.state[p] = {}               # DCP's set_state_dict find one for every parameter
            return
        dtype = self._state_dtype_of(p)

        def zeros():
            return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format, requires_grad=False)

        if self._groups[i]["use_muon"]:
            self.state[p] = {"momentum_buffer": zeros()}
            options = MuonOptions.of_group(self._groups[i])
            if options.normuon:  # NorMuon's v, laid out as the parameter's rows (normuon.py)
                name, shape = self.param_groups_names[i], self._layouts[i].global_shape
                experts = self.experts(name, shape)
                rows, cols = (shape[1], shape[2]) if experts else (shape[0], math.prod(shape[1:]))
                self.state[p]["variance_neuron"] = zero_variance(self._layouts[i], experts,
                                                                 width(options, rows, cols, name), dtype)
        else:
            # "step" on the parameter's device, as torch.optim.AdamW's fused step keeps it
            self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device), "exp_avg": zeros(),
                             "exp_avg_sq": zeros()}

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
        NorMuon's v, QK-clip's rescale), so the call that settles it raises with every tensor as it was."""
        self._settle(arrived_only=True)
        self._follow_replaced_parameters()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # ---- checks: everything that can raise on the host, before the first write ----
        self._check_group_values()
        schedules = self._held_schedules()
        for schedule in schedules:
            schedule.ready_for_step()
        grads = [l.local(as_placed(l.tensor.grad, l.tensor)) if l.tensor.grad is not None and not l.held_elsewhere
                 else None for l in self._layouts]
        counted = [l.mine.replica == 0 for l in self._layouts]
        taking_part = [l.tensor.requires_grad for l in self._layouts]
        device = next((g.device for g in grads if g is not None), None) or self._layouts[0].tensor.device
        clip = self._qk_clip
        check = GradientCheck(self.comm, grads, counted, taking_part, self.clip_grad_norm, device,
                              None if clip is None else clip.slots(self.comm.rank, self.comm.world))
        if check.arrived():  # a CPU step can afford the check that keeps its all-to-alls in step (a GPU's cannot)
            disagreement = check.first_disagreement()
            if disagreement is not None:
                i, ranks = disagreement
                raise ValueError(f"DMuon: parameter '{self.param_groups_names[i]}' requires grad on {ranks} of "
                                 f"{self.comm.world} ranks; every rank must set requires_grad alike")
        clip_runs = None  # () bool device tensor: QK-clip can take every maximum of the step
        if clip is not None:
            clip_runs = clip.usable(check.extra)
            if self.nonfinite == "error":
                check.veto(clip_runs)  # the whole step changes nothing; settling it raises
        self._pending.append((check, clip))
        # ---- writes, masked on the device by the step's check (keep, finite) ----
        self._adamw(grads, taking_part, check)

        def momentum(i):
            layout = self._layouts[i]
            return layout.local(self.state[layout.tensor]["momentum_buffer"])

        def variance(i):
            layout = self._layouts[i]
            return layout.local(self.state[layout.tensor]["variance_neuron"])

        muon = MuonStep(self.comm, self.engine, self.ns_of, momentum, grads, check,
                        lambda k: self._state_dtype_of(k.layout.tensor), variance)
        me = self.comm.rank
        # Every matrix that may have a gradient takes part (whether it has one anywhere is known on the
        # device only); owner-held buckets (their own, see _buckets) run on the owner alone, where nothing
        # travels; held TP slices travel within the owner's TP group, in an exchange every rank joins.
        muon.run([[k for k in bucket if taking_part[k.index]
                   and (k.layout.held is None or k.owner == me or k.u_travels or k.o_travels)]
                  for bucket in self._buckets])
        self._last_ns, self._last_extra = (muon.ns_clock, muon.ns_matrices), {}
        if clip is not None:
            # under "error" a step whose update is skipped is not clipped either; under "skip" it still is
            clip.apply(check.extra, self._layouts, check.finite if self.nonfinite == "error" else clip_runs)
            self._last_extra["qk_clip_skipped"] = clip.skipped
        for schedule in schedules:
            schedule.after_step()
        self._settle(arrived_only=True)
        return loss

    def _check_group_values(self):
        """Every param group's hyper-parameters (a scheduler or the user may have set them since the last
        step), by torch.optim's checks: ValueError naming the group before anything is written."""
        name_of = {id(l.tensor): n for n, l in zip(self.param_groups_names, self._layouts)}
        for g in self.param_groups:
            if g["params"]:
                _check_hyper(g, name_of[id(g["params"][0])], options=False)  # options: frozen per matrix

    def _adamw(self, grads, taking_part, check):
        """The AdamW parameters' step: per param group, one fused call for those with a gradient here
        (skipped when any gradient is non-finite) and one per parameter without one here (zeros,
        skipped unless another rank has its gradient)."""
        with_grad, without = {}, []  # with_grad: id(param group) → indices
        for i, group in enumerate(self._groups):
            if group["use_muon"] or not taking_part[i]:
                continue
            if grads[i] is None:
                without.append(i)
            else:
                with_grad.setdefault(id(group), []).append(i)
        for indices in with_grad.values():
            self._adamw_call(indices, [grads[i] for i in indices], check, ~check.finite)
        for i in without:
            local = self._layouts[i].local(self._layouts[i].tensor)
            self._adamw_call([i], [torch.zeros_like(local)], check, ~check.keep[i])

    def _adamw_call(self, indices, grads, check, skip):
        """One fused AdamW call for parameters `indices` of one param group."""
        group = self._groups[indices[0]]
        layouts = [self._layouts[i] for i in indices]
        states = [self.state[l.tensor] for l in layouts]
        adamw_step([l.local(l.tensor) for l in layouts], grads, [l.local(st["exp_avg"]) for l, st in zip(layouts, states)],
                   [l.local(st["exp_avg_sq"]) for l, st in zip(layouts, states)], [st["step"] for st in states],
                   group, check.grad_scale, skip)

    def _settle(self, arrived_only=False):
        """Reads the pending steps' GradientChecks in order (arrived_only: those that need no wait):
        counts each update or skipped step, sets last_grad_norm, raises FloatingPointError for a
        non-finite gradient or a maximum logit its QKClip could not take (nonfinite="error"; "skip":
        the skipped step, or the skipped clip in the QKClip, counted)."""
        while self._pending and (not arrived_only or self._pending[0][0].arrived()):
            check, clip = self._pending.pop(0)
            verdict = check.settle()
            unusable = [] if clip is None else clip.problems(verdict.extra)
            if verdict.bad or unusable:
                update = self.param_groups[0]['updates'] + 1
                if self.nonfinite == "skip":
                    if unusable:
                        clip.count_skip(f"update {update}: {clip.describe(unusable)}; the update ran without it")
                    if verdict.bad:
                        self._count("skipped_steps")
                        continue
                else:
                    where = ", ".join(f"'{self.param_groups_names[i]}' on rank {r}" for r, i in verdict.bad)
                    problems = ([f"non-finite gradient in parameter {where}"] if verdict.bad else []) + (
                        [clip.describe(unusable)] if unusable else [])
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

    def _held_schedules(self):
        """The hold_on_owners schedules of this optimizer's owner-held parameters, in a fixed order."""
        out = {}
        for layout in self._layouts:
            if layout.held is not None:
                out.setdefault(id(layout.held.schedule), layout.held.schedule)
        return list(out.values())

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
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
                             f"DMuon has {len(self.param_groups)})")
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"loaded state dict contains a parameter group that doesn't match the size of "
                             f"optimizer's group: {[len(g['params']) for g in saved_groups]} parameters, DMuon's "
                             f"{[len(g['params']) for g in self.param_groups]}")
        # Checks, before anything is written: a refused state dict loses nothing.
        saved_state = state_dict["state"]
        index_of = {id(l.tensor): i for i, l in enumerate(self._layouts)}  # a repeated parameter: its one index
        entries = []  # (parameter index, its saved entry or None)
        for g, saved in zip(self.param_groups, saved_groups):
            indices = [index_of[id(p)] for p in g["params"]]
            where = f"DMuon.load_state_dict: the group of '{self.param_groups_names[indices[0]]}'" if indices else ""
            if saved.get("use_muon", g["use_muon"]) != g["use_muon"]:
                raise ValueError(f"{where} is Muon in one state, AdamW in the other")
            if g["use_muon"]:
                check_options(saved, where)
                options = MuonOptions.of_group({**g, **saved})
                for k in self._matrices:
                    if k.group is g:
                        options.blocks(k.rows, k.cols, k.name)  # a split that does not fit the matrix raises
            for i, key in zip(indices, saved["params"]):
                entry = saved_state.get(key)
                if entry is not None:
                    self._check_entry(i, entry)
                entries.append((i, entry))
        for i, entry in entries:
            if entry is None:
                self._zero_state(i)
            else:
                self._load_entry(i, entry)
        for g, saved in zip(self.param_groups, saved_groups):
            for k, v in saved.items():  # in place: MuonMatrix and _groups hold these dicts
                if k != "params":
                    g[k] = copy.deepcopy(v)
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
        self._ns = {}
        self.ns = self.ns_of(MuonOptions.of_group(self.defaults))

    def _check_entry(self, i, entry):
        """ValueError naming parameter i when a saved state entry does not fit its state here."""
        name, mine = self.param_groups_names[i], self.state[self._layouts[i].tensor]
        if set(entry) != set(mine):
            raise ValueError(f"DMuon.load_state_dict: '{name}' has state {sorted(entry)} in the saved state, "
                             f"{sorted(mine)} here")
        for key, value in entry.items():
            target = mine[key]
            if key == "step":
                continue
            if is_dtensor(target) != is_dtensor(value) or tuple(value.shape) != tuple(target.shape) or (
                    is_dtensor(target) and (value.placements != target.placements
                                            or value.device_mesh != target.device_mesh)):
                def kind(t):
                    return f"DTensor {tuple(t.placements)}" if is_dtensor(t) else "tensor"
                raise ValueError(f"DMuon.load_state_dict: '{name}' {key} is a {kind(value)} of shape "
                                 f"{tuple(value.shape)}, here a {kind(target)} of shape {tuple(target.shape)} "
                                 "(load another world size or layout with torch.distributed.checkpoint)")

    def _load_entry(self, i, entry):
        """Copies a checked saved state entry (_check_entry) into parameter i's state."""
        mine = self.state[self._layouts[i].tensor]
        for key, value in entry.items():
            target = mine[key]
            if key == "step":
                target.copy_(torch.as_tensor(value, dtype=target.dtype))
            elif value is not target:
                self._layouts[i].local(target).copy_(self._layouts[i].local(value))


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"DMuon: {name} must be one of {', '.join(str(c) for c in choices)}; got {value!r}")


def _check_hyper(g, name, options=True):
    """A param group's values (with Muon's options), torch.optim's checks (after _check_defaults) with the
    group named by its first parameter."""
    where = f"DMuon: param group of '{name}': "
    if g["use_muon"]:
        _check_values(where, "", lr=g["lr"], momentum=g["momentum"], weight_decay=g["weight_decay"])
        if options:
            check_options(g, where[:-2])
    else:
        _check_values(where, "", lr=g["lr"], eps=g["eps"], betas=g["betas"], weight_decay=g["weight_decay"])


def _check_defaults(lr, momentum, weight_decay, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay):
    """DMuon's hyper-parameter arguments, checked before its parameters as torch.optim's optimizers do, with
    their messages (the adamw_ arguments named after them)."""
    _check_values("", "", lr=lr, momentum=momentum, weight_decay=weight_decay)
    _check_values("", " (adamw_lr)", lr=adamw_lr)
    _check_values("", " (adamw_eps)", eps=adamw_eps)
    _check_values("", " (adamw_betas)", betas=adamw_betas)
    _check_values("", " (adamw_weight_decay)", weight_decay=adamw_weight_decay)


def _check_values(prefix, suffix, lr=None, momentum=None, eps=None, betas=None, weight_decay=None):
    """ValueError with torch.optim's message (Adam's, SGD's) for the first bad value given (None: not
    given); a Muon momentum must also be below 1 and eps above 0."""
    def bad(message):
        raise ValueError(prefix + message + suffix)

    if torch.is_tensor(lr) and lr.numel() != 1:
        bad("Tensor lr must be 1-element")
    if lr is not None and not 0.0 <= lr:
        bad(f"Invalid learning rate: {lr}")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        bad(f"Invalid momentum value: {momentum} (Muon's momentum is in [0, 1))")
    if eps is not None and not 0.0 < eps:
        bad(f"Invalid epsilon value: {eps} (must be > 0)")
    if betas is not None:
        betas = tuple(betas)
        if len(betas) != 2:
            bad(f"betas must be a pair (beta1, beta2), got {betas}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                bad(f"Invalid beta parameter at index {i}: {beta}")
    if weight_decay is not None and not 0.0 <= weight_decay:
        bad(f"Invalid weight_decay value: {weight_decay}")


def _buckets(matrices, state_dtype_of):
    """Muon matrices batched by (rows, cols, momentum dtype, device, owner-held, options), largest
    Newton–Schulz work first (its communication then overlaps the smaller buckets' Newton–Schulz);
    ties in a fixed order. Owner-held matrices get buckets of their own, which move nothing."""
    by_key = {}
    for k in matrices:
        key = (k.rows, k.cols, str(state_dtype_of(k)), k.layout.local(k.layout.tensor).device.type,
               k.layout.held is not None, k.options)
        by_key.setdefault(key, []).append(k)

    def work(key):
        rows, cols = key[0], key[1]
        m, n = min(rows, cols), max(rows, cols)
        return (-len(by_key[key]) * m * m * n, key[:-1], repr(key[-1]))
    return [by_key[key] for key in sorted(by_key, key=work)]
