"""The model of torch_dmuon_mpi_test and its neighbours (torch_conventions_test, torch_conventions_ranks_test,
torch_state_dict_one_rank_test): SPECS' parameters with identical values and gradients on every rank, whole or in
hand-made dim-0 chunks (dmuon.torch.Sharded: Model), or under real FSDP2 (Holder); the tolerance of its runs against
the float64 reference (muon_reference.Reference)."""

import torch
import torch.distributed as dist

from dmuon.torch import Sharded, chunk_rows

SPECS = [
    ("embed.weight", (50, 16)),              # AdamW by name
    ("layers.0.attn.weight", (16, 16)),
    ("layers.1.attn.weight", (16, 16)),      # same shape as the previous one: a batch of 2
    ("layers.0.mlp.up.weight", (40, 16)),
    ("layers.0.mlp.down.weight", (16, 40)),
    ("odd.weight", (7, 12)),                 # 7 rows: not divisible by 2, 3 or 4
    ("tiny.weight", (3, 20)),                # 3 rows: an empty shard at 4 ranks
    ("conv.weight", (6, 3, 2, 2)),           # Muon views it as 6×12
    ("experts.weight", (8, 24, 16)),         # 8 matrices of 24×16
    ("norm.weight", (16,)),
    ("layers.0.mlp.up.bias", (40,)),
    ("head.weight", (50, 16)),               # AdamW by name
]
STEPS = 10
TOLERANCE = 1e-5

def initial_values():
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randn(shape, generator=gen) * 0.5 for n, shape in SPECS}


def gradient(step, k, shape):
    gen = torch.Generator().manual_seed(1000 * step + k)
    return torch.randn(shape, generator=gen) * (1 + k % 3)


def gradients(step):
    return {n: gradient(step, k, shape) for k, (n, shape) in enumerate(SPECS)}


class Model:
    """Parameters of `specs` laid out per `sharded_names` (dim-0 chunks over `group`) or whole."""

    def __init__(self, values, sharded_names=(), group=None, specs=SPECS):
        self.group = group
        self.shapes = dict(specs)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sharded = set(sharded_names)
        self.params = {}
        for name, v in values.items():
            if name in self.sharded:
                start, count = chunk_rows(v.shape[0], self.world)[self.rank]
                self.params[name] = torch.nn.Parameter(v[start:start + count].clone())
            else:
                self.params[name] = torch.nn.Parameter(v.clone())

    def named(self, names=None):
        out = []
        for name in names or list(self.shapes):
            p = self.params[name]
            out.append((name, Sharded(p, self.shapes[name], self.group) if name in self.sharded else p))
        return out

    def set_grads(self, grads):
        for name, p in self.params.items():
            g = grads[name]
            if name in self.sharded:
                start, count = chunk_rows(g.shape[0], self.world)[self.rank]
                g = g[start:start + count]
            p.grad = g.clone().to(p.dtype)

    def full(self, name):
        p = self.params[name].detach()
        return gather_dim0(p, self.shapes[name][0], self.group) if name in self.sharded else p.clone()


def gather_dim0(local, rows, group=None):
    """The full tensor of `rows` rows from every rank's torch.chunk part `local`."""
    world = dist.get_world_size(group)
    counts = chunk_rows(rows, world)
    per_rank = max(c for _, c in counts)
    padded = local.new_zeros((per_rank,) + tuple(local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    # as bytes: gloo has no bfloat16
    dist.all_gather([t.reshape(-1).view(torch.uint8) for t in parts], padded.reshape(-1).view(torch.uint8),
                    group=group)
    return torch.cat([part[:c] for part, (_, c) in zip(parts, counts)])


class Holder(torch.nn.Module):
    """SPECS' parameters under real FSDP2; forward(grads) = Σ ⟨p, g⟩, so backward's gradient of p is
    g once FSDP2 has averaged it over the ranks (all compute the same loss)."""

    def __init__(self, values, names):
        super().__init__()
        self.names = list(names)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(values[n].clone()) for n in self.names])

    def forward(self, grads):
        return sum((p * grads[n]).sum() for n, p in zip(self.names, self.weights))

    def named(self):
        return list(zip(self.names, self.weights))

    def full(self, name):
        return self.weights[self.names.index(name)].detach().full_tensor()

    def train_step(self, opt, step):
        self(gradients(step)).backward()
        opt.step()
        opt.zero_grad()
