"""A Flax NNX loop on scikit-learn's digits: an MLP with BatchNorm and dropout, trained by an
``nnx.Optimizer``.

``nnx_plain.py`` trains it on one device. ``nnx_fault_tolerant.py`` is the same loop made
fault-tolerant: ``python examples/nnx_fault_tolerant.py`` trains 3 replicas in one process (the
in-process engine) while replica 1 dies in round 2 and rejoins in round 3; with the argument
``torchft`` the process is one replica of a run over torchft (``TORCHFT_LIGHTHOUSE``,
``REPLICA_GROUP_ID``, ``OPTAX_DIST_OUT``).
"""

import os
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from sklearn.datasets import load_digits

SEED, BATCH = 0, 32
STEPS = int(os.environ.get("STEPS", "60"))
X, Y = load_digits(return_X_y=True)
X, Y = jnp.asarray(X / 16.0, jnp.float32), jnp.asarray(Y)


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 64, rngs=rngs)
    self.norm = nnx.BatchNorm(64, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    self.out = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x, key):
    x = self.dropout(nnx.relu(self.norm(self.hidden(x))), rngs=nnx.Rngs(dropout=key))
    return self.out(x)


def batch(slot, step):
  """The batch of step ``step`` of data slot ``slot``: a stateless function of them."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(SEED + 1), slot), step)
  index = jax.random.randint(key, (BATCH,), 0, len(X))
  return X[index], Y[index]


@nnx.jit
def train_step(model, optimizer, x, y, key):
  def loss_fn(model):
    logits = model(x, key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def train():
  model = MLP(nnx.Rngs(SEED))
  tx = optax.adam(1e-2)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  losses = []
  for step in range(STEPS):
    x, y = batch(0, step)
    key = jax.random.fold_in(jax.random.key(SEED), step)
    loss = train_step(model, optimizer, x, y, key)
    losses.append(float(loss))
  return model, losses


if __name__ == "__main__":
  model, losses = train()
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", file=sys.stdout)
