"""A run: its mesh, its data on the devices, its initial state and its compiled functions.

:class:`Run` compiles one ``jax.shard_map`` step over the workers, every worker (device) holding
whole params, its optimizer state and its shard of the training set, the params and state
donated; :class:`GlobalRun` the global view's ``jax.jit`` step of ``jax.vmap`` over the replicas
(``fsdp``). Each is compiled once, ahead of time (one step per value of the algorithm's
``communicate`` hint; for ``diloco`` on the per-worker step, the step without the exchange and a
small exchange program its sync steps run after it, :attr:`Run.synchronize`: the model is
compiled once). The test metric is measured on the params :func:`optax_dist.eval_params`
returns (the center, the EMA, or the params) and on the workers' own params.

``drop_stale_gradients`` is fed stale gradients: on each step all workers compute their gradients
at the params of a random number of accepted steps ago (0 to ``max_staleness + 1``, the same for
every worker, :func:`optax_dist.cli.pipeline.delays`); those staler than ``max_staleness`` are
dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist
from optax_dist.cli import pipeline
from optax_dist.cli.algorithms import (ALGORITHMS, DATA, FSDP, REPLICA, axes, exchange_axes,
                                      make_optimizer)
from optax_dist.cli.config import Settings
from optax_dist.cli.meshes import fsdp_spec, global_mesh, to_host, worker_mesh
from optax_dist.cli.progress import QUIET, Progress
from optax_dist.cli.steps import (State, evaluate_fn, global_step_fn, replica_evaluate_fn, stack,
                                  step_fn, unstack)
from optax_dist.cli.tasks import Data, Task


def record_keys(task: Task) -> tuple[str, ...]:
  """The lists of a run's ``history``, one entry per evaluation (see :func:`metric_keys`)."""
  return ("step", "communication_rounds", *metric_keys(task), "train_loss")


def metric_keys(task: Task) -> tuple[str, str]:
  """The results' keys of ``task``'s test metric of ``eval_params`` and of the workers' params,
  e.g. ``test_accuracy_eval_params`` and ``test_accuracy_workers``."""
  return f"test_{task.metric_key}_eval_params", f"test_{task.metric_key}_workers"


@functools.lru_cache(maxsize=4)
def initial_params(task: Task, seed: int, example: tuple[tuple[str, tuple, str], ...]) -> Any:
  """``task``'s initial params for ``seed`` as NumPy arrays, computed once per process.

  ``example``: ``(key, shape, dtype)`` of each leaf of one example batch.
  """
  model = task.model()
  batch = {key: jnp.zeros(shape, dtype) for key, shape, dtype in example}
  init = jax.jit(lambda key: task.init_params(model, key, batch))
  # The RBG generator compiles faster on CPU than the default threefry.
  return jax.device_get(init(jax.random.key(seed, impl="rbg")))


class Run:
  """One run's mesh, data on the devices and compiled functions (each compiled once): one
  ``jax.shard_map`` step, every worker (device) holding whole params.

  ``settings`` must be resolved and have passed :func:`optax_dist.cli.checks.check_settings`.
  ``progress`` shows the phases of building it: the model, the compilation of the steps and of
  the evaluation.
  """

  state_per_worker = True
  """Whether the state's leading axis is the workers' (else the replicas': :class:`GlobalRun`)."""

  @property
  def loss_axis(self) -> str | None:
    """The axis the step averages the loss over: with replicas, :data:`DATA` (one loss per
    replica, no collective across the replicas on the steps that exchange nothing: the replicas
    are not held in step by the logging; they are averaged when recorded); else ``None``, every
    worker."""
    return DATA if self.settings.replicas > 1 else None

  def __init__(self, task: Task, data: Data, settings: Settings, *,
               progress: Progress = QUIET):
    s = self.settings = settings
    self.algorithm = ALGORITHMS[s.algorithm]
    self.stale = self.algorithm.stale_gradients
    self.depth = max(s.max_staleness, 0) + 2  # the params of the last `depth` accepted steps
    self.mesh, spec = self._layout()
    self.split, self.replicated = NamedSharding(self.mesh, spec), NamedSharding(self.mesh, P())
    shards = pipeline.shard_examples(data.train, s.devices)
    self.n_local = len(next(iter(shards.values()))[0])
    self.train = self.shard(shards)
    self.test = jax.tree.map(lambda x: pipeline.put(x, self.replicated), data.test)
    self.delays = pipeline.delays(s.seed, s.steps, self.depth)
    self.keys = metric_keys(task)
    example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in data.train.items())
    with progress.phase("building the model"):
      model = task.model()
      params = self.place(jax.tree.map(lambda p: p.astype(jnp.dtype(s.param_dtype)),
                                       initial_params(task, s.seed, example)))
    self.tx = make_optimizer(s)
    synchronize = self.algorithm.synchronize if self.state_per_worker else None
    self.synchronize = synchronize and synchronize(s, *exchange_axes(s))
    """The sync apart from the step (:attr:`Algorithm.synchronize`), or ``None``."""
    steps = {1: "step", 2: "steps with and without the exchange"}[len(self.hints())]
    steps += " and the exchange" if self.synchronize else ""
    with progress.phase(f"compiling the {steps}"):
      self._compile(params, task.loss_fn(model))
    with progress.phase("compiling the evaluation"):
      self._evaluate = self._evaluation(task.metric_fn(model), data.test).lower(
        self.initial.params, self.initial.opt_state, self.test).compile()
    self.bytes_per_device = {
      "params": bytes_per_device(self.initial.params),
      "opt_state": bytes_per_device(self.initial.opt_state),
      "step_arguments": next(iter(self._steps.values())).memory_analysis().argument_size_in_bytes}
    """What one device holds: its shards of the params and of the optimizer state, and the
    compiled step's arguments (those and the device's shard of the training set, its minibatch
    indices), in bytes."""

  def _evaluation(self, metric_fn: Callable, test: Any) -> Callable:
    """The jitted evaluation of ``metric_fn`` (:func:`evaluate_fn`). With replicas the devices of
    a replica hold the same params and state (every algorithm has a ``tower`` within each
    replica), so each device scores its own worker on its 1/K of the ``test`` set where the
    examples divide evenly among the replica's K devices (:func:`replica_evaluate_fn`): the
    test set goes through the model R times for each of the two metrics, not R * K, and only
    the two means cross the replicas. On the global view the state is already one per
    replica."""
    s = self.settings
    if s.replicas == 1 or not self.state_per_worker:
      return jax.jit(evaluate_fn(metric_fn))
    split = all(len(x) % (s.devices // s.replicas) == 0 for x in jax.tree.leaves(test))
    return jax.jit(jax.shard_map(
      replica_evaluate_fn(metric_fn), mesh=self.mesh,
      in_specs=(self.split.spec, self.split.spec, P(DATA) if split else P()), out_specs=P()))

  def _layout(self) -> tuple[jax.sharding.Mesh, P]:
    """The mesh, and the spec of the workers' data (their shards of the training set, their
    minibatch indices): split over the workers along the first axis."""
    return worker_mesh(self.settings), P(axes(self.settings))

  def shard(self, tree: Any) -> Any:
    """``tree``'s host arrays as global arrays split over the workers along their first axis."""
    return jax.tree.map(lambda x: pipeline.put(x, self.split), tree)

  def place(self, params: Any) -> Any:
    """One worker's host ``params`` as the global params of every worker (``[workers, ...]``)."""
    devices = self.settings.devices
    return self.shard(jax.tree.map(lambda p: np.broadcast_to(p, (devices,) + p.shape), params))

  def _compile(self, params, loss_fn) -> None:
    s = self.settings
    split = self.split.spec
    init = jax.shard_map(self._init_fn, mesh=self.mesh, in_specs=split, out_specs=split)
    self.initial = State(params, *jax.jit(init)(params))
    idx = self.shard(np.zeros((s.devices, s.batch_size), np.int32))
    delay = pipeline.put(self.delays[0], self.replicated)
    # One step for each value of the hint: with a schedule, a step that communicates and one
    # that does not (no conditional, no collective). Compiled ahead of time: a call with other
    # types would raise instead of recompiling.
    self._steps, self.collectives = {}, {}
    for hint in self.hints():
      step = jax.shard_map(
        step_fn(self.tx, loss_fn, stale=self.stale, depth=self.depth, communicate=hint,
                axis=axes(s), loss_axis=self.loss_axis),
        mesh=self.mesh, in_specs=(split,) * 5 + (P(),),
        out_specs=(split,) * 3 + (P() if self.loss_axis is None else P(REPLICA),))
      self._add_step(hint, jax.jit(step, donate_argnums=(0, 1, 2)).lower(
        *self.initial, self.train, idx, delay).compile())
    if self.synchronize:
      self._compile_sync()

  def _compile_sync(self) -> None:
    """The exchange program of the sync steps (:meth:`step`): every worker's sync on its params
    after the step compiled with ``communicate=False``, landing it on the new anchor from its
    params before that step as the transformation's sync step lands it, ``params + (anchor -
    params)`` in the dtypes of its updates."""
    split = self.split.spec
    updates = jax.eval_shape(jax.shard_map(
      lambda p, o: stack(self.tx.update(unstack(p), unstack(o), unstack(p),
                                        communicate=False)[0]),
      mesh=self.mesh, in_specs=split, out_specs=split), self.initial.params,
      self.initial.opt_state)
    dtypes = jax.tree.map(lambda u: u.dtype, updates)

    def sync(origin, params, opt_state):
      origin, params, opt_state = unstack((origin, params, opt_state))
      anchor, outer_state, residual = self.synchronize(
        opt_state.anchor, opt_state.outer_state, params, opt_state.error_feedback)
      landed = jax.tree.map(lambda p, a, d: optax.apply_updates(p, (a - p).astype(d)),
                            origin, anchor, dtypes)
      return stack((landed, opt_state._replace(
        anchor=anchor, outer_state=outer_state, error_feedback=residual)))

    program = jax.jit(jax.shard_map(sync, mesh=self.mesh, in_specs=split, out_specs=split),
                      donate_argnums=(0, 1, 2))
    self._sync = program.lower(
      self.initial.params, self.initial.params, self.initial.opt_state).compile()
    # The step donates the params: a sync step first keeps a copy of them, the origin.
    self._copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=self.split
                         ).lower(self.initial.params).compile()
    self.collectives[STEP_KINDS[True]] = combined_bytes(
      self.collectives[STEP_KINDS[False]], collective_bytes(self._sync, self.mesh))

  def hints(self) -> tuple[bool | None, ...]:
    """The ``communicate`` hints of the compiled steps: ``(None,)``, or with a schedule
    ``(False, True)`` (``(False,)`` with :attr:`synchronize`: a sync step is the step without
    the exchange, then the exchange program)."""
    if self.algorithm.schedule is None:
      return (None,)
    return (False,) if self.synchronize else (False, True)

  def _add_step(self, hint: bool | None, compiled: Any) -> None:
    self._steps[hint] = compiled
    self.collectives[STEP_KINDS[hint]] = collective_bytes(compiled, self.mesh)

  def _init_fn(self, params):
    params = unstack(params)
    history = {}
    if self.stale:
      history = jax.tree.map(lambda p: jnp.broadcast_to(p, (self.depth,) + p.shape), params)
    return stack(self.tx.init(params)), stack(history)

  def step(self, state: State, step: int) -> tuple[State, Any]:
    """``state`` after training step ``step`` (from 1), and the workers' mean minibatch loss."""
    s = self.settings
    idx = self.shard(pipeline.minibatch(s.seed, s.devices, self.n_local, s.batch_size, step - 1))
    delay = pipeline.put(self.delays[step - 1], self.replicated)
    hint = self.algorithm.communicates(s, step)
    if hint and self.synchronize:
      origin = self._copy(state.params)
      params, opt_state, history, loss = self._steps[False](*state, self.train, idx, delay)
      return State(*self._sync(origin, params, opt_state), history), loss
    *state, loss = self._steps[hint](*state, self.train, idx, delay)
    return State(*state), loss

  def settle(self, state: State) -> State:
    """``state`` with every exchange still in flight outside the step landed in it (only
    :class:`optax_dist.cli.exchange_device.ExchangeDeviceRun` has such
    exchanges): what a checkpoint saves."""
    return state

  def measure(self, state: State, record: dict[str, list], step: int, loss: Any) -> None:
    """Appends the test metric of ``state`` at ``step`` to ``record``."""
    s = self.settings
    metric_eval, metric_workers = self._evaluate(state.params, state.opt_state, self.test)
    record["step"].append(step)
    record["communication_rounds"].append(self.algorithm.communication_rounds(s, step))
    record[self.keys[0]].append(float(metric_eval))
    record[self.keys[1]].append(float(metric_workers))
    if loss is not None:  # one per replica with a loss axis, gathered from every process
      loss = float(np.mean(to_host(loss))) if self.loss_axis else float(loss)
    record["train_loss"].append(loss)


class GlobalRun(Run):
  """A run on the global view (``settings.fsdp`` K): one ``jax.jit`` step of ``jax.vmap`` over
  the R replicas (:func:`global_step_fn`), on a ``(R, D, K)`` mesh over ``(REPLICA, DATA,
  FSDP)``.

  The params and the optimizer state are stacked over the replicas, sharded ``P(REPLICA, ...)``;
  inside each replica every param is sharded over the K devices of :data:`FSDP` on its largest
  dimension divisible by K (whole on each if none, see :func:`fsdp_spec`), and every state leaf
  shaped like one (:func:`optax_dist.state_shardings`) likewise, or, with D > 1 data groups, over
  all D K devices of the replica (``(FSDP, DATA)``) where a dimension divides: each device then
  holds 1/(D K) of the state and sends that 1/(D K) of a DiLoCo exchange across the replicas
  (each byte crosses once per replica, not once per data group). Worker
  (device) ``i`` holds the ``i``-th shard of the training set and draws the minibatches of
  :class:`Run`'s worker ``i``, so both train on the same examples. The compiler inserts FSDP's
  all-gathers and reduce-scatters, and the gradients' reduction inside each replica.
  """

  state_per_worker = False
  loss_axis = None  # the step returns the replicas' mean loss

  def _layout(self) -> tuple[jax.sharding.Mesh, P]:
    return global_mesh(self.settings), P(REPLICA, (DATA, FSDP))

  def shard(self, tree: Any) -> Any:
    """``tree``'s host arrays ``[workers, ...]`` as global arrays ``[R, W, ...]``, worker ``i`` on
    device ``i`` of the mesh (replica ``i // W``)."""
    r = self.settings.replicas
    return jax.tree.map(
      lambda x: pipeline.put(np.reshape(x, (r, -1) + np.shape(x)[1:]), self.split), tree)

  def place(self, params: Any) -> Any:
    """One replica's host ``params`` as the stacked params ``[R, ...]``, sharded by
    :meth:`shardings`."""
    r = self.settings.replicas
    return jax.tree.map(lambda p, sh: pipeline.put(np.broadcast_to(p, (r,) + p.shape), sh),
                        params, self.shardings(params, stacked=True))

  def shardings(self, params: Any, *, stacked: bool, state: bool = False) -> Any:
    """The ``NamedSharding`` of each of one replica's ``params`` (:func:`fsdp_spec`), with
    ``stacked`` for the params stacked over the replicas (:data:`REPLICA` first); with ``state``,
    the layout of the optimizer state's param-shaped leaves, split over the replica's data groups
    too."""
    lead, groups = (REPLICA,) if stacked else (), self.mesh.shape[DATA] if state else 1
    return jax.tree.map(lambda p: NamedSharding(
      self.mesh, P(*lead, *fsdp_spec(np.shape(p), self.settings.fsdp, groups))), params)

  def _compile(self, params, loss_fn) -> None:
    s = self.settings
    one = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], p.dtype), params)
    state_sh = optax_dist.state_shardings(
      self.tx, one, self.shardings(one, stacked=False, state=True), replica_axis=REPLICA)
    opt_state = jax.jit(jax.vmap(self.tx.init), out_shardings=state_sh)(params)
    self.initial = State(params, opt_state, {})
    idx = self.shard(np.zeros((s.devices, s.batch_size), np.int32))
    batch = NamedSharding(self.mesh, P((DATA, FSDP)))
    outs = (jax.tree.map(lambda p: p.sharding, params), state_sh, self.replicated)
    self._steps, self.collectives = {}, {}
    for hint in self.hints():
      step = jax.jit(global_step_fn(self.tx, loss_fn, batch, communicate=hint),
                     out_shardings=outs, donate_argnums=(0, 1))
      self._add_step(hint, step.lower(params, opt_state, self.train, idx).compile())

  def step(self, state: State, step: int) -> tuple[State, Any]:
    s = self.settings
    idx = self.shard(pipeline.minibatch(s.seed, s.devices, self.n_local, s.batch_size, step - 1))
    hint = self.algorithm.communicates(s, step)
    params, opt_state, loss = self._steps[hint](state.params, state.opt_state, self.train, idx)
    return State(params, opt_state, {}), loss


def bytes_per_device(tree: Any) -> int:
  """The bytes of one device's shards of ``tree``'s arrays (every shard of an array has one
  size: the params are split only on dimensions the devices divide)."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def collective_bytes(compiled: Any, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """The bytes a device sends into the collectives of ``compiled``, by the mesh axes they span
  (``{"data": ..., "replica": ...}``): ``unconditional`` (every execution) and, for each
  ``conditional`` holding collectives, its costliest branch (``conditional``, a list); and
  ``operands``, the same for the number of arrays they carry (XLA combines a tree's leaves into
  one collective of many operands; gloo sends each operand apart, with its own headers)."""
  report = optax_dist.CommunicationReport.from_hlo_text(compiled.as_text())

  def by_axes(collectives):
    return {",".join(a): b for a, (_, b) in collectives.by_axes(mesh).items()}

  def operands(collectives):
    return {",".join(a): sum(len(c.shapes) for c in collectives.over(mesh, a).items)
            for a in collectives.by_axes(mesh)}

  return {"unconditional": by_axes(report.unconditional),
          "conditional": [by_axes(c) for c in report.per_conditional.values()],
          "operands": {"unconditional": operands(report.unconditional),
                       "conditional": [operands(c) for c in report.per_conditional.values()]}}


def combined_bytes(*reports: dict[str, Any]) -> dict[str, Any]:
  """The :func:`collective_bytes` of programs run one after the other, as one step's."""

  def added(parts):
    total = {}
    for part in parts:
      for axes, n in part.items():
        total[axes] = total.get(axes, 0) + n
    return total

  return {"unconditional": added(r["unconditional"] for r in reports),
          "conditional": [c for r in reports for c in r["conditional"]],
          "operands": {"unconditional": added(r["operands"]["unconditional"] for r in reports),
                       "conditional": [c for r in reports for c in r["operands"]["conditional"]]}}


STEP_KINDS = {None: "every_step", True: "communication_step", False: "non_communication_step"}
"""The results' names of the compiled steps, by their ``communicate`` hint."""
