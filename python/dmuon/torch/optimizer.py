"""dmuon.torch.DMuon: Muon for hidden matrices + AdamW for the rest, as a torch.optim optimizer over
torch.distributed, with Newton–Schulz in dmuon's C++ engine (docs/pytorch.md).

Semantics are DESIGN section 1 and the C++ optimizers': one global gradient norm (clipping and the
non-finite check, agreed across ranks), AdamW as torch.optim.AdamW (bias-corrected, decoupled decay),
Muon's lerp momentum with Nesterov, Newton–Schulz, the chosen scale, decoupled decay with the
unscaled lr. Each Muon matrix has one owner rank (the planner's, decided on rank 0), which alone runs
its Newton–Schulz (muon_step.py).
"""

import math

import torch

import dmuon
from dmuon.torch.adamw import adamw_update
from dmuon.torch.collectives import Group
from dmuon.torch.layout import describe
from dmuon.torch.muon_step import MuonSlot, MuonStep, engine_target, muon_scale
from dmuon.torch.params import module_groups, split_groups

_COEFFS = ("keller", "you", "polar-express")
_ALGOS = ("auto", "standard", "gram")
_SCALES = ("original", "match_rms_adamw")
_BALANCERS = ("milp", "lpt", "rr")
_STATE_FORMAT = 1


class DMuon(torch.optim.Optimizer):
    """Distributed Muon + AdamW. `params`: the model itself (routed by name and module type),
    model.named_parameters() (routed by name: hidden ≥2-D matrices → Muon; embeddings, head, 1-D →
    AdamW; params.py states the rule), tensors (routed by shape alone, with a warning), or param
    groups with use_muon=True/False. Parameters may be plain (replicated: DDP or single process),
    DTensors (FSDP2: Shard(0) or Replicate() on a 1-D mesh) or dmuon.torch.Sharded descriptions of
    dim-0 chunks.

    `defaults` holds the per-group hyper-parameters under their keyword names (lr, momentum,
    nesterov, weight_decay, adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay). Each param group
    is all-Muon (keys lr, momentum, nesterov, weight_decay) or all-AdamW (lr, betas, eps,
    weight_decay), so LR schedulers set each kind's own lr. Schedulers that cycle momentum
    (OneCycleLR, CyclicLR with cycle_momentum) find "momentum" in defaults and write
    group["momentum"] in every group: Muon groups follow it; AdamW groups keep their betas (the key
    is ignored there).

    Construction and add_param_group are collective over process_group (every rank, same parameter
    names and shapes), and so are step() and state_dict(); load_state_dict() is local.
    """

    def __init__(self, params, *, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, adamw_lr=3e-4,
                 adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.0, ns_steps=5, coeffs="keller",
                 algo="auto", scale="match_rms_adamw", balancer="milp", process_group=None, clip_grad_norm=None,
                 nonfinite="error"):
        _check_choice("coeffs", coeffs, _COEFFS)
        _check_choice("algo", algo, _ALGOS)
        _check_choice("scale", scale, _SCALES)
        _check_choice("balancer", balancer, _BALANCERS)
        _check_choice("nonfinite", nonfinite, ("error", "skip"))
        if int(ns_steps) < 1:
            raise ValueError(f"DMuon: ns_steps must be >= 1, got {ns_steps}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"DMuon: clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, adamw_lr=adamw_lr,
                        adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay)
        self.comm = Group(process_group)
        self._process_group = process_group
        self.clip_grad_norm = clip_grad_norm
        self.nonfinite = nonfinite
        self.scale_kind = scale
        self._balancer = balancer
        self._threads = torch.get_num_threads()
        self.param_groups_names, self._layouts, self._groups, self._stepped = [], [], [], []
        self._muon, self.owners = {}, {}

        if isinstance(params, torch.nn.Module):
            params = module_groups(params)
        torch_groups, layouts = self._parse(params, defaults, first_group=0)
        self._constructed = False
        super().__init__(torch_groups, defaults)  # its add_param_group calls only append them
        self._constructed = True
        self.ns = dmuon.Orthogonalizer(coeffs=coeffs, algo=algo, steps=int(ns_steps), threads=self._threads,
                                       tune_cache="")
        self._track(layouts)
        self.updates = 0        # updates applied
        self.skipped_steps = 0  # updates skipped for a non-finite gradient (nonfinite="skip")
        self.last_grad_norm = 0.0
        self.last_stats = {"ns_s": 0.0, "ns_matrices": 0}

    def add_param_group(self, param_group):
        """Adds parameters to optimize from the next step(): a param group as DMuon's `params` takes
        one (tensors, (name, tensor) pairs or Sharded; use_muon; hyper-parameters, the rest from
        `defaults`). A group without use_muon is split as at construction, so param_groups may grow
        by two. Collective, like construction: every rank calls it with the same parameter names and
        shapes, and a difference, a parameter the optimizer has already, or a bad value raises the
        same ValueError on every rank. The new Muon matrices' owners are planned among themselves
        (on rank 0, with the optimizer's balancer); existing owners, and the state they hold, stay.
        """
        if not self._constructed:  # torch.optim.Optimizer.__init__ registering the groups _parse made
            self.param_groups.append(param_group)
            return
        torch_groups, layouts = self._parse([param_group], self.defaults, first_group=len(self.param_groups))
        self.param_groups.extend(torch_groups)
        self._track(layouts)

    def _parse(self, params, defaults, first_group):
        """(torch param groups, [(name, Layout, torch group)]) from DMuon's `params` (collective).

        Every rank parses its parameters; errors and the parameter lists are then compared across
        ranks, so a problem on one rank becomes the same exception on all of them (no hang)."""
        groups, layouts, error = [], [], None
        try:
            groups = split_groups(params, defaults, first_group, warn_unnamed=self.comm.rank == 0)
            seen = {id(l.tensor): n for n, l in zip(self.param_groups_names, self._layouts)}
            for g in groups:
                _check_hyper(g)
                for name, p in g["named"]:
                    layout = describe(name, p, self._process_group, self.comm.world, self.comm.rank)
                    if id(layout.tensor) in seen:
                        raise ValueError(f"DMuon: parameter '{name}' is given twice (also as "
                                         f"'{seen[id(layout.tensor)]}')")
                    seen[id(layout.tensor)] = name
                    if g["use_muon"]:
                        try:
                            engine_target(layout.tensor)
                        except dmuon.UnsupportedError as e:
                            raise ValueError(f"DMuon: parameter '{name}': {e}") from None
                    layouts.append((name, layout, g))
        except (ValueError, TypeError, dmuon.DmuonError) as e:
            error = str(e)
        signature = [(n, l.global_shape, l.sharded, g["use_muon"]) for n, l, g in layouts]
        _agree_on_parameters(self.comm, error, signature)

        torch_groups, torch_group_of = [], {}
        for g in groups:
            hyper = {k: v for k, v in g.items() if k != "named"}
            hyper["names"] = [n for n, _ in g["named"]]
            hyper["params"] = [l.tensor for n, l, gg in layouts if gg is g]
            torch_groups.append(hyper)
            torch_group_of[id(g)] = hyper
        return torch_groups, [(n, l, torch_group_of[id(g)]) for n, l, g in layouts]

    def _track(self, layouts):
        """Appends _parse's parameters, their groups registered in param_groups, to the optimizer's
        agreed order and plans the owners of their Muon matrices (collective)."""
        first = len(self._layouts)
        for name, layout, group in layouts:
            self.param_groups_names.append(name)
            self._layouts.append(layout)
            self._groups.append(group)
            self._stepped.append(False)  # has state (agreed across ranks)
        muon = [i for i in range(first, len(self._layouts)) if self._groups[i]["use_muon"]]
        shapes = [(self._layouts[i].global_shape[0], math.prod(self._layouts[i].global_shape[1:])) for i in muon]
        owners = _plan_on_rank0(self.comm, shapes, self._balancer, self._threads)
        for i, (rows, cols), owner in zip(muon, shapes, owners):
            self._muon[i] = MuonSlot(i, self.param_groups_names[i], self._layouts[i], self._groups[i], rows, cols,
                                     owner, muon_scale(rows, cols, self.scale_kind))
            self.owners[self.param_groups_names[i]] = owner
        self._buckets = _buckets(self._muon.values())

    # ---- the step ----

    @torch.compiler.disable  # a clean graph break under torch.compile: the engine is called through ctypes
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [l.local(l.tensor.grad) if l.tensor.grad is not None else None for l in self._layouts]
        agreed = self._agree_on_gradients(grads)
        if agreed is None:
            return loss
        active, grad_scale = agreed
        if not active:  # no parameter has a gradient on any rank: nothing changes, nothing is counted
            return loss
        self.updates += 1
        for i in active:
            self._stepped[i] = True
        for i in active:
            if not self._groups[i]["use_muon"]:
                layout = self._layouts[i]
                adamw_update(layout.local(layout.tensor), grads[i], self.state[layout.tensor], self._groups[i],
                             grad_scale)
        muon = MuonStep(self.comm, self.ns, lambda s: self.state[s.layout.tensor], grads, grad_scale)
        active = set(active)
        muon.run([[self._muon[i] for i in bucket if i in active] for bucket in self._buckets])
        self.last_stats = {"ns_s": muon.ns_seconds, "ns_matrices": muon.ns_matrices}
        return loss

    def _agree_on_gradients(self, grads):
        """(indices of parameters to update, gradient scale), or None for a skipped step. One
        all_reduce of [Σ g² over sharded parts, per-rank first non-finite parameter, per-parameter
        gradient present]; replicated gradients are equal on every rank, so their Σ g² is local."""
        c, n = self.comm, len(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        norms = torch.stack(torch._foreach_norm([grads[i] for i in present])).double().tolist() if present else []
        sharded_sq = replicated_sq = 0.0
        first_bad = 0
        for i, norm in zip(present, norms):
            if not math.isfinite(norm):
                first_bad = first_bad or i + 1
            elif self._layouts[i].sharded:
                sharded_sq += norm * norm
            else:
                replicated_sq += norm * norm
        totals = torch.zeros(1 + c.world + n, dtype=torch.float64)
        totals[0] = sharded_sq
        totals[1 + c.rank] = first_bad
        totals[1 + c.world + torch.tensor(present, dtype=torch.long)] = 1.0
        c.all_reduce_sum(totals)
        bad = [(r, int(totals[1 + r]) - 1) for r in range(c.world) if totals[1 + r] > 0]
        if bad:
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                return None
            where = ", ".join(f"'{self.param_groups_names[i]}' on rank {r}" for r, i in bad)
            raise FloatingPointError(f"DMuon: non-finite gradient in parameter {where} at update {self.updates + 1}")
        norm = math.sqrt(float(totals[0]) + replicated_sq)
        self.last_grad_norm = norm
        grad_scale = 1.0
        if self.clip_grad_norm is not None and norm > self.clip_grad_norm:
            grad_scale = self.clip_grad_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        active = [i for i in range(n) if totals[1 + c.world + i] > 0]
        return active, grad_scale

    # ---- checkpoints ----

    @torch.no_grad()
    def state_dict(self):
        """The whole optimizer state, independent of the world size (collective: every rank calls it
        and gets the same dict). Tensors are full (global shape) copies, on the CPU."""
        state = {}
        for i, layout in enumerate(self._layouts):
            if not self._stepped[i]:
                continue
            local = self.state[layout.tensor]
            if self._groups[i]["use_muon"]:
                slot = self._muon[i]
                if layout.sharded:
                    full = self.comm.gather_rows(local["momentum_buffer"], layout.rows)
                else:
                    full = (local["momentum_buffer"].clone() if slot.owner == self.comm.rank
                            else torch.empty(layout.global_shape, dtype=layout.tensor.dtype,
                                             device=layout.local(layout.tensor).device))
                    self.comm.broadcast(full, src=slot.owner)
                state[i] = {"momentum_buffer": full.reshape(layout.global_shape).cpu()}
            else:
                entry = {"step": local["step"]}
                for key in ("exp_avg", "exp_avg_sq"):
                    t = local[key]
                    if layout.sharded:
                        t = self.comm.gather_rows(t, layout.rows)
                    entry[key] = t.reshape(layout.global_shape).cpu().clone()
                state[i] = entry
        groups = []
        first = 0
        for g in self.param_groups:
            saved = {k: v for k, v in g.items() if k != "params"}
            saved["params"] = list(range(first, first + len(g["params"])))
            first += len(g["params"])
            groups.append(saved)
        return {"state": state, "param_groups": groups,
                "dmuon": {"format": _STATE_FORMAT, "world_size": self.comm.world, "updates": self.updates,
                          "skipped_steps": self.skipped_steps}}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Loads a state_dict() saved at any world size; the parameter names and shapes must match."""
        meta = state_dict.get("dmuon", {})
        if meta.get("format") != _STATE_FORMAT:
            raise ValueError(f"DMuon.load_state_dict: not a DMuon state (format {meta.get('format')})")
        saved_groups = state_dict["param_groups"]
        saved_names = [n for g in saved_groups for n in g["names"]]
        if saved_names != self.param_groups_names or len(saved_groups) != len(self.param_groups):
            diff = next((k for k, (a, b) in enumerate(zip(saved_names, self.param_groups_names)) if a != b),
                        min(len(saved_names), len(self.param_groups_names)))
            raise ValueError(f"DMuon.load_state_dict: parameter lists differ (saved {len(saved_names)} in "
                             f"{len(saved_groups)} groups, here {len(self.param_groups_names)} in "
                             f"{len(self.param_groups)}; first difference at index {diff})")
        for g, saved in zip(self.param_groups, saved_groups):
            if g["use_muon"] != saved["use_muon"]:
                raise ValueError(f"DMuon.load_state_dict: the group of '{g['names'][0]}' is Muon in one state, "
                                 "AdamW in the other")
            for k, v in saved.items():
                if k not in ("params", "names"):
                    g[k] = v
        self.state.clear()
        self._stepped = [False] * len(self._layouts)
        for i, entry in state_dict["state"].items():
            i = int(i)
            layout = self._layouts[i]
            local = layout.local(layout.tensor)
            name = self.param_groups_names[i]

            def part(t, name=name, layout=layout, local=local):
                if tuple(t.shape) != layout.global_shape:
                    raise ValueError(f"DMuon.load_state_dict: '{name}' state has shape {tuple(t.shape)}, "
                                     f"the parameter {layout.global_shape}")
                if layout.sharded:
                    start, count = layout.rows[self.comm.rank]
                    t = t[start:start + count]
                return t.to(device=local.device, dtype=local.dtype).clone().reshape(local.shape)

            if self._groups[i]["use_muon"]:
                if layout.sharded or self._muon[i].owner == self.comm.rank:
                    self.state[layout.tensor]["momentum_buffer"] = part(entry["momentum_buffer"])
            else:
                self.state[layout.tensor].update(step=int(entry["step"]), exp_avg=part(entry["exp_avg"]),
                                                 exp_avg_sq=part(entry["exp_avg_sq"]))
            self._stepped[i] = True
        self.updates = int(meta["updates"])
        self.skipped_steps = int(meta["skipped_steps"])


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"DMuon: {name} must be one of {', '.join(choices)}; got {value!r}")


def _check_hyper(g):
    where = f"param group of '{g['named'][0][0]}'"
    if not g["lr"] >= 0:
        raise ValueError(f"DMuon: {where}: lr must be >= 0, got {g['lr']}")
    if g["use_muon"]:
        if not 0 <= g["momentum"] < 1:
            raise ValueError(f"DMuon: {where}: momentum must be in [0, 1), got {g['momentum']}")
    else:
        b1, b2 = g["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"DMuon: {where}: betas must be in [0, 1), got {g['betas']}")
        if not g["eps"] > 0:
            raise ValueError(f"DMuon: {where}: eps must be > 0, got {g['eps']}")


def _agree_on_parameters(comm, error, signature):
    """Raises the same ValueError on every rank when any rank failed to parse its parameters or the
    ranks' (name, global shape, sharded, use_muon) lists differ."""
    gathered = comm.all_gather_object((error, signature))
    for r, (e, _) in enumerate(gathered):
        if e is not None:
            raise ValueError(f"{e} (rank {r})" if "rank" not in e else e)
    reference = gathered[0][1]
    for r, (_, sig) in enumerate(gathered[1:], start=1):
        if sig == reference:
            continue
        k = next((k for k, (a, b) in enumerate(zip(reference, sig)) if a != b), min(len(reference), len(sig)))
        here = sig[k] if k < len(sig) else "nothing"
        there = reference[k] if k < len(reference) else "nothing"
        raise ValueError(f"DMuon: parameter lists differ across ranks: at index {k} rank 0 has {there}, "
                         f"rank {r} has {here} ({len(reference)} vs {len(sig)} parameters)")


def _plan_on_rank0(comm, shapes, balancer, threads):
    """Owners of the Muon matrices: planned on rank 0 (milp is time-limited, so not reproducible on
    every rank) and broadcast; a planning error is raised on every rank."""
    result = None
    if comm.rank == 0:
        try:
            result = dmuon.plan_owners(shapes, comm.world, balancer=balancer, costs="auto", tune_cache="",
                                       threads=threads)[0]
        except dmuon.DmuonError as e:
            result = f"DMuon: planning owners on rank 0 failed: {e}"
    result = comm.broadcast_object(result)
    if isinstance(result, str):
        raise dmuon.DmuonError(result)
    return result


def _buckets(slots):
    """Muon parameters batched by (layout, shape, dtype), largest Newton–Schulz work first (its
    communication then overlaps the smaller buckets' Newton–Schulz); ties in a fixed order."""
    by_key = {}
    for s in slots:
        key = (s.layout.sharded, s.rows, s.cols, str(s.layout.tensor.dtype))
        by_key.setdefault(key, []).append(s.index)
    def work(key):
        sharded, rows, cols, dtype = key
        m, n = min(rows, cols), max(rows, cols)
        return (-len(by_key[key]) * m * m * n, key)
    return [by_key[k] for k in sorted(by_key, key=work)]
