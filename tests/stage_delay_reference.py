"""Per-stage weight delays written out with stale copies of each stage, for checking the simulator.

Stage s (a run of the model's blocks) computes step t's forward and backward on its own version
W_s(max(t - d_s, 0)); the gradient is applied to the newest weights. PipeDream (weight stashing) is
d_s = S - 1 - s with one microbatch per step; a constant K-step delay is one stage with d = K.

The newest model is the only thing the optimizer sees. After every optimizer step each stage's
blocks are deep-copied into that stage's history (version t+1); a step chains the stages' copies of
the versions it needs, so the autograd graph runs through stale copies only, and their gradients
are handed to the newest model's parameters. Nothing here comes from asyncpp_ext (the simulator
swaps weight storage in place within one model); only the model and optimizer under test are the
product's, and the partition (block indices per stage) is an argument.
"""
import copy

from torch import nn


def stage_delayed_training(make_model, make_optimizer, minibatches, partition, delays, head_loss):
    """Train ``make_model()`` (a model with ``blocks()`` run in order) with per-stage delays.

    ``partition``: block indices per stage; ``delays``: d_s per stage; ``head_loss(logits, y)``:
    the loss of the last block's output. Each step: microbatches i = 0..m-1 in order, forward +
    backward of ``head_loss / m`` accumulated into the stale copies' .grad; the step's loss is the
    mean of the microbatch losses (Python floats, summed in order).
    Returns (losses, model with W(T), {stage: {version: nn.ModuleList}} of the versions still kept).
    """
    model = make_model()
    optimizer = make_optimizer(model)
    blocks = model.blocks()
    newest = [nn.ModuleList(blocks[i] for i in indices) for indices in partition]
    history = {s: {0: copy.deepcopy(stage)} for s, stage in enumerate(newest)}
    model.train()
    losses = []
    for t, minibatch in enumerate(minibatches):
        used = [history[s][max(t - d, 0)] for s, d in enumerate(delays)]
        for stage in used:
            stage.train()
            for p in stage.parameters():
                p.grad = None
        m, total = len(minibatch), 0.0
        for x, y in minibatch:
            for stage in used:
                for block in stage:
                    x = block(x)
            loss = head_loss(x, y)
            (loss / m).backward()
            total += loss.item()
        losses.append(total / m)
        for fresh, stale in zip(newest, used):
            for p, q in zip(fresh.parameters(), stale.parameters()):
                p.grad, q.grad = q.grad, None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for s, d in enumerate(delays):  # keep version t+1; drop what no later step needs
            history[s][t + 1] = copy.deepcopy(newest[s])
            for version in [v for v in history[s] if v < t + 1 - d]:
                del history[s][version]
    return losses, model, history

