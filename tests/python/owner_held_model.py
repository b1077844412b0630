"""The small model and data of the owner-held tests (torch_owner_held_test.py and its ledger, overlap
and DCP companions): a GPT-like stack of blocks over token embeddings, with the matrix kinds DMuon
holds — square, wide and tall Linear weights and a 3-D expert stack — and the AdamW kinds FSDP2
keeps (embedding, head, LayerNorm, biases).

  tokens (B, T) → embed (B, T, D) → blocks → head (B, T, V); loss: next-token cross-entropy.
  block: h = LayerNorm(x); h = mix(h) + Σ_e h @ experts[e] / E; x + down(gelu(up(h)))

Every rank builds the same model (one seed) and draws the same global batches; rank r trains on
its slice, so FSDP2's (and the owners') mean over ranks is the gradient of the global batch's mean
loss, which the float64 reference computes in one process.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HIDDEN, EXPERTS, SEQ = 32, 12, 20, 3, 6


class Block(torch.nn.Module):
    def __init__(self, dim=DIM, hidden=HIDDEN, experts=EXPERTS):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.mix = torch.nn.Linear(dim, dim, bias=False)        # (D, D)
        self.up = torch.nn.Linear(dim, hidden)                  # (H, D): tall
        self.down = torch.nn.Linear(hidden, dim, bias=False)    # (D, H): wide
        self.experts = torch.nn.Parameter(torch.randn(experts, dim, dim) * dim ** -0.5)  # (E, D, D)

    def forward(self, x):  # x (B, T, D)
        h = self.norm(x)
        h = self.mix(h) + torch.einsum("btd,edf->btf", h, self.experts) / self.experts.shape[0]
        return x + self.down(F.gelu(self.up(h)))


class Net(torch.nn.Module):
    """checkpointing: None, "non-reentrant" or "reentrant" (torch.utils.checkpoint of every block)."""

    def __init__(self, layers=3, dim=DIM, hidden=HIDDEN, checkpointing=None):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList([Block(dim, hidden) for _ in range(layers)])
        self.head = torch.nn.Linear(dim, VOCAB)
        self.checkpointing = checkpointing

    def forward(self, tokens):  # tokens (B, T) → logits (B, T, V)
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(x)


def make_net(dtype=torch.float32, **kwargs):
    torch.manual_seed(11)
    return Net(**kwargs).to(dtype)


def loss_of(net, tokens):
    logits = net(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def global_batches(steps, batch):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=gen) for _ in range(steps)]


def rank_slice(tokens, rank, world):
    per_rank = tokens.shape[0] // world
    return tokens[rank * per_rank:(rank + 1) * per_rank]
