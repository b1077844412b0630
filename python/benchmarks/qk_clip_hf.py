"""The cost of dmuon.torch.hf_qk_clip's reporting attention (docs/pytorch.md, "QK-clip"): one forward and backward
of a Hugging Face Qwen2 built from a config (random weights) with its own attention and with the helper's wrapper
around it, for "eager" and "sdpa", and DMuon's step() with the clip against without (each step() after an untimed
forward and backward).
The wrapper recomputes q·kᵀ per head under no_grad and takes its masked maximum: one (batch, heads, seq, seq)
float32 tensor per layer. float32 on the CPU; each figure is the median of `repeats` timed calls after one untimed
call, wall clock, the runs with and without the helper alternating. Prints a table; --json OUT writes it.

    PYTHONPATH=build/python python3 python/benchmarks/qk_clip_hf.py [--hidden 256] [--heads 8] [--kv-heads 2]
        [--layers 2] [--seq 256] [--batch 4] [--repeats 5] [--threads 1] [--json OUT]
"""

import argparse
import json
import statistics
import time

import torch
import transformers

from dmuon.torch import DMuon, hf_qk_clip


def model_of(args, implementation):
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                                      attn_implementation=implementation)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 256), ("heads", 8), ("kv-heads", 2), ("layers", 2), ("seq", 256), ("batch", 4),
                          ("repeats", 5), ("threads", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    rows = []
    for implementation in ("eager", "sdpa"):
        runs = {}
        for wrapped in (False, True):  # timed alternately, so that the machine's load falls on both alike
            model = model_of(args, implementation)
            opt = DMuon(model.named_parameters(), balancer="lpt", tune_cache=None, algo="standard")
            if wrapped:
                hf_qk_clip(model, opt, tau=100.0)
            runs[wrapped] = (model, opt)
        times = {key: [] for key in ((kind, wrapped) for kind in ("forward_backward", "step") for wrapped in runs)}
        for repeat in range(args.repeats + 1):
            for wrapped, (model, opt) in runs.items():
                t0 = time.perf_counter()
                model(tokens).logits.float().square().mean().backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                opt.zero_grad()
                if repeat:  # the first is untimed
                    times["forward_backward", wrapped].append(t1 - t0)
                    times["step", wrapped].append(t2 - t1)
        figures = {key: statistics.median(values) for key, values in times.items()}
        rows.append(dict(attention=implementation, forward_backward_s=figures["forward_backward", False],
                         with_reporting_s=figures["forward_backward", True],
                         overhead=figures["forward_backward", True] / figures["forward_backward", False] - 1,
                         step_s=figures["step", False], step_with_clip_s=figures["step", True]))
    print(f"Qwen2 hidden {args.hidden}, {args.heads} heads ({args.kv_heads} kv), {args.layers} layers, batch "
          f"{args.batch} × seq {args.seq}, {args.threads} thread(s), CPU float32")
    print(f"{'attention':<10}{'fwd+bwd s':>11}{'+ reporting s':>15}{'overhead':>10}{'step s':>9}{'+ clip s':>10}")
    for r in rows:
        print(f"{r['attention']:<10}{r['forward_backward_s']:>11.3f}{r['with_reporting_s']:>15.3f}"
              f"{r['overhead']:>10.1%}{r['step_s']:>9.3f}{r['step_with_clip_s']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
