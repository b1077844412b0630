"""What joins a DMuon step from outside it (DMuon.add_step_hook): a StepHook's phases around the step's own.

  step():  before_step() of every hook, in the order they joined
           the gradient check (gradient_check.py): one all-reduce, which carries every hook's extra(rank, world);
           under nonfinite="error" a hook's veto(extra) false skips the whole step on the device
           AdamW, the Muon exchange (exchange.py), their writes masked by the check
           after_step(extra, written) of every hook, in reverse order
  settle:  when the host reads the step's check (optimizer.py's _settle), settle(extra, update) of every hook that
           gave an extra: the problems it names, raised with the step's own under nonfinite="error"
extra is the sum over the group's ranks of what the hook gave (None if it gave nothing): a device tensor in the
step, host values when it settles. The owner-held mode's schedules (held/hooks.py: their gradients ready before,
their working copies stale after) join when DMuon tracks a held parameter; QK-clip (qk_clip.py: its maxima in the
all-reduce, its rescale after, a maximum it cannot take named when the step settles) when it is made. A hook reads
the optimizer through its public attributes (nonfinite, last_stats) and DMuon.layouts()."""


class StepHook:
    """The protocol, each phase doing nothing."""

    def before_step(self):
        """Before the step reads the gradients."""

    def extra(self, rank, world):
        """None, or a 1-D float64 tensor this rank adds to the step's all-reduce (summed over the ranks)."""
        return None

    def veto(self, extra):
        """None, or a () bool device tensor: false where the step must change nothing (under nonfinite="error")."""
        return None

    def after_step(self, extra, written):
        """After the step's updates; written: a () bool device tensor, whether they were kept. Returns None or
        {name: value} for the optimizer's last_stats."""
        return None

    def settle(self, extra, update):
        """The step `update` settled (extra: host values): the problems found in it, in words ([] if none)."""
        return []
