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


class Block(nn.Module):
  """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP, each residual.

  Shapes:
    ``[batch, time, width]`` to the same, with ``mask`` ``[batch, 1, time, time]``.

  Attributes:
    num_heads: attention heads (``width`` must be divisible by it).
    mlp_ratio: the MLP's hidden width, in multiples of ``width``.
  """

  num_heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x, mask):
    width = x.shape[-1]
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(nn.LayerNorm()(x), mask=mask)
    hidden = nn.gelu(nn.Dense(self.mlp_ratio * width)(nn.LayerNorm()(x)))
    return x + nn.Dense(width)(hidden)


class Transformer(nn.Module):
  """A decoder-only byte-level transformer: embeddings, ``depth`` :class:`Block`, a linear head.

  Learned token and position embeddings, causal self-attention, pre-LayerNorm blocks and a final
  LayerNorm; about 0.28M params with the defaults. The computation follows the params' dtype
  (bfloat16 params compute in bfloat16).

  Shapes:
    ``[batch, time]`` integer bytes (``time <= context``) to ``[batch, time, vocab_size]`` logits
    of the next byte at each position.

  Attributes:
    vocab_size: 256, one token per byte value.
    context: the longest input, in bytes.
    width: the model width.
    depth: the number of blocks.
    num_heads: attention heads per block.
  """

  vocab_size: int = 256
  context: int = 64
  width: int = 96
  depth: int = 2
  num_heads: int = 4

  @nn.compact
  def __call__(self, tokens):
    time = tokens.shape[-1]
    x = nn.Embed(self.vocab_size, self.width)(tokens.astype("int32"))
    position = self.param("position", nn.initializers.normal(0.02), (self.context, self.width))
    x = x + position[:time].astype(x.dtype)
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.depth):
      x = Block(self.num_heads)(x, mask)
    return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))
