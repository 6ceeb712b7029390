"""``PipelineEngine``: one rank's stage of a pipeline behind the ``StepEngine`` protocol the Trainer
drives (trainer.py); each ``train_steps`` call is one continuous instruction stream."""
from __future__ import annotations

from ..data import BatchStream
from ..pipeline import Pipeline
from .trainer import StepOutcome


class PipelineEngine:
    """StepEngine over a Pipeline: each ``train_steps`` call is one continuous stream."""

    def __init__(self, pipe: Pipeline):
        self.pipe = pipe
        self.stage, self.replica = pipe.stage, pipe.replica
        # Where the stage computes. The rank's Trainer keeps its data on the CPU (the pipeline
        # moves each microbatch itself), so its profiler asks the engine which device to trace.
        self.device = pipe.device
        self._shares_since_ns = 0  # trace entries that started before this are summarised

    def time_shares(self):
        """This stage's compute and wait shares since the last call (TensorBoard)."""
        from .tensorboard_log import stage_time_shares

        recent = []
        for entry in reversed(self.pipe.trace):  # (op, step, mb, version, start_ns, end_ns)
            if entry[4] < self._shares_since_ns:
                break
            recent.append(entry)
        if not recent:
            return None
        self._shares_since_ns = max(e[5] for e in recent) + 1
        return stage_time_shares(recent[::-1])

    def train_steps(self, stream: BatchStream, steps: int):
        minibatches = (stream.next() for _ in range(steps))
        for stats in self.pipe.train(minibatches, steps):
            yield StepOutcome(stats.loss, stats.skipped, stats.done_at)

    def take_grad_norms(self) -> dict:
        """The global gradient norms of the steps since the last call, by step index (--clip-grad-norm
        gathers them; a segment's end has every one of its steps')."""
        norms, self.pipe.exchange.norms = self.pipe.exchange.norms, {}
        return norms

    def take_block_grad_norms(self) -> dict:
        """Each block's gradient norm of the steps since the last call, by step index
        (--log-block-grad-norms)."""
        norms, self.pipe.exchange.block_norms = self.pipe.exchange.block_norms, {}
        return norms

    def eval_loss(self, batches):
        return self.pipe.evaluate(batches)

    def row_losses(self, batches):
        """Each row's summed cross entropy (--eval-choices), on the last stages; None elsewhere."""
        return self.pipe.evaluate(batches, per_row=True)

    def state_dict(self) -> dict:
        return self.pipe.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pipe.load_state_dict(state)


__all__ = ["PipelineEngine"]
