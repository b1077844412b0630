"""The memory count of the benchmarks' memory tables (python/benchmarks/memory_count.py) on allocations whose
bytes are known:
  StepAllocations   a new storage counts from its op to its free, at its size; views, in-place ops and out=
                    count nothing new; a storage the autograd graph keeps counts until the graph goes; a
                    storage alive before, given as existing, lowers the count when freed; the peak is the most
                    alive at once; the engine's growth adds at the moment it happened, and libdmuon_c's
                    own count of its buffers (dmuon.engine_bytes) in one Newton–Schulz call is its
                    workspace: two m×n and four m×m float32 iterates and two float32 norm slots
  held_bytes        a Linear under AdamW: weights, AdamW's state (step, m, v), other tensors kept beside them,
                    a wrapper optimizer's inner optimizers' state, each storage once; a placeholder of dmuon.torch's
                    owner-held matrices (no storage) nothing

Run: PYTHONPATH=build/python python -m pytest -q tests/python/memory_count_test.py
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python" / "benchmarks"))
from memory_count import StepAllocations, held_bytes, reachable_storages  # noqa: E402

F32 = 4


def test_counts_each_new_storage_from_allocation_to_free():
    before = torch.zeros(100)                  # allocated before: what ops do to it inside allocates nothing
    with StepAllocations(engine=None) as count:
        before.add_(1)
        torch.mul(before, 2, out=before)
        before[10:].mul_(3)
        assert count.live == 0
        a = torch.zeros(1000)                  # 4000 B
        assert count.live == 1000 * F32
        view = a[10:]
        a.add_(1)
        torch.mul(a, 2, out=a)
        assert count.live == 1000 * F32        # a view, an in-place op, out=: no new storage
        b = a + view[:990].sum()               # a 1000-float result and a 1-float temporary
        assert count.live == 2000 * F32
        del b
        assert count.live == 1000 * F32
        x = torch.ones(250, requires_grad=True)  # 1000 B
        y = x.exp()                              # 1000 B, saved by the graph for exp's backward
        z = y.sum()                              # 4 B
        del y
        assert count.live == 1000 * F32 + 2 * 250 * F32 + F32
        del z                                    # the graph and with it y's storage
        assert count.live == 1000 * F32 + 250 * F32
        del a, view, x
    assert count.live == 0
    assert count.peak == 2000 * F32 + F32  # a, b and the sum's float at once


def test_a_replaced_buffer_counts_once():
    old = torch.zeros(500)                      # 2000 B held on entry
    with StepAllocations(engine=None, existing=reachable_storages([old]).values()) as count:
        new = torch.zeros(500)
        del old                                 # replaced: the step's total is back to what it held
        assert count.live == 0
        extra = torch.zeros(250)
        assert count.live == 1000
    assert count.peak == 2000
    del new, extra


class FakeEngine:
    """What memory_count.engine_bytes returns, set by the test: (live, peak since the last reset)."""

    def __init__(self, live):
        self.live = self.peak = live

    def __call__(self, reset_peak):
        out = (self.live, self.peak)
        if reset_peak:
            self.peak = self.live
        return out

    def call(self, grew_to, kept):  # an engine call: its workspaces reach grew_to bytes, then it keeps `kept`
        self.peak, self.live = max(self.peak, grew_to), kept


def test_adds_the_engines_growth_at_the_moment_it_happened():
    engine = FakeEngine(live=5000)              # pooled before the step: held, not the step's
    with StepAllocations(engine=engine) as count:
        a = torch.zeros(1000)                   # 4000 B
        engine.call(grew_to=5000 + 3000, kept=5000 + 1000)
        b = torch.zeros(100)                    # 400 B; the engine's 3000 above its pool came with a alone
        assert count.peak == 4000 + 3000
        del a
        engine.call(grew_to=5000 + 8000, kept=5000)
        del b                                   # the engine's 8000 came while b (400 B) was alive
    assert count.peak == 400 + 8000
    assert count.live == 0


def test_counts_libdmuon_cs_newton_schulz_workspace():
    import dmuon
    rows, cols = 24, 56  # a shape no other test of this process runs: its workspace is allocated here
    u = torch.randn(rows, cols)
    ns = dmuon.Orthogonalizer(algo="standard", threads=1, tune_cache=None, dtype="float32")
    live_before = dmuon.engine_bytes()[0]
    with StepAllocations() as count:
        o = torch.empty(rows, cols)
        ns.run([u], [o], rows, cols)
    workspace = F32 * (2 * rows * cols + 4 * rows * rows + 2)
    assert dmuon.engine_bytes()[0] - live_before == workspace  # pooled for the next call
    assert count.peak == o.nbytes + workspace


class Wrapper(torch.optim.Optimizer):
    """An optimizer that keeps two inner ones and a full copy beside them (as the benchmark's torch-muon row)."""

    def __init__(self, first, second):
        self.inner = [torch.optim.AdamW(first), torch.optim.SGD(second, momentum=0.9)]
        self.copy = torch.zeros(30)
        super().__init__(first + second, {})


def test_held_bytes_by_what_keeps_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5, bias=False))  # 220 + 100 floats
    params = list(model.parameters())
    opt = Wrapper(params[:2], params[2:])
    model(torch.randn(3, 10)).sum().backward()
    for o in opt.inner:
        o.step()
        o.zero_grad()
    kept = torch.zeros(7)
    held = held_bytes(model, opt, also=[kept, kept[2:], params[0][1:]])
    assert held["weights"] == 320 * F32
    # AdamW: step (a float32 scalar), m and v per parameter; SGD: one momentum buffer
    assert held["state"] == (2 * 1 + 2 * 220) * F32 + 100 * F32
    assert held["other"] == (30 + 7) * F32                 # the copy, and `kept` once; a parameter's view: a weight
    assert held["total"] == held["weights"] + held["state"] + held["other"] + held["engine"]
    model[0].weight.grad = torch.zeros(20, 10)
    assert held_bytes(model, opt)["other"] == 30 * F32 + 200 * F32  # a kept gradient counts as other
    # An owner-held matrix away from its owner: a placeholder without storage counts nothing
    from dmuon.torch.held.placeholder import HeldElsewhere
    model[1].weight = torch.nn.Parameter(HeldElsewhere((5, 20), torch.float32, "cpu", "1.weight", owner=1))
    assert held_bytes(model, opt)["weights"] == 220 * F32
