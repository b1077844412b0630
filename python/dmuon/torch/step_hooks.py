"""What joins a DMuon step from outside it (DMuon.add_step_hook): a StepHook's phases around the step's own.

  step():  before_step() of every hook, in the order they joined
           the gradient check (gradient_check.py): one all-reduce, which carries every hook's extra(rank, world)
           AdamW, the Muon exchange (exchange.py)
           after_step(extra) of every hook, in reverse order, extra: the sum over the group's ranks of what it gave
           (None if it gave nothing)
The owner-held mode's schedules (held/hooks.py: their gradients ready before, their working copies stale after)
join when DMuon tracks a held parameter; QK-clip (qk_clip.py: its maxima in the all-reduce, its rescale after)
when it is made. A hook reads the optimizer through its public attributes and DMuon.layouts()."""


class StepHook:
    """The protocol, each phase doing nothing."""

    def before_step(self):
        """Before the step reads the gradients."""

    def extra(self, rank, world):
        """None, or a 1-D float64 tensor this rank adds to the step's all-reduce (summed over the ranks)."""
        return None

    def after_step(self, extra):
        """After the step's updates, with the all-reduced sum of every rank's extra() (a device tensor, None
        without one)."""
