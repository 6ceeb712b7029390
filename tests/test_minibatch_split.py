"""``split_minibatch`` (pipeline/arguments.py): a minibatch as (inputs, targets) tensors or a list of
microbatch pairs, and the one-line errors for what cannot be split."""
import re

import pytest
import torch

from asyncpp_ext.pipeline.arguments import split_minibatch


def test_tensors_split_into_equal_microbatches_and_a_list_of_pairs_is_kept():
    x, y = torch.arange(8).reshape(4, 2), torch.arange(8, 16).reshape(4, 2)
    xs, ys = split_minibatch((x, y), 2)
    assert [t.tolist() for t in xs] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [t.tolist() for t in ys] == [[[8, 9], [10, 11]], [[12, 13], [14, 15]]]
    pairs = [(x[:2], y[:2]), (x[2:], y[2:])]
    xs, ys = split_minibatch(pairs, 2)
    assert [a is b for a, b in zip(xs + ys, [p[0] for p in pairs] + [p[1] for p in pairs])] == [True] * 4


@pytest.mark.parametrize("batch, m, words", [
    ((torch.zeros(8, 3), torch.zeros(4, 3)), 4, "a minibatch's inputs (8, 3) and targets (4, 3) must have one leading size"),
    ((torch.zeros(()), torch.zeros(())), 1, "a minibatch's inputs () and targets () must have one leading size"),
    ((torch.zeros(6, 3), torch.zeros(6, 3)), 4, "a minibatch of 6 sequences cannot be split into 4"),
    ([(torch.zeros(2, 3), torch.zeros(2, 3))], 2, "a minibatch of 1 (inputs, targets) microbatches"),
    ("text", 2, "a minibatch must be (inputs, targets) tensors"),
])
def test_what_cannot_be_split_is_one_line(batch, m, words):
    # inputs and targets of different sizes were split into chunks of different counts and sizes
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        split_minibatch(batch, m)
    assert "\n" not in str(info.value)
