"""A model no one here wrote, trained the way scripts train it (issue 29): Hugging Face transformers'
Qwen2ForCausalLM built from a small config (random init, nothing downloaded), with the library's own
gradient checkpointing, every decoder layer and the root under fully_shard, DMuon in both modes
(all-to-all on FSDP2's DTensors; owner-held matrices), against one process running torch.optim.Muon
(its Newton–Schulz in float32 instead of bfloat16) on the same matrices and torch.optim.AdamW on the
rest. Each step the script's habits: the loss from the model's labels, dmuon.torch.clip_grad_norm_
(torch.nn.utils.clip_grad_norm_ in the reference), the weight norms logged (inside held.unshard()
in the owner-held mode), an eval forward under no_grad. Then the export: the full state dict on
rank 0 (cpu_offload) equals the reference's weights, is written as safetensors and loads into a
fresh single-process model bit for bit.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 2 -- tests/python/torch_hf_model_test.py DIR
"""

import contextlib
import pathlib
import sys

import torch
import torch.optim._muon as torch_muon
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

import dmuon.torch
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from dmuon.torch.torch_engine import newton_schulz
from muon_reference import KELLER
from rank_checks import check, finish
from rank_exit import exit_rank

STEPS = 4
BATCH, SEQ = 12, 16
MAX_NORM = 0.655  # the reference's norms are 0.653 to 0.661: clipping is active in some steps, not all
# The runs differ from the reference by float32 rounding in the gradients' summation order (ε = 1.2e-7);
# Newton–Schulz with Keller's coefficients multiplies a perturbation along a small singular direction by
# up to a = 3.4445 per step, a^5 = 486 over its 5 steps: rtol = ε·a^5 = 5.8e-5.
TOLERANCE = 5.8e-5
HYPER = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def make_model():
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG, attn_implementation="eager"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def is_hidden_matrix(name, p):
    return p.dim() == 2 and ".layers." in name


def batches():
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen) for _ in range(STEPS + 1)]


def rank_rows(tokens):
    per_rank = tokens.shape[0] // WORLD
    return tokens[RANK * per_rank:(RANK + 1) * per_rank]


def float32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton–Schulz (torch/optim/_muon.py) in float32, not bfloat16, normalised as
    KellerJordan/Muon and dmuon (DESIGN 2.1: ‖U‖ + eps; torch clamps ‖U‖ at eps, which differs by
    eps/‖U‖ relative: 1e-4 on this model's small attention gradients): dmuon.torch's torch engine, its
    standard recurrence with torch's default coefficients (Keller's)."""
    assert tuple(ns_coefficients) == KELLER, ns_coefficients
    return newton_schulz(grad, "keller", ns_steps, "standard", torch.float32, eps=eps)


def reference():
    """(weights after STEPS steps, per-step norms before clipping): one process, the global batch."""
    model = make_model()
    muon = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not is_hidden_matrix(n, p)]
    torch_muon._zeropower_via_newtonschulz = float32_newton_schulz
    opts = [torch.optim.Muon(muon, adjust_lr_fn="original", nesterov=True, **HYPER), torch.optim.AdamW(rest, **ADAMW)]
    norms = []
    for tokens in batches()[:STEPS]:
        model(input_ids=tokens, labels=tokens).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def train(mode):
    """(the full state dict on rank 0, per-step norms, the last logged Σ w² over the tensors every rank
    can read: the held matrices inside held.unshard(), none of FSDP2's DTensors)."""
    model = make_model()
    mesh = init_device_mesh("cpu", (WORLD,))
    held = hold_on_owners(model, mesh, predicate=is_hidden_matrix) if mode == "owner-held" else None
    ignored = held.params if held is not None else None
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    opt = DMuon(model, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], adamw_eps=ADAMW["eps"],
                adamw_weight_decay=ADAMW["weight_decay"], scale="original", algo="standard", ns_dtype="float32",
                **HYPER)
    muon_names = {n.split("[")[0] for n in opt.owners}
    check(muon_names == {n for n, p in make_model().named_parameters() if is_hidden_matrix(n, p)},
          f"{mode}: DMuon routed {sorted(muon_names)} to Muon")
    norms, logged = [], []
    data = batches()
    for tokens in data[:STEPS]:
        mine = rank_rows(tokens)
        model(input_ids=mine, labels=mine).loss.backward()
        norms.append(float(dmuon.torch.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        with held.unshard() if held is not None else contextlib.nullcontext():
            logged.append(sum(float(p.detach().float().pow(2).sum()) for p in model.parameters()
                              if not isinstance(p, torch.distributed.tensor.DTensor)))
            with torch.no_grad():
                model.eval()
                model(input_ids=rank_rows(data[STEPS]), labels=rank_rows(data[STEPS]))
                model.train()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full, norms, logged[-1]


def main(folder):
    ref_weights, ref_norms = reference()
    for mode in ("all-to-all", "owner-held"):
        full, norms, logged = train(mode)
        if mode == "owner-held":
            expected = sum(float(w.pow(2).sum()) for n, w in ref_weights.items() if ".layers." in n and w.dim() == 2)
            check(abs(logged - expected) <= TOLERANCE * expected, f"{mode}: logged Σ w² {logged}, reference {expected}")
        worst = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
        check(worst <= TOLERANCE, f"{mode}: gradient norms {norms}, the reference's {ref_norms}")
        check(any(n > MAX_NORM for n in ref_norms), f"clipping never active (norms {ref_norms})")
        if RANK != 0:
            continue
        check(set(full) == set(ref_weights), f"{mode}: export lacks {sorted(set(ref_weights) - set(full))}")
        for name, value in full.items():
            if name.endswith("k_proj.bias"):
                continue  # its gradient is 0 exactly (softmax ignores a shift shared by all keys): AdamW steps
                          # it by the rounding noise of each run, so no two summation orders agree on it
            error = float((value - ref_weights[name]).norm() / ref_weights[name].norm().clamp_min(1e-30))
            check(error <= TOLERANCE, f"{mode}: {name} relative error {error:.2e} to the single-process reference")
        path = pathlib.Path(folder) / f"qwen2_{mode}_np{WORLD}.safetensors"
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
        fresh = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
        fresh.load_state_dict(load_file(str(path)))
        for name, p in fresh.named_parameters():
            check(torch.equal(p.detach(), full[name]), f"{mode}: {name} after the safetensors round trip")
    return finish(f"torch_hf_model_test np {WORLD}: Qwen2 under FSDP2, both modes, within {TOLERANCE:g} of "
                  f"torch.optim.Muon + AdamW in one process; full export and safetensors round trip bit-identical")


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    pathlib.Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    exit_rank(main(sys.argv[1]))
