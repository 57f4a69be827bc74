"""Flax integration: a Linen ``TrainState`` that forwards extra args, and averaged params for NNX.

Optional: this module imports Flax, ``import optax_dist`` does not. Import it as
``import optax_dist.flax``.

* :class:`TrainState`: ``flax.training.train_state.TrainState`` whose ``apply_gradients``
  forwards extra keyword arguments (``grad_step=``) to ``tx.update``, with
  :meth:`TrainState.eval_params`.
* :func:`nnx_eval_params`: the averaged params of an ``nnx.Optimizer``, as an ``nnx.State``
  for ``nnx.update``.

``flax.nnx.Optimizer`` needs nothing more: ``optimizer.update(model, grads, grad_step=...)``
already forwards its keyword arguments to ``tx.update``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

try:
  from flax import nnx
  from flax.training import train_state
except ImportError as e:  # one line naming the extra, instead of Flax's own traceback
  raise ImportError(
    f'`optax_dist.flax` needs Flax: install it with `pip install "optax-dist[examples]"` ({e}).'
  ) from None

from optax_dist._eval_params import eval_params as _eval_params

# Flax's key for variables updated by their gradient directly, not by ``tx``.
_OVERWRITE_WITH_GRADIENT = train_state.OVERWRITE_WITH_GRADIENT


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` that forwards extra args to ``tx.update``.

  Linen's ``TrainState.apply_gradients(grads=..., **kwargs)`` uses ``kwargs`` only to replace
  fields of the state, so the extra arguments of an ``optax.GradientTransformationExtraArgs``
  (such as ``grad_step=`` of :func:`optax_dist.drop_stale_gradients`) cannot reach ``tx``. Here
  a keyword naming a field of the state (``step``, ``params``, or a field a subclass adds, e.g.
  ``batch_stats``) replaces that field, as in Flax; every other keyword is passed to
  ``tx.update``. :meth:`eval_params` gives the averaged params to evaluate and to save.

  Attributes:
    step: the number of ``apply_gradients`` calls so far.
    apply_fn: usually ``model.apply``.
    params: the parameters updated by ``tx``.
    tx: the optax transformation (any optax or optax_dist one).
    opt_state: the state of ``tx``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> import optax_dist.flax
    >>> tx = optax_dist.drop_stale_gradients(optax.sgd(1.0), max_staleness=0)
    >>> state = optax_dist.flax.TrainState.create(
    ...     apply_fn=None, params={"w": jnp.zeros(1)}, tx=tx)
    >>> state = state.apply_gradients(grads={"w": jnp.ones(1)}, grad_step=0)  # fresh
    >>> state = state.apply_gradients(grads={"w": jnp.ones(1)}, grad_step=0)  # stale: dropped
    >>> state.params["w"], state.step, state.opt_state.num_dropped
    (Array([-1.], dtype=float32), 2, Array(1, dtype=int32))

  References:
    Flax, ``flax.training.train_state.TrainState``.
  """

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Applies one step of ``tx``: ``step += 1``, new ``params`` and ``opt_state``.

    Args:
      grads: gradients with the tree of ``params``.
      **kwargs: keywords naming a field of the state replace it (as in Flax); the others are
        extra args for ``tx.update`` (e.g. ``grad_step=``).

    Returns:
      The updated state.
    """
    fields = {f.name for f in dataclasses.fields(self)}
    replace = {k: v for k, v in kwargs.items() if k in fields}
    extra_args = {k: v for k, v in kwargs.items() if k not in fields}

    overwrite = _OVERWRITE_WITH_GRADIENT in grads
    grads_with_opt = grads["params"] if overwrite else grads
    params_with_opt = self.params["params"] if overwrite else self.params
    updates, opt_state = self.tx.update(
      grads_with_opt, self.opt_state, params_with_opt, **extra_args
    )
    new_params = optax.apply_updates(params_with_opt, updates)
    if overwrite:
      new_params = {"params": new_params, _OVERWRITE_WITH_GRADIENT: grads[_OVERWRITE_WITH_GRADIENT]}
    return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state, **replace)

  def eval_params(self) -> Any:
    """The params to evaluate and to save: :func:`optax_dist.eval_params` of this state.

    Returns:
      A tree like ``params``: the average kept by the outermost averaging transformation in
      ``tx`` (the EMA of :func:`optax_dist.moving_average`, the center of
      :func:`optax_dist.elastic_average` or :func:`optax_dist.agn`), or ``params`` itself.
    """
    if not _is_array(self.params) and _OVERWRITE_WITH_GRADIENT in self.params:
      averaged = _eval_params(self.opt_state, self.params["params"])
      return {**self.params, "params": averaged}
    return _eval_params(self.opt_state, self.params)


def _is_array(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def nnx_eval_params(optimizer: nnx.Optimizer, model: nnx.Module) -> nnx.State:
  """The averaged params of an ``nnx.Optimizer``'s transformation, for ``nnx.update``.

  :func:`optax_dist.eval_params` for Flax NNX: of the params ``optimizer`` trains in ``model``
  (its ``wrt`` filter), the average kept by the outermost averaging transformation, or the
  params themselves when there is none.

  Args:
    optimizer: the ``nnx.Optimizer`` built for ``model``.
    model: the model whose params ``optimizer`` updates.

  Returns:
    A pure ``nnx.State`` (arrays, no ``Variable`` wrappers) with the tree of
    ``nnx.state(model, optimizer.wrt)``. Load it into a copy of the model to evaluate it:
    ``eval_model = nnx.clone(model); nnx.update(eval_model, nnx_eval_params(optimizer, model))``.

  Raises:
    ValueError: ``optimizer`` was built for a model with a different tree of params.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_dist
    >>> from flax import nnx
    >>> import optax_dist.flax
    >>> model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> model.kernel[...] = jnp.ones((1, 1))
    >>> tx = optax_dist.moving_average(optax.sgd(1.0), decay=0.5)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 1))).sum())(model)  # d/dkernel = 1
    >>> _ = optimizer.update(model, grads)
    >>> model.kernel[...], optax_dist.flax.nnx_eval_params(optimizer, model)["kernel"]
    (Array([[0.]], dtype=float32), Array([[0.5]], dtype=float32))

  References:
    TensorFlow 1.x, ``MovingAverageOptimizer.swapping_saver``.
  """
  params = nnx.as_pure(nnx.state(model, optimizer.wrt))
  return _eval_params(nnx.as_pure(optimizer.opt_state), params)
