"""torchtitan as the titan tests (torch_titan_test.py, torch_titan_qk_clip_test.py, torch_titan_pp_test.py,
torch_titan_layouts_test.py) run it on the CPU: its settings for gloo (set on import: its device type, its SPMD
backend), the training config, the optimizer container with DMuon, the LR schedule and checkpointer, the cases' models
(cut to a few layers, SDPA attention) built through their parallelize functions as Trainer.__init__ builds them, the
batches and the summed loss, full weights in and out."""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models import deepseek_v3, llama3, qwen3
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
from torchtitan.models.llama3.sharding import set_llama3_sharding_config
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from dmuon.torch import titan

SAVED_AT = 2
PER_RANK, SEQ = 2, 16
MAX_NORM = 1.0
SCHEDULE = LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)
# torchtitan's Trainer runs the default spmd_types backend; on the CPU its fully_shard refused the plain
# parameters ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh"), AdamW's too
PARALLELISM = ParallelismConfig(spmd_backend="partial_dtensor")
TRAINING = TrainingConfig(mixed_precision_param="float32", local_batch_size=PER_RANK, seq_len=SEQ, max_norm=MAX_NORM)
# torchtitan 0.3.0 takes "cuda" as its device type when no accelerator is present; its meshes are the CPU's here
torchtitan.distributed.parallel_dims.device_type = "cpu"
# Trainer.__init__'s first setting: the backend its modules read at run time (the MoE's token dispatcher)
dist_utils.set_spmd_backend(PARALLELISM.spmd_backend)


def optimizer_config(**options):
    # one pattern for every parameter: DMuon routes them (tok_embeddings, lm_head and the norms to AdamW)
    return titan.DMuonOptimizers.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="DMuon",
                                       optimizer_kwargs=dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.1))],
        optimizer_factory_kwargs_by_name={"DMuon": dict(ns_dtype="float32", **options)})


def two_layers_sdpa(spec, layers=2):
    """The spec with its first `layers` layers, their FlexAttention as SDPA."""
    spec.model.layers = spec.model.layers[:layers]
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return spec


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    spec: object  # () -> a fresh ModelSpec
    steps: int
    # whether gradient norms and final weights are compared, not only the losses: torchtitan's routed experts
    # multiply in bfloat16 (GroupedExperts.forward), and in one process the MoE's weights after 2 steps moved by
    # up to 0.0044 (tok_embeddings: AdamW's sign-like first steps; the expert stacks 0.0045: Newton–Schulz lifts
    # the bfloat16 noise in their rank-deficient gradients, 32 tokens an expert) when only the order of the
    # batch's rows changed, while the losses moved by 1.6e-7 relative
    exact: bool
    # the routed experts over every rank (parallelism.expert_parallel_degree = the world size: tokens to them by
    # all-to-all)
    expert_parallel: bool = False


def initial_weights(case):
    """The case's model's weights as torchtitan initialises them, from one seed: {name: full tensor}."""
    torch.manual_seed(0)
    model = case.spec().model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.state_dict()


def load_full(model, weights):
    """Loads full tensors into the parallelized model: FSDP2's DTensors as their shards (set_model_state_dict's
    full_state_dict load failed on the fused wqkv: "aten.copy_.default got mixed torch.Tensor and DTensor"), a
    held matrix (a Partial DTensor in the state dict) whole, which its owner keeps."""
    mine = model.state_dict()
    model.load_state_dict({k: distribute_tensor(v, mine[k].device_mesh, mine[k].placements)
                           if isinstance(mine[k], DTensor) and not any(p.is_partial() for p in mine[k].placements)
                           else v for k, v in weights.items()})


def batches(case, world):
    """(steps, world · PER_RANK, SEQ + 1) tokens: step s's rows of every rank (rank r's: r·B to (r + 1)·B − 1)."""
    gen = torch.Generator().manual_seed(9)
    return torch.randint(0, case.spec().model.vocab_size, (case.steps, world * PER_RANK, SEQ + 1), generator=gen)


def summed_loss(model, rows, tokens):
    """Cross-entropy summed over `rows`' tokens / `tokens` (torchtitan's loss: global-token normalisation)."""
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum") / tokens


def backward_per_rank(model, rows):
    """The one process's forward and backward of a step's rows (all ranks'), one per rank's rows (torch_titan_test's
    reference() says why): the step's loss."""
    loss = 0.0
    for part in rows.split(PER_RANK):
        part_loss = summed_loss(model, part, rows[:, 1:].numel())
        part_loss.backward()
        loss += part_loss.item()
    return loss


class TrainState:
    """The Trainer's step, saved and loaded by the checkpointer (its states={"train_state": trainer})."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def materialize(part):
    """Trainer's steps after the parallelize function on a model part: to_empty, init_weights, train. torchtitan
    sets FSDP's gradient divide factor to 1.0 (a sum), which FSDP2 sends as PREMUL_SUM and gloo refuses ("Cannot
    use ReduceOp.PREMUL_SUM with Gloo"): the same sum as SUM."""
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    part.to_empty(device="cpu")
    with torch.no_grad():
        part.init_weights(buffer_device=None)
    part.train()


def with_parallel_plan(spec, parallelism):
    """The spec with its model's tensor- and expert-parallel plan (sharding configs) for `parallelism`: what the
    model config's update_from_config sets in Trainer.__init__ (whose import of torchtitan.trainer needs torchdata,
    which the venv leaves out), for Llama3, Qwen3 and DeepSeek-V3."""
    model, sp, ep = spec.model, parallelism.enable_sequence_parallel, parallelism.expert_parallel_degree > 1
    if isinstance(model, llama3.Llama3Model.Config):
        set_llama3_sharding_config(model, enable_sp=sp)
    elif isinstance(model, qwen3.Qwen3Model.Config):
        set_qwen3_sharding_config(model, enable_sp=sp, enable_ep=ep)
    elif isinstance(model, deepseek_v3.DeepSeekV3Model.Config):
        set_deepseek_v3_sharding_config(model, enable_sp=sp, enable_ep=ep)
    else:
        raise ValueError(f"no parallel plan here for {type(model).__qualname__}")
    return spec


def parallelized(case, held, out, tp=1, ep=1, replicate=1):
    """The case's model built on the meta device, through its parallelize function (FSDP2 over every rank, or
    over a (fsdp, tp) mesh with tp > 1: tensor parallelism by the model's own plan; routed experts over ep ranks
    of the fsdp ones with ep > 1; HSDP over (dp_replicate, fsdp) with replicate > 1; owner_held around it when
    held), materialized: (spec, parallel dims, model)."""
    spec = case.spec()
    parallelism = PARALLELISM
    if tp > 1 or ep > 1:
        parallelism = dataclasses.replace(PARALLELISM, tensor_parallel_degree=tp, expert_parallel_degree=ep)
        spec = with_parallel_plan(spec, parallelism)
    if held:
        spec = dataclasses.replace(spec, parallelize_fn=titan.owner_held(spec.parallelize_fn))
    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=replicate, dp_shard=world // (tp * replicate), cp=1, tp=tp, pp=1, ep=ep,
                        world_size=world, spmd_backend=PARALLELISM.spmd_backend)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=TRAINING, parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=None, dump_folder=str(out))
    materialize(model)
    return spec, dims, model


def held_names(model):
    """The names of the model's owner-held parameters (their marks: the owner's master, a placeholder elsewhere)."""
    return [n for n, p in model.named_parameters() if getattr(p, "_dmuon_held", None) is not None]


def checkpointed(model, optimizers, schedulers, out):
    """(the train state, torchtitan's CheckpointManager saving it every SAVED_AT steps in out/checkpoint with the
    model, optimizers and LR schedulers)."""
    state = TrainState()
    checkpointer = CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVED_AT,
                                            last_save_model_only=False, initial_load_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=str(out))
    return state, checkpointer


def full_weights(model):
    """model.state_dict() (torchtitan's checkpoint view: the fused wqkv as wq, wk, wv) with full tensors.
    Collective (get_model_state_dict reads wqkv, which the state dict does not name)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
