"""The Flax Linen models of the tasks of :mod:`optax_dist.cli.tasks`."""

from __future__ import annotations

import flax.linen as nn


class MLP(nn.Module):
  """A multilayer perceptron: ``Dense -> relu`` for each width in ``hidden``, then ``Dense``.

  Shapes:
    ``[batch, features]`` float inputs to ``[batch, num_classes]`` logits.

  Attributes:
    hidden: the widths of the hidden layers.
    num_classes: the number of outputs (logits).
  """

  hidden: tuple[int, ...] = (64, 64)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    for width in self.hidden:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)
