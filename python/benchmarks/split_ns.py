"""Per-head Newton–Schulz on a model's attention shapes: one engine call on the whole matrices against one
engine call on all their heads' blocks batched (docs/pytorch.md, "Split Newton–Schulz"), and one DMuon step
over the attention matrices without and with the split options.

The matrices are a llama-family manifest's (models/*.json; muon_step_torch.py lists them) q, k, v (split by
output rows: num_attention_heads, num_key_value_heads blocks of head_dim rows) and o (split by input columns:
num_attention_heads blocks of head_dim columns), of the first `layers` layers. float32 on the CPU (the engine's
Newton–Schulz there), Keller's 5 steps with algo="standard" (no tuning cache); each figure is the median of
`repeats` timed calls after one untimed call, wall clock; flop ratio = the blocks' Newton–Schulz flops over the
whole matrices' (per iteration 2·m²·n + 2·m³ + 2·m²·n, m = min side). Prints a table; --json OUT writes it.

    PYTHONPATH=build/python python3 python/benchmarks/split_ns.py [--model models/qwen2.5-0.5b.json]
        [--layers 2] [--repeats 5] [--threads 1] [--json OUT]
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

import dmuon
from dmuon.torch import DMuon

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from muon_step_torch import muon_matrices  # noqa: E402  (a sibling benchmark's manifest reader)


def attention_splits(manifest, layers):
    """[(name, (rows, cols), split options)] of the attention matrices of the first `layers` layers."""
    config = json.loads(pathlib.Path(manifest).read_text())["components"][0]["config"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    split = {"q_proj": dict(split_heads=heads), "k_proj": dict(split_heads=kv_heads),
             "v_proj": dict(split_heads=kv_heads), "o_proj": dict(split_heads=heads, split_dim=1)}
    return [(name, shape, split[name.split(".")[-2]]) for name, shape in muon_matrices(manifest, layers)
            if name.split(".")[-2] in split]


def median_seconds(run, repeats):
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ns_flops(rows, cols, steps=5):
    m, n = min(rows, cols), max(rows, cols)
    return steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def blocks_of(shape, options):
    """(block shape, count) of a matrix split by its options."""
    rows, cols = shape
    heads, dim = options["split_heads"], options.get("split_dim", 0)
    return ((rows // heads, cols) if dim == 0 else (rows, cols // heads)), heads


def ns_rows(matrices, ns, repeats):
    """Per distinct whole shape: the whole matrices in one call, their blocks in one call."""
    by_shape = {}
    for _, shape, options in matrices:
        by_shape.setdefault((shape, blocks_of(shape, options)), []).append(shape)
    rows = []
    for (shape, (block, per)), members in by_shape.items():
        whole = torch.randn(len(members), *shape)
        blocks = torch.randn(len(members) * per, *block)

        def call(stack):
            ptrs = [t.data_ptr() for t in stack]
            return lambda: ns.run(ptrs, ptrs, stack.shape[1], stack.shape[2])
        t_whole, t_blocks = median_seconds(call(whole), repeats), median_seconds(call(blocks), repeats)
        rows.append({"what": f"NS {len(members)}×{shape[0]}x{shape[1]} vs {len(members) * per}×{block[0]}x{block[1]}",
                     "whole_ms": 1e3 * t_whole, "blocks_ms": 1e3 * t_blocks, "speedup": t_whole / t_blocks,
                     "flop_ratio": per * ns_flops(*block) / ns_flops(*shape)})
    return rows


def step_row(matrices, repeats, threads):
    """One DMuon step (one process) over the matrices, without and with their split options."""
    def run(split):
        params = [(name, torch.nn.Parameter(torch.randn(shape) * 0.02)) for name, shape, _ in matrices]
        groups = [{"params": [pair], "use_muon": True, **(options if split else {})}
                  for pair, (_, _, options) in zip(params, matrices)]
        opt = DMuon(groups, algo="standard", tune_cache=None, balancer="lpt")
        for _, p in params:
            p.grad = torch.randn_like(p)
        return median_seconds(opt.step, repeats)
    t_whole, t_split = run(False), run(True)
    return {"what": f"DMuon step, {len(matrices)} attention matrices", "whole_ms": 1e3 * t_whole,
            "blocks_ms": 1e3 * t_split, "speedup": t_whole / t_split,
            "flop_ratio": sum(blocks_of(s, o)[1] * ns_flops(*blocks_of(s, o)[0]) for _, s, o in matrices)
            / sum(ns_flops(*s) for _, s, _ in matrices)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(HERE.parents[1] / "models" / "qwen2.5-0.5b.json"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    matrices = attention_splits(args.model, args.layers)
    ns = dmuon.Orthogonalizer(algo="standard", threads=args.threads, tune_cache=None)
    rows = ns_rows(matrices, ns, args.repeats) + [step_row(matrices, args.repeats, args.threads)]
    print(f"{pathlib.Path(args.model).stem}, {args.layers} layers, CPU float32, {args.threads} thread(s), "
          f"median of {args.repeats}")
    print(f"{'':58} {'whole ms':>10} {'blocks ms':>10} {'speedup':>8} {'flop ratio':>10}")
    for r in rows:
        print(f"{r['what']:58} {r['whole_ms']:10.2f} {r['blocks_ms']:10.2f} {r['speedup']:8.2f} {r['flop_ratio']:10.3f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"model": args.model, "layers": args.layers,
                                                       "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
