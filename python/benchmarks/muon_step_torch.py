"""torch.optim.Muon's step on a model's Muon matrices, in torch alone (no dmuon import): the torch counterpart of
`dmuon_gpu_check bench muon` (bench/gpu_check/muon_step_bench.hpp) in scripts/gpu-check.sh.

The matrices are those of a llama-family manifest (models/*.json: qwen2, llama, mistral; per layer q, k, v, o,
gate, up, down, as dmuon's manifest loader lists them, src/io/models.cpp; tests/python/benchmarks_test.py checks
the two agree). float32 weights and random (never zero) gradients; torch.optim.Muon with its defaults (Keller's
coefficients, 5 steps, Newton–Schulz in bf16, Nesterov momentum 0.95) and lr 0.02, weight decay 0. The timed
steps follow one untimed step (state allocation); on CUDA each step is timed with CUDA events, on the CPU with
the wall clock; the median is reported.

    python3 python/benchmarks/muon_step_torch.py [--model models/qwen2.5-0.5b.json] [--layers N] [--device cuda]
        [--repeats 10] [--json OUT]
    python3 python/benchmarks/muon_step_torch.py --print-shapes   # "ROWSxCOLS:COUNT,..." for dmuon_gpu_check
                                                                  # (needs no torch)
"""

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections import Counter

REPO = pathlib.Path(__file__).resolve().parents[2]
LLAMA_FAMILY = ("qwen2", "llama", "mistral")


def muon_matrices(manifest, layers=0):
    """[(name, (rows, cols))] of the manifest's Muon matrices, first `layers` layers (0: all)."""
    spec = json.loads(pathlib.Path(manifest).read_text())
    (component,) = spec["components"]
    config = component["config"]
    if config.get("model_type") not in LLAMA_FAMILY:
        raise SystemExit(f"{manifest}: model_type {config.get('model_type')!r} is not one of {LLAMA_FAMILY}")
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    count = config["num_hidden_layers"] if layers <= 0 else min(layers, config["num_hidden_layers"])
    out = []
    for i in range(count):
        layer = f"model.layers.{i}."
        out += [(layer + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                (layer + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                (layer + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                (layer + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                (layer + "mlp.gate_proj.weight", (inter, hidden)),
                (layer + "mlp.up_proj.weight", (inter, hidden)),
                (layer + "mlp.down_proj.weight", (hidden, inter))]
    return out


def shapes_argument(matrices):
    """"ROWSxCOLS:COUNT,..." in first-seen order: dmuon_gpu_check bench muon --shapes."""
    counts = Counter(shape for _, shape in matrices)
    return ",".join(f"{r}x{c}:{k}" for (r, c), k in counts.items())


def time_steps(opt, device, repeats):
    """Seconds of each of `repeats` steps after one untimed step."""
    import torch

    opt.step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "qwen2.5-0.5b.json"))
    parser.add_argument("--layers", type=int, default=0, help="first N layers (0: all)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--print-shapes", action="store_true", help="print dmuon_gpu_check's --shapes and exit")
    args = parser.parse_args(argv)
    matrices = muon_matrices(args.model, args.layers)
    if args.print_shapes:  # needs no torch
        print(shapes_argument(matrices))
        return 0
    import torch

    if not hasattr(torch.optim, "Muon"):
        raise SystemExit(f"torch {torch.__version__} has no torch.optim.Muon (2.9 or newer has)")
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    params = []
    for _, shape in matrices:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device)  # never zeros
        params.append(p)
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.0)
    times = time_steps(opt, device, args.repeats)
    result = {"optimizer": "torch.optim.Muon", "torch": torch.__version__, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "model": pathlib.Path(args.model).stem, "layers": args.layers, "matrices": len(params),
              "parameters": sum(p.numel() for p in params), "shapes": shapes_argument(matrices),
              "repeats": args.repeats, "step_s_median": statistics.median(times), "step_s": times}
    print(f"torch.optim.Muon step on {result['matrices']} matrices ({result['parameters']} parameters) of "
          f"{result['model']} on {result['device_name']}: median {1e3 * result['step_s_median']:.3f} ms "
          f"over {args.repeats} steps")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
