"""Models under tensor parallelism for the TP tests (torch_tp_ep_test.py, torch_qk_clip_tp_test.py): Hugging Face
transformers' Qwen2 from a small config with its own TP plan and its batches, a model laid out by torch's
parallelize_module (then hold_on_owners, then fully_shard on the data-parallel dims), and a parameter's global
tensor on every rank (collective)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon.torch import hold_on_owners
from dmuon.torch.held.placeholder import HeldElsewhere

BATCH = 8  # rows of a global batch


def qwen2_case():
    """Hugging Face transformers' Qwen2 from a small config (random init, nothing downloaded) with the
    config's own tensor-parallel plan (base_model_tp_plan: q, k, v, gate, up column-wise; o, down row-wise),
    applied by torch's parallelize_module (torch_tp_ep_test's qwen3_moe_case takes transformers' own path)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = Qwen2ForCausalLM(config).train()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {path: styles[style]() for path, style in config.base_model_tp_plan.items()}

    def loss(m, tokens):
        return m(input_ids=tokens, labels=tokens).loss
    return model, model.model, plan, model.model.layers, loss, None


def qwen2_batch(gen):
    return torch.randint(0, 96, (BATCH, 12), generator=gen)


def full_of(t, holdings):
    """The global tensor of `t` on every rank: a DTensor's full_tensor(), a plain tensor itself; with the
    holdings of an owner-held matrix (a TP slice, an EP stack's slice, or whole on its owner), its slices summed
    into place over the ranks (each element lies on exactly one rank; a placeholder adds nothing)."""
    if holdings is None:
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    local = t.to_local() if isinstance(t, DTensor) else t
    full = torch.zeros(t.shape, dtype=torch.float32)
    if not isinstance(local, HeldElsewhere):  # a TP or EP slice: one run per dim
        full[tuple(slice(s.runs[0][0], sum(s.runs[0])) for s in holdings[dist.get_rank()].spans)] = local.float()
    dist.all_reduce(full)
    return full


def tp_and_fsdp2(world, model, base, plan, blocks, held):
    """Lays the model out: torch's parallelize_module with its TP plan, then (held) hold_on_owners, then (at 4
    and 8 ranks) fully_shard on the data-parallel dims. (name, data-parallel size, this rank's place there, the
    HeldMatrices or None)."""
    if world == 2:
        name, dp, dp_rank, data_mesh = "tp 2", 1, 0, None
        tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    else:  # FSDP2 (world 4) or HSDP (world 8: replicate 2 × dp 2) on the data-parallel dims, tp 2
        shape, names = ((2, 2), ("dp", "tp")) if world == 4 else ((2, 2, 2), ("replicate", "dp", "tp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        data_mesh = mesh[names[:-1]] if world == 8 else mesh["dp"]
        tp_mesh, dp = mesh["tp"], world // 2
        dp_rank = dist.get_rank() // 2  # the rank's place on the data-parallel dims (tp is the last dim)
        name = f"{'hsdp (2, 2)' if world == 8 else 'fsdp2 (dp 2)'} x tp 2"
    parallelize_module(base, tp_mesh, plan)
    # held: given the whole mesh, as a user has it after parallelize_module(model, mesh["tp"], plan) (issue 58):
    # hold_on_owners takes its data-parallel dims, the mesh fully_shard gets
    holding = hold_on_owners(model, data_mesh if world == 2 else mesh) if held else None
    if world > 2:
        for block in blocks:
            fully_shard(block, mesh=data_mesh, ignored_params=holding.params if held else None)
        fully_shard(model, mesh=data_mesh, ignored_params=holding.params if held else None)
    return name, dp, dp_rank, holding
