"""A Flax Linen TrainState loop on scikit-learn's digits: an MLP with BatchNorm and dropout.

``linen_plain.py`` trains it on one device. ``linen_fault_tolerant.py`` is the same loop made
fault-tolerant: ``python examples/linen_fault_tolerant.py`` trains 3 replicas in one process
(the in-process engine) while replica 1 dies in round 2 and rejoins in round 3; with the
argument ``torchft`` the process is one replica of a run over torchft (``TORCHFT_LIGHTHOUSE``,
``REPLICA_GROUP_ID``, ``OPTAX_DIST_OUT``).
"""

import os
import sys

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state
from sklearn.datasets import load_digits

from optax_dist import fault_tolerance as ft

SEED, BATCH = 0, 32
STEPS = int(os.environ.get("STEPS", "60"))
X, Y = load_digits(return_X_y=True)
X, Y = jnp.asarray(X / 16.0, jnp.float32), jnp.asarray(Y)
PROTOCOL = ft.RoundProtocol("diloco", optax.adam(1e-2), sync_period=10)
FAULTS = [ft.Fault(2, 1, "die_inner"), ft.Fault(3, 1, "join")]


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(64)(x)))
    x = nn.Dropout(0.1, deterministic=not train)(x)
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
  batch_stats: dict


def batch(slot, step):
  """The batch of step ``step`` of data slot ``slot``: a stateless function of them."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(SEED + 1), slot), step)
  index = jax.random.randint(key, (BATCH,), 0, len(X))
  return X[index], Y[index]


@jax.jit(donate_argnums=0)
def train_step(state, x, y, key):
  def loss_fn(params):
    variables = {"params": params, "batch_stats": state.batch_stats}
    logits, new = state.apply_fn(variables, x, train=True, rngs={"dropout": key},
                                 mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

  (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, batch_stats=new["batch_stats"]), loss


def train(replica):
  model = MLP()
  variables = model.init(jax.random.key(SEED), X[:1], train=False)
  tx = PROTOCOL.tx
  state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                            batch_stats=variables["batch_stats"], tx=tx)
  state = replica.start(state)
  losses = []
  while replica.step < STEPS:
    x, y = batch(replica.slot, replica.step)
    key = ft.step_key(SEED, replica.slot, replica.step)
    state, loss = train_step(state, x, y, key)
    state = replica.after_step(state, loss=loss)
    losses.append(float(loss))
  return state, losses


if __name__ == "__main__":
  engine = ft.engine(sys.argv[1] if len(sys.argv) > 1 else "in_process", PROTOCOL,
                     num_replicas=3, faults=FAULTS)
  for slot, (state, losses) in sorted(engine.run(train).items()):
    print(f"replica {slot}: loss {losses[0]:.3f} -> {losses[-1]:.3f}", file=sys.stdout)
