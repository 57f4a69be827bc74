"""Asynchronous parameter-server training of a small MLP on scikit-learn's ``digits``, emulated.

The program behind ``optax-dist async``. It runs four asynchronous protocols with
:mod:`optax_dist.async_emulator` on one timing model of the cluster (the same compute times,
stragglers and restarts for each) and compares them at the same simulated time:

* ``downpour``: asynchronous SGD, every commit applied by the server (``optax.sgd``);
* ``downpour+drop_stale``: the same with ``drop_stale_gradients(optax.sgd, max_staleness)`` as the
  server transformation, which drops the commits staler than ``max_staleness``;
* ``elastic_average``: asynchronous EASGD, every worker exchanging with the center every
  ``communication_period`` local steps (TF's asynchronous order);
* ``agn``: asynchronous AGN, every worker committing its mean accumulated gradient to the center
  every ``communication_period`` local steps.

The data and the model are those of ``optax-dist train`` (:func:`optax_dist._digits.load_data`,
:func:`optax_dist._digits.make_model`). Needs the ``examples`` extra (flax, scikit-learn);
matplotlib only for the figure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

PROTOCOLS = ("downpour", "downpour+drop_stale", "elastic_average", "agn")
"""Every protocol :func:`run_async_digits` runs, in this order."""

DEFAULTS = {
  "workers": 4,
  "max_staleness": 2,
  "stragglers": 1,
  "slowdown": 4.0,
  "jitter": 0.2,
  "latency": 0.0,
  "restarts": (),
  "duration": 400.0,
  "batch_size": 32,
  "learning_rate": 0.1,
  "communication_period": 4,
  "moving_rate": 0.2,
  "eval_every": 50,
  "seed": 0,
}
"""The defaults of :func:`run_async_digits` (and of ``optax-dist async``)."""

COLUMNS = (
  ("protocol", "{}"),
  ("test_accuracy", "{:.3f}"),
  ("commits", "{}"),
  ("dropped_fraction", "{:.3f}"),
  ("mean_staleness", "{:.2f}"),
  ("max_staleness_seen", "{}"),
  ("simulated_time", "{:.1f}"),
  ("events", "{}"),
  ("wall_time_s", "{:.1f}"),
)
"""The columns of :func:`format_table`: each row's key and its format."""


def make_protocol(
  name: str, *, learning_rate: float, communication_period: int, moving_rate: float,
  max_staleness: int,
) -> Any:
  """The :mod:`optax_dist.async_emulator` protocol called ``name`` (one of :data:`PROTOCOLS`)."""
  import optax

  import optax_dist
  from optax_dist import async_emulator as ae

  sgd = optax.sgd(learning_rate)
  if name == "downpour":
    return ae.downpour(sgd)
  if name == "downpour+drop_stale":
    return ae.downpour(optax_dist.drop_stale_gradients(sgd, max_staleness))
  if name == "elastic_average":
    return ae.elastic_average(
      sgd, communication_period=communication_period, moving_rate=moving_rate)
  if name == "agn":
    return ae.agn(sgd, communication_period=communication_period)
  raise ValueError(
    f"`run_async_digits(protocols=...)`: unknown protocol {name!r}; choose from"
    f" {', '.join(PROTOCOLS)}."
  )


def setup(workers: int, seed: int) -> dict[str, Any]:
  """The sharded data, initial params, ``loss_fn`` and ``accuracy_fn`` of the digits MLP.

  Worker ``i`` owns the ``i``-th of ``workers`` equal shards of the training set (the remainder is
  left out). Returns a dict with ``data`` (``x``: ``[workers, M, 64]``, ``y``: ``[workers, M]``),
  ``params``, ``loss_fn(params, batch)`` (mean cross-entropy) and ``accuracy_fn(params)`` (test
  accuracy, jittable).
  """
  import jax
  import jax.numpy as jnp
  import optax

  from optax_dist import _digits

  raw = _digits.load_data(seed)
  model = _digits.make_model()
  m = len(raw["x_train"]) // workers
  data = {
    "x": jnp.asarray(raw["x_train"][: m * workers].reshape(workers, m, -1)),
    "y": jnp.asarray(raw["y_train"][: m * workers].reshape(workers, m)),
  }
  x_test, y_test = jnp.asarray(raw["x_test"]), jnp.asarray(raw["y_test"])
  params = model.init(jax.random.PRNGKey(seed), raw["x_train"][:1])["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  def accuracy_fn(params):
    logits = model.apply({"params": params}, x_test)
    return jnp.mean((jnp.argmax(logits, axis=-1) == y_test).astype(jnp.float32))

  return {"data": data, "params": params, "loss_fn": loss_fn, "accuracy_fn": accuracy_fn}


def run_async_digits(
  *,
  workers: int = DEFAULTS["workers"],
  max_staleness: int = DEFAULTS["max_staleness"],
  stragglers: int = DEFAULTS["stragglers"],
  slowdown: float = DEFAULTS["slowdown"],
  jitter: float = DEFAULTS["jitter"],
  latency: float = DEFAULTS["latency"],
  restarts: Sequence[tuple[int, float]] = DEFAULTS["restarts"],
  duration: float = DEFAULTS["duration"],
  batch_size: int = DEFAULTS["batch_size"],
  learning_rate: float = DEFAULTS["learning_rate"],
  communication_period: int = DEFAULTS["communication_period"],
  moving_rate: float = DEFAULTS["moving_rate"],
  eval_every: int = DEFAULTS["eval_every"],
  seed: int = DEFAULTS["seed"],
  protocols: Sequence[str] = PROTOCOLS,
  out: str | None = "async_digits.png",
) -> list[dict[str, Any]]:
  """Runs each asynchronous protocol on digits for ``duration`` simulated time; one row each.

  Every protocol sees the same cluster: ``workers`` workers whose steps take 1 time unit
  (uniformly jittered by ``±jitter``), the last ``stragglers`` of them ``slowdown`` × slower, plus
  ``latency`` per exchange with the server, and the same ``restarts`` ((worker, time) pairs:
  the worker loses its step in flight and restarts from the server or center). All start from the
  same params; SGD with ``learning_rate`` everywhere (the server's, or each worker's and the
  center's). The test accuracy is measured on the server params (downpour) or the center, every
  ``eval_every`` events and at the end.

  Args:
    workers: the number of workers.
    max_staleness: ``drop_stale_gradients``'s threshold for ``downpour+drop_stale``.
    stragglers: how many workers are slow.
    slowdown: how many times slower a straggler computes (≥ 1).
    jitter: relative half-width of the uniform jitter of every step's compute time, in [0, 1).
    latency: time added to every step that exchanges with the server.
    restarts: ``(worker, time)`` or ``(worker, time, downtime)`` restarts.
    duration: the simulated time each protocol runs for (a step takes about 1).
    batch_size: each worker's minibatch.
    learning_rate: the SGD learning rate.
    communication_period: τ of ``elastic_average`` and ``agn``, in local steps.
    moving_rate: α of ``elastic_average``.
    eval_every: events between test-accuracy measurements.
    seed: the seed of the data split, the init, the compute times and the minibatch order.
    protocols: which of :data:`PROTOCOLS` to run.
    out: the PNG to write (accuracy against simulated time; staleness histogram), or ``None``.

  Returns:
    One dict per protocol with the keys of :data:`COLUMNS` (``test_accuracy`` is the final one;
    ``mean_staleness`` and ``max_staleness_seen`` over commits; for ``elastic_average`` and
    ``agn`` staleness counts other workers' exchanges with the center since the worker's last one),
    plus ``history`` (``time``, ``server_step``, ``test_accuracy`` lists) and ``staleness`` (the
    staleness of every commit).
  """
  import jax

  from optax_dist import async_emulator as ae

  cluster = ae.Cluster(
    num_workers=workers, compute_time=1.0, jitter=jitter, stragglers=stragglers,
    slowdown=slowdown, latency=latency, seed=seed,
  )
  problem = setup(workers, seed)
  rows = []
  for name in protocols:
    start = time.perf_counter()
    protocol = make_protocol(
      name, learning_rate=learning_rate, communication_period=communication_period,
      moving_rate=moving_rate, max_staleness=max_staleness,
    )
    schedule = cluster.schedule(
      duration=duration, communication_period=protocol.communication_period, restarts=restarts)
    result = ae.emulate(
      protocol, problem["loss_fn"], problem["params"], problem["data"], schedule,
      batch_size=batch_size, seed=seed, eval_fn=problem["accuracy_fn"], eval_every=eval_every,
    )
    jax.block_until_ready(result.params)
    staleness = result.commit_staleness
    rows.append({
      "protocol": name,
      "test_accuracy": float(result.eval_metrics[-1]),
      "commits": int(result.committed.sum()),
      "dropped_fraction": result.dropped_fraction,
      "mean_staleness": float(staleness.mean()) if len(staleness) else 0.0,
      "max_staleness_seen": int(staleness.max()) if len(staleness) else 0,
      "simulated_time": float(result.time[-1]),
      "events": schedule.num_events,
      "wall_time_s": time.perf_counter() - start,
      "history": {
        "time": result.eval_time.tolist(),
        "server_step": result.eval_step.tolist(),
        "test_accuracy": np.asarray(result.eval_metrics).tolist(),
      },
      "staleness": staleness.tolist(),
    })
  if out is not None:
    extra = (f", latency {latency:g}" if latency else "") + (
      f", {len(restarts)} restart(s)" if restarts else "")
    plot(rows, out, title=(
      f"digits MLP, {workers} async workers ({stragglers} × {slowdown:g} slower{extra}),"
      f" max_staleness={max_staleness}, τ={communication_period}"))
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  """The rows of :func:`run_async_digits` as an aligned text table."""
  header = [key for key, _ in COLUMNS]
  body = [[fmt.format(row[key]) for key, fmt in COLUMNS] for row in rows]
  widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header] + body]
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
  """Writes a PNG: test accuracy against simulated time, and the staleness of the commits."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (acc, hist) = plt.subplots(1, 2, figsize=(11, 4.2))
  for k, row in enumerate(rows):
    h = row["history"]
    acc.plot(h["time"], h["test_accuracy"], color=f"C{k}", label=row["protocol"])
  acc.set_xlabel("simulated time (one step ≈ 1)")
  acc.set_ylabel("test accuracy (server / center params)")
  acc.set_ylim(0.0, 1.0)
  acc.grid(True, alpha=0.3)
  acc.legend(loc="lower right")
  top = max([max(r["staleness"], default=0) for r in rows], default=0)
  bins = np.arange(top + 2) - 0.5
  styles = ["-", "--", ":", "-."]
  for k, row in enumerate(rows):  # elastic_average and agn share a schedule: same histogram
    if row["staleness"]:
      hist.hist(row["staleness"], bins=bins, histtype="step", linewidth=1.5,
                linestyle=styles[k % len(styles)], color=f"C{k}", label=row["protocol"])
  names = {row["protocol"] for row in rows}
  if {"elastic_average", "agn"} <= names:
    hist.set_title("elastic_average and agn exchange on the same schedule: one histogram",
                   fontsize=9)
  hist.set_xlabel("staleness of a commit (server steps since the worker's read)")
  hist.set_ylabel("commits")
  hist.set_yscale("log")
  hist.grid(True, alpha=0.3)
  hist.legend(loc="upper right")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
