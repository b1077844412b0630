"""Evidence that the Muon recipe's options train (docs/BENCHMARKS.md, "Training with Muon's options"): a small model
trained on Debian's fortunes (examples/torch_train.py's corpus: its first nine tenths for training, the last tenth
held out), random initial weights, byte vocabulary, context 64, --model
  qwen2  a Hugging Face Qwen2 from a config (width 64, 2 layers, 4 query heads and 2 key-value heads)
  gpt    the GPT example (examples/torch_train.py's Gpt, the C++ demo's shapes: width 128, 4 layers, 4 heads, one
         fused qkv projection of rows [q heads, k heads, v heads])
with, from the same initial weights and batches (fixed seeds):
  adamw        torch.optim.AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.01)
  muon         dmuon.torch.DMuon(model): Muon (lr 0.02, match_rms_adamw) + AdamW (lr 3e-3) for the rest
  muon+split   the same, q/k/v Newton–Schulz per head (qwen2: split_heads 4, 2, 2; gpt: the fused qkv in 12 heads),
               the output projection per head by columns
  normuon      the same as muon with variant="normuon"
  muon+qkclip  the same as muon with QK-clip at tau (low enough to fire): qwen2 through dmuon.torch.hf_qk_clip, gpt
               with a FusedAttention per block and a forward hook on its qkv projection reporting the maxima
One process on the CPU, float32. Per step the training loss; at the end the held-out loss (the mean over 8 fixed
batches). Prints a Markdown table; --json OUT writes every curve, --svg OUT a plot of the training losses
(a moving mean over 10 steps).

    PYTHONPATH=build/python python3 python/benchmarks/train_evidence.py [--model qwen2|gpt] [--steps 300]
        [--batch 16] [--seed 1] [--tau 4] [--json OUT] [--svg OUT]
"""

import argparse
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import transformers

from dmuon.torch import DMuon, FusedAttention, QKClip, hf_qk_clip
from dmuon.torch.params import module_groups

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from torch_train import Gpt, load_corpus  # noqa: E402  (the GPT example's model and corpus reader)

CONTEXT, VOCAB = 64, 256
RUNS = ("adamw", "muon", "muon+split", "normuon", "muon+qkclip")
GPT_HEADS = 4
SPLIT = {  # per model: {name part of an attention projection: its split options}
    "qwen2": {"q_proj": dict(split_heads=4), "k_proj": dict(split_heads=2), "v_proj": dict(split_heads=2),
              "o_proj": dict(split_heads=4, split_dim=1)},
    "gpt": {"attn.qkv": dict(split_heads=3 * GPT_HEADS), "attn.proj": dict(split_heads=GPT_HEADS, split_dim=1)},
}


def model_of(name, seed):
    if name == "gpt":
        torch.manual_seed(seed)
        return Gpt(vocab=VOCAB, context=CONTEXT, heads=GPT_HEADS)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                      tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config)


def gpt_qk_clip(model, opt, tau):
    """QK-clip of the GPT example: each block's fused qkv (weight and bias) as a FusedAttention, its maxima reported by
    a forward hook on the projection (the logits q·kᵀ/√d recomputed from its output, causally masked)."""
    blocks = model.blocks
    clip = QKClip(opt, tau, [FusedAttention(qkv=f"blocks.{i}.attn.qkv.weight", heads=GPT_HEADS,
                                            bias=f"blocks.{i}.attn.qkv.bias") for i in range(len(blocks))])

    def reporter(i):
        def hook(module, args, out):  # out (B, T, 3C)
            with torch.no_grad():
                B, T, C = out.shape[0], out.shape[1], out.shape[2] // 3
                q, k = (t.view(B, T, GPT_HEADS, -1).transpose(1, 2) for t in out.split(C, dim=2)[:2])  # (B, H, T, d)
                logits = (q @ k.transpose(-1, -2)) / math.sqrt(C // GPT_HEADS)  # (B, H, T, T)
                causal = torch.ones(T, T, dtype=torch.bool).tril()
                clip.report(i, logits.masked_fill(~causal, -torch.inf).amax(dim=(0, 2, 3)))
        return hook

    for i, block in enumerate(blocks):
        block.attn["qkv"].register_forward_hook(reporter(i))
    return clip


def split_groups(model, name):
    """module_groups(model) with the attention projections in groups of their split."""
    out = []
    for group in module_groups(model):
        if not group["use_muon"]:
            out.append(group)
            continue
        kinds = {}
        for param_name, p in group["params"]:
            kinds.setdefault(next((k for k in SPLIT[name] if f".{k}." in param_name), None), []).append((param_name, p))
        out.extend({"params": members, "use_muon": True, **SPLIT[name].get(kind, {})} for kind, members in kinds.items())
    return out


def optimizer_of(run, model, name, tau):
    """(optimizer, QKClip or None)."""
    muon = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, balancer="lpt", tune_cache=None)
    if run == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01), None
    if run == "muon+split":
        return DMuon(split_groups(model, name), **muon), None
    opt = DMuon(model, variant="normuon" if run == "normuon" else "muon", **muon)
    if run != "muon+qkclip":
        return opt, None
    return opt, (gpt_qk_clip if name == "gpt" else hf_qk_clip)(model, opt, tau)


def batch(data, size, gen):
    starts = torch.randint(0, data.numel() - CONTEXT - 1, (size,), generator=gen)
    return torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()])


def loss_of(model, tokens):
    if isinstance(model, Gpt):
        return model(tokens[:, :-1], tokens[:, 1:])  # its forward takes the targets and returns the loss
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(run, args, train_data, val_batches):
    model = model_of(args.model, args.seed)
    opt, clip = optimizer_of(run, model, args.model, args.tau)
    gen = torch.Generator().manual_seed(args.seed)
    losses, fired, max_logits = [], 0, []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = loss_of(model, batch(train_data, args.batch, gen))
        loss.backward()
        if clip is not None:
            top = float(clip._maxima.max())
            max_logits.append(top)
            fired += top > args.tau
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        val = sum(float(loss_of(model, b)) for b in val_batches) / len(val_batches)
    return dict(run=run, train=losses, val=val, seconds=seconds, clip_fired_steps=fired if clip else None,
                max_logit=max(max_logits) if max_logits else None)


def svg(results, path, smooth=10):
    """A line plot of each run's training loss (moving mean over `smooth` steps), standalone SVG."""
    width, height, pad = 640, 400, 50
    curves = {r["run"]: [sum(r["train"][max(0, i - smooth + 1):i + 1]) / len(r["train"][max(0, i - smooth + 1):i + 1])
                         for i in range(len(r["train"]))] for r in results}
    lo, hi = min(min(c) for c in curves.values()), max(max(c) for c in curves.values())
    steps = len(next(iter(curves.values())))

    def xy(i, v):
        return pad + (width - 2 * pad) * i / max(1, steps - 1), height - pad - (height - 2 * pad) * (v - lo) / (hi - lo)

    colors = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">', '<rect width="100%" height="100%" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">step (1..{steps})</text>',
             f'<text x="{pad - 5}" y="{pad}" text-anchor="end">{hi:.2f}</text>',
             f'<text x="{pad - 5}" y="{height - pad}" text-anchor="end">{lo:.2f}</text>',
             f'<text x="{width / 2}" y="20" text-anchor="middle">training loss (moving mean of {smooth} steps)</text>']
    for k, (name, curve) in enumerate(curves.items()):
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(curve)))
        lines.append(f'<polyline fill="none" stroke="{colors[k]}" stroke-width="1.5" points="{points}"/>')
        lines.append(f'<text x="{width - pad - 110}" y="{pad + 16 * k}" fill="{colors[k]}">{name}</text>')
    lines.append("</svg>")
    pathlib.Path(path).write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["qwen2", "gpt"], default="qwen2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tau", type=float, default=4.0)
    parser.add_argument("--corpus", default="/usr/share/games/fortunes")
    parser.add_argument("--json")
    parser.add_argument("--svg")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_corpus(args.corpus)
    cut = data.numel() * 9 // 10
    val_gen = torch.Generator().manual_seed(1000)
    val_batches = [batch(data[cut:], args.batch, val_gen) for _ in range(8)]
    results = [train(run, args, data[:cut], val_batches) for run in RUNS]
    described = {"qwen2": "Qwen2 (width 64, 2 layers, 4 heads / 2 kv heads", "gpt": "the GPT example (width 128, 4 "
                 f"layers, {GPT_HEADS} heads, fused qkv"}[args.model]
    print(f"{described}, context {CONTEXT}) on fortunes, {args.steps} steps of {args.batch} sequences, seed "
          f"{args.seed}, tau {args.tau}, 1 CPU thread")
    print("| run | training loss, mean of the last 20 steps | held-out loss | seconds | QK-clip fired (steps) |")
    print("|---|---|---|---|---|")
    for r in results:
        fired = "" if r["clip_fired_steps"] is None else f"{r['clip_fired_steps']} (max logit {r['max_logit']:.1f})"
        print(f"| {r['run']} | {sum(r['train'][-20:]) / len(r['train'][-20:]):.3f} | {r['val']:.3f} | {r['seconds']:.1f} | {fired} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    if args.svg:
        svg(results, args.svg)


if __name__ == "__main__":
    main()
