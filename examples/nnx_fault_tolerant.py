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

from optax_dist import fault_tolerance as ft

SEED, BATCH = 0, 32
STEPS = int(os.environ.get("STEPS", "60"))
X, Y = load_digits(return_X_y=True)
X, Y = jnp.asarray(X / 16.0, jnp.float32), jnp.asarray(Y)
PROTOCOL = ft.RoundProtocol("diloco", optax.adam(1e-2), sync_period=10)
FAULTS = [ft.Fault(2, 1, "die_inner"), ft.Fault(3, 1, "join")]


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


def train(replica):
  model = MLP(nnx.Rngs(SEED))
  tx = PROTOCOL.tx
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  model, optimizer = replica.start((model, optimizer))
  losses = []
  while replica.step < STEPS:
    x, y = batch(replica.slot, replica.step)
    key = ft.step_key(SEED, replica.slot, replica.step)
    loss = train_step(model, optimizer, x, y, key)
    model, optimizer = replica.after_step((model, optimizer), loss=loss)
    losses.append(float(loss))
  return model, losses


if __name__ == "__main__":
  engine = ft.engine(sys.argv[1] if len(sys.argv) > 1 else "in_process", PROTOCOL,
                     num_replicas=3, faults=FAULTS)
  for slot, (model, losses) in sorted(engine.run(train).items()):
    print(f"replica {slot}: loss {losses[0]:.3f} -> {losses[-1]:.3f}", file=sys.stdout)
