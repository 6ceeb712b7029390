"""The 2bw update rule written out with two models, for checking the simulator and the pipeline.

W(t+1) = W(t) - lr U(grad f_t(W(t-1))), W(-1) := W(0). ``model`` holds W(t) and is the only thing
the optimizer sees; ``previous``, a deep copy, holds W(t-1): every microbatch of step t runs its
forward and backward there, and the gradient it leaves is handed to the optimizer of ``model``.
Nothing here comes from asyncpp_ext (the simulator swaps weight storage in place, the pipeline
keeps flat version buffers); only the optimizer under test is the product's.
"""
import copy


def delayed_training(make_model, make_optimizer, minibatches, loss_fn, delayed=True):
    """Train ``make_model()`` with ``make_optimizer(model)`` on ``minibatches`` (lists of (x, y)).

    Each step: microbatches i = 0..m-1 in order, forward + backward of ``loss_fn(net, x, y) / m``
    accumulated into .grad; the step's loss is the mean of the microbatch losses (Python floats,
    summed in order). ``delayed=False`` is the synchronous rule (gradients on W(t) itself).
    Returns (losses, model with the final W(T), previous with W(T-1)).
    """
    model = make_model()
    previous = copy.deepcopy(model)  # W(-1) = W(0)
    optimizer = make_optimizer(model)
    model.train()
    previous.train()
    losses = []
    for minibatch in minibatches:
        net = previous if delayed else model
        for p in net.parameters():
            p.grad = None
        m, total = len(minibatch), 0.0
        for x, y in minibatch:
            loss = loss_fn(net, x, y)
            (loss / m).backward()
            total += loss.item()
        losses.append(total / m)
        if delayed:
            for p, q in zip(model.parameters(), previous.parameters()):
                p.grad, q.grad = q.grad, None
            # W(t) is what the next step differentiates; the optimizer then makes W(t+1).
            previous.load_state_dict(model.state_dict())
        optimizer.step()
    return losses, model, previous
