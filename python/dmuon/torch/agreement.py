"""What every rank of a DMuon (or hold_on_owners) group must agree on before it builds anything:
the same parameters, and the owners of the Muon matrices (planned once, on rank 0)."""

import dmuon


def agree_on_parameters(comm, error, signature):
    """Raises the same exception on every rank when any rank failed to parse its parameters (error:
    None, the message of a ValueError, or (TypeError, message)) or the ranks' (name, global shape,
    holdings, use_muon) lists differ (ValueError). A message gets the failing rank."""
    gathered = comm.all_gather_object((error, signature))
    for r, (e, _) in enumerate(gathered):
        if e is not None:
            kind, message = e if isinstance(e, tuple) else (ValueError, e)
            raise kind(message if "rank" in message else f"{message} (rank {r})")
    reference = gathered[0][1]
    for r, (_, sig) in enumerate(gathered[1:], start=1):
        if sig == reference:
            continue
        k = next((k for k, (a, b) in enumerate(zip(reference, sig)) if a != b), min(len(reference), len(sig)))
        here = sig[k] if k < len(sig) else "nothing"
        there = reference[k] if k < len(reference) else "nothing"
        raise ValueError(f"DMuon: parameter lists differ across ranks: at index {k} rank 0 has {there}, "
                         f"rank {r} has {here} ({len(reference)} vs {len(sig)} parameters)")


def plan_on_rank0(comm, shapes, balancer, threads, tune_cache="", blocks=None):
    """Owners of the Muon matrices: planned on rank 0 (milp is time-limited, so not reproducible on
    every rank) and broadcast; a planning error is raised on every rank. tune_cache: as
    dmuon.plan_owners's ("" the default path, None none, else a path); blocks: as dmuon.plan_owners's (None, or per
    matrix None or the (rows, cols) of the blocks its split Newton–Schulz runs on). One rank owns everything;
    without libdmuon_c (a torch-only install) the owners are lpt_owners'."""
    if comm.world == 1:
        return [0] * len(shapes)
    result = None
    if comm.rank == 0:
        try:
            if dmuon.library_error() is not None:
                result = lpt_owners(shapes, comm.world, blocks)
            else:
                result = dmuon.plan_owners(shapes, comm.world, balancer=balancer, costs="auto", tune_cache=tune_cache,
                                           threads=threads, blocks=blocks)[0]
        except dmuon.DmuonError as e:
            result = f"DMuon: planning owners on rank 0 failed: {e}"
    result = comm.broadcast_object(result)
    if isinstance(result, str):
        raise dmuon.DmuonError(result)
    return result


def lpt_owners(shapes, world, blocks=None):
    """Owners of (rows, cols) matrices on `world` ranks by longest processing time first over the Newton–Schulz
    flop count m²n (m ≤ n), as the planner's "lpt" balancer with flop costs (src/plan, without its memory bound):
    each matrix, the costliest first (ties in order), to the rank with the least work so far (ties: the lowest).
    blocks: as plan_on_rank0's; a split matrix costs the sum of its blocks' counts."""
    load = [0] * world
    owners = [0] * len(shapes)
    costs = [sum(min(r, c) ** 2 * max(r, c) for r, c in (blocks[i] if blocks and blocks[i] else [shape]))
             for i, shape in enumerate(shapes)]
    for i in sorted(range(len(shapes)), key=lambda i: -costs[i]):
        owners[i] = min(range(world), key=lambda g: (load[g], g))
        load[owners[i]] += costs[i]
    return owners
