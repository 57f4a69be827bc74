"""Data-parallel training of any task with any algorithm, over a mesh of workers.

Every worker is one device of a 1-D mesh with axis ``"workers"`` (with ``replicas`` R > 1, of a
``(R, devices / R)`` mesh with axes ``("replica", "data")``: worker ``i`` is in replica
``i // (devices / R)``); its params, optimizer state and shard of the training set live on that
device, and one jitted ``jax.shard_map`` step, with the
params and the optimizer state donated, trains all of them. The test metric is measured on the
params :func:`optax_dist.eval_params` returns (the center, the EMA, or the params) and on the
workers' own params.

``drop_stale_gradients`` is fed stale gradients: on each step all workers compute their gradients
at the params of a random number of accepted steps ago (0 to ``max_staleness + 1``, the same for
every worker, :func:`optax_dist.cli.pipeline.delays`); those staler than ``max_staleness`` are
dropped.

The mesh may span several ``jax.distributed`` processes (:mod:`optax_dist.cli.launcher`): every
process builds the same global arrays from the same host data, holding the shards of its own
devices, and runs the same step. The caller must have made enough devices available
(``jax.config.update("jax_num_cpu_devices", N)``) before JAX initialised.

With ``exchange_device`` (``streaming_diloco``, ``overlap`` τ ≥ 1, one replica per process) the
exchanges across the replicas leave the step: each runs on one extra CPU device per process
while the next steps compute, and its mean goes back into the state before the step that lands
it (:class:`ExchangeDeviceRun`: XLA CPU runs a process's multi-device computations one at a
time, so only a computation on another device can run beside the steps).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist
from optax_dist import _axis, _checks
from optax_dist._streaming_diloco import assign_fragments
from optax_dist.cli import pipeline
from optax_dist.cli.algorithms import (ALGORITHMS, AXIS, DATA, FSDP, REPLICA, axes,
                                       make_optimizer)
from optax_dist.cli.checkpoints import Checkpoints
from optax_dist.cli.config import Settings
from optax_dist.cli.tasks import Data, Task


def record_keys(task: Task) -> tuple[str, ...]:
  """The lists of a run's ``history``, one entry per evaluation (see :func:`metric_keys`)."""
  return ("step", "communication_rounds", *metric_keys(task), "train_loss")


def metric_keys(task: Task) -> tuple[str, str]:
  """The results' keys of ``task``'s test metric of ``eval_params`` and of the workers' params,
  e.g. ``test_accuracy_eval_params`` and ``test_accuracy_workers``."""
  return f"test_{task.metric_key}_eval_params", f"test_{task.metric_key}_workers"


class State(NamedTuple):
  """The training state, every leaf with a leading worker axis (sharded over the workers).

  Attributes:
    params: each worker's params.
    opt_state: each worker's optimizer state.
    history: ``drop_stale_gradients`` only: each worker's params of the last ``depth`` accepted
      steps (``[workers, depth, ...]``), where stale gradients are computed; ``{}`` otherwise.
  """

  params: Any
  opt_state: Any
  history: Any


def _unstack(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _stack(tree):
  return jax.tree.map(lambda x: x[None], tree)


def to_host(tree: Any) -> Any:
  """``tree``'s global arrays as NumPy arrays on every process (an all-gather across processes)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


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


def step_fn(tx: Any, loss_fn: Callable, *, stale: bool, depth: int,
            communicate: bool | None = None, axis: Any = AXIS,
            loss_axis: Any = None) -> Callable:
  """One training step of one worker, to run under ``shard_map`` over the mesh axes ``axis``.

  ``step(params, opt_state, history, train, idx, delay)``: ``train`` is the worker's shard, ``idx``
  its minibatch's indices, ``delay`` (``drop_stale_gradients`` only) how many accepted steps old
  the params the gradients are computed at are. Returns the new state and the workers' mean loss.
  ``communicate`` (if not ``None``) is passed to ``tx.update`` as its static hint. With
  ``loss_axis`` the loss is the mean over that axis only, shaped ``[1]`` (one per replica for
  :data:`DATA`: no collective across the replicas).
  """
  hint = {} if communicate is None else {"communicate": communicate}

  def step(params, opt_state, history, train, idx, delay):
    params, opt_state, history = _unstack((params, opt_state, history))
    batch = jax.tree.map(lambda shard: shard[0][idx[0]], train)
    read, extra = params, dict(hint)
    if stale:  # every worker reads the params of `delay` accepted steps ago
      grad_step = jnp.maximum(opt_state.global_step - delay, 0)
      read = jax.tree.map(lambda h: h[grad_step % depth], history)
      extra = {"grad_step": grad_step}
    loss, grads = jax.value_and_grad(loss_fn)(read, batch)
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    params = optax.apply_updates(params, updates)
    if stale:
      slot = opt_state.global_step % depth
      history = jax.tree.map(lambda h, p: h.at[slot].set(p), history, params)
    if loss_axis is not None:
      return (*_stack((params, opt_state, history)), jax.lax.pmean(loss, loss_axis)[None])
    return (*_stack((params, opt_state, history)), jax.lax.pmean(loss, axis))

  return step


def evaluate_fn(metric_fn: Callable) -> Callable:
  """``evaluate(params, opt_state, test)``: the mean metric of ``eval_params`` and of the params."""

  def evaluate(params, opt_state, test):
    score = jax.vmap(lambda p: metric_fn(p, test))
    averaged = optax_dist.eval_params(opt_state, params)
    return jnp.mean(score(averaged)), jnp.mean(score(params))

  return evaluate


def replica_evaluate_fn(metric_fn: Callable) -> Callable:
  """``evaluate(params, opt_state, test)`` of one device under ``jax.shard_map`` over
  ``(REPLICA, DATA)``, for replicas whose devices hold the same params and state: the metric of
  its worker's ``eval_params`` and params on its ``test`` examples (its 1/K of the test set, or
  all of it), averaged over every device. ``metric_fn`` must be a mean over equally many values
  per example, so that the mean over equal slices is the whole test set's."""

  def evaluate(params, opt_state, test):
    params, opt_state = _unstack(params), _unstack(opt_state)
    averaged = optax_dist.eval_params(opt_state, params)
    scores = jnp.stack([metric_fn(averaged, test), metric_fn(params, test)])
    return tuple(jax.lax.pmean(scores, (REPLICA, DATA)))

  return evaluate


class Run:
  """One run's mesh, data on the devices and compiled functions (each compiled once): one
  ``jax.shard_map`` step, every worker (device) holding whole params."""

  state_per_worker = True
  """Whether the state's leading axis is the workers' (else the replicas': :class:`GlobalRun`)."""

  @property
  def loss_axis(self) -> str | None:
    """The axis the step averages the loss over: with replicas, :data:`DATA` (one loss per
    replica, no collective across the replicas on the steps that exchange nothing: the replicas
    are not held in step by the logging; they are averaged when recorded); else ``None``, every
    worker."""
    return DATA if self.settings.replicas > 1 else None

  def __init__(self, task: Task, data: Data, settings: Settings):
    s = self.settings = settings
    self.algorithm = ALGORITHMS[s.algorithm]
    self.stale = self.algorithm.stale_gradients
    self.depth = max(s.max_staleness, 0) + 2  # the params of the last `depth` accepted steps
    self.mesh, spec = self._layout()
    self.split, self.replicated = NamedSharding(self.mesh, spec), NamedSharding(self.mesh, P())
    shards = pipeline.shard_examples(data.train, s.devices)
    self.n_local = len(next(iter(shards.values()))[0])
    _check_batch_size(s, len(next(iter(data.train.values()))), self.n_local)
    self.train = self.shard(shards)
    self.test = jax.tree.map(lambda x: pipeline.put(x, self.replicated), data.test)
    self.delays = pipeline.delays(s.seed, s.steps, self.depth)
    self.keys = metric_keys(task)
    example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in data.train.items())
    params = jax.tree.map(lambda p: p.astype(jnp.dtype(s.param_dtype)),
                          initial_params(task, s.seed, example))
    self.tx = make_optimizer(s, params)
    model = task.model()
    self._compile(self.place(params), task.loss_fn(model))
    self._evaluate = self._evaluation(task.metric_fn(model), data.test).lower(
      self.initial.params, self.initial.opt_state, self.test).compile()
    self.bytes_per_device = {
      "params": _bytes_per_device(self.initial.params),
      "opt_state": _bytes_per_device(self.initial.opt_state),
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
    return _mesh(self.settings), P(axes(self.settings))

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

  def hints(self) -> tuple[bool | None, ...]:
    """The ``communicate`` hints of the compiled steps: ``(None,)``, or with a schedule
    ``(False, True)``."""
    return (None,) if self.algorithm.schedule is None else (False, True)

  def _add_step(self, hint: bool | None, compiled: Any) -> None:
    self._steps[hint] = compiled
    self.collectives[_STEP_KINDS[hint]] = _collective_bytes(compiled, self.mesh)

  def _init_fn(self, params):
    params = _unstack(params)
    history = {}
    if self.stale:
      history = jax.tree.map(lambda p: jnp.broadcast_to(p, (self.depth,) + p.shape), params)
    return _stack(self.tx.init(params)), _stack(history)

  def step(self, state: State, step: int) -> tuple[State, Any]:
    """``state`` after training step ``step`` (from 1), and the workers' mean minibatch loss."""
    s = self.settings
    idx = self.shard(pipeline.minibatch(s.seed, s.devices, self.n_local, s.batch_size, step - 1))
    delay = pipeline.put(self.delays[step - 1], self.replicated)
    hint = self.algorithm.communicates(s, step)
    *state, loss = self._steps[hint](*state, self.train, idx, delay)
    return State(*state), loss

  def settle(self, state: State) -> State:
    """``state`` with every exchange still in flight outside the step landed in it (only
    :class:`ExchangeDeviceRun` has such exchanges): what a checkpoint saves."""
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


def global_step_fn(tx: Any, loss_fn: Callable, batch: NamedSharding, *,
                   communicate: bool | None = None) -> Callable:
  """The training step of every replica at once, on the global view (``jax.vmap`` of one
  replica's step over :data:`REPLICA`, ``spmd_axis_name=REPLICA``), to run under ``jax.jit``.

  ``step(params, opt_state, train, idx)``: ``params`` and ``opt_state`` stacked over the R
  replicas (``[R, ...]``); ``train`` ``[R, W, M, ...]``, the shards of the W workers (devices) of
  each replica; ``idx`` ``[R, W, B]``, each worker's minibatch indices into its shard. A
  replica's loss is the mean over its ``W * B`` examples (the mean of its workers' minibatch
  losses), its batch constrained to ``batch`` (one replica's sharding of the example axis); the
  compiler reduces the gradients inside each replica, ``tx`` exchanges across the replicas.
  Returns the new params and state, and the replicas' mean loss. ``communicate`` (if not
  ``None``) is passed to ``tx.update`` as its static hint.
  """
  hint = {} if communicate is None else {"communicate": communicate}

  def replica_step(params, opt_state, train, idx):
    examples = jax.tree.map(lambda x: jax.vmap(lambda shard, i: shard[i])(x, idx), train)
    examples = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), examples)
    loss, grads = jax.value_and_grad(loss_fn)(
      params, jax.lax.with_sharding_constraint(examples, batch))
    updates, opt_state = tx.update(grads, opt_state, params, **hint)
    return optax.apply_updates(params, updates), opt_state, loss

  mapped = jax.vmap(replica_step, axis_name=REPLICA, spmd_axis_name=REPLICA)

  def step(params, opt_state, train, idx):
    params, opt_state, loss = mapped(params, opt_state, train, idx)
    return params, opt_state, jnp.mean(loss)

  return step


class GlobalRun(Run):
  """A run on the global view (``settings.fsdp`` K): one ``jax.jit`` step of ``jax.vmap`` over
  the R replicas (:func:`global_step_fn`), on a ``(R, D, K)`` mesh over ``(REPLICA, DATA,
  FSDP)``.

  The params and the optimizer state are stacked over the replicas, sharded ``P(REPLICA, ...)``;
  inside each replica every param, and every state leaf shaped like one
  (:func:`optax_dist.state_shardings`), is sharded over the K devices of :data:`FSDP` on its
  largest dimension divisible by K (whole on each if none, see :func:`fsdp_spec`). Worker
  (device) ``i`` holds the ``i``-th shard of the training set and draws the minibatches of
  :class:`Run`'s worker ``i``, so both train on the same examples. The compiler inserts FSDP's
  all-gathers and reduce-scatters, and the gradients' reduction inside each replica.
  """

  state_per_worker = False
  loss_axis = None  # the step returns the replicas' mean loss

  def _layout(self) -> tuple[jax.sharding.Mesh, P]:
    return _global_mesh(self.settings), P(REPLICA, (DATA, FSDP))

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

  def shardings(self, params: Any, *, stacked: bool) -> Any:
    """The ``NamedSharding`` of each of one replica's ``params`` (:func:`fsdp_spec`), with
    ``stacked`` for the params stacked over the replicas (:data:`REPLICA` first)."""
    lead = (REPLICA,) if stacked else ()
    return jax.tree.map(
      lambda p: NamedSharding(self.mesh, P(*lead, *fsdp_spec(np.shape(p), self.settings.fsdp))),
      params)

  def _compile(self, params, loss_fn) -> None:
    s = self.settings
    one = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], p.dtype), params)
    state_sh = optax_dist.state_shardings(self.tx, one, self.shardings(one, stacked=False),
                                          replica_axis=REPLICA)
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


class ExchangeDeviceRun(Run):
  r"""A run of ``streaming_diloco`` with ``overlap`` τ ≥ 1 and one replica per process whose
  exchanges across the replicas run on an exchange device (``settings.exchange_device``).

  Why: XLA's CPU client runs the computations that span several devices of a process one after
  another, so an exchange dispatched as its own computation over the training devices would wait
  for the steps, and the steps for it (``benchmarks/probe_overlap.py``); a computation on one
  extra device of each process runs beside them. (A GPU would run it on a separate stream.)

  The step is :class:`Run`'s with ``streaming_diloco`` built over no axis across the replicas
  (:func:`optax_dist.cli.algorithms.make_optimizer`) and the loss averaged within each replica:
  it issues no collective across the processes. After the send step s of fragment f (the
  library's rule, :func:`optax_dist.streaming_diloco_syncs`), the fragment's leaves of
  ``opt_state.in_flight`` hold the replica's own pseudo-gradient :math:`\Delta^f_r`. Their copy
  on one training device goes to the exchange device (``jax.device_put``), where one program
  over the exchange mesh (the extra device of every process, axis :data:`REPLICA`) packs them
  into one flat buffer, ``psum``\ s it across the replicas and divides by R in the leaves'
  dtype, as the library's in-step exchange does: :math:`\Delta^f = (\sum_r \Delta^f_r) / R`.
  It is dispatched without waiting. Before step :math:`s + \tau`, where the library lands the
  fragment (``local_step == in_flight_step[f] + overlap``), the mean is copied back to every
  training device of the process and replaces the fragment's leaves of ``in_flight`` (this
  waits for the exchange if it has not finished); the library's step then lands it exactly as
  its own mean. A checkpoint and the end of the run first land every pending exchange
  (:meth:`settle`), so the saved and returned states are the in-step route's; a resumed state's
  ``in_flight`` already holds the means. The evaluations read the anchor and the params, which
  an exchange in flight does not touch.

  Costs: one more emulated CPU device per process (``jax_num_cpu_devices`` = training devices +
  1), and per exchange one device-to-device copy of the fragment each way inside each process.
  With R = 2 replicas the sum has one addition: the params are the in-step route's bit for bit.

  ``collectives["exchange"]`` holds the exchange programs' bytes (per device of the exchange
  mesh, by axis): ``conditional``, one per fragment, of which one runs per fragment's send.

  Raises:
    ValueError: the processes are not the replicas, or a process has other than
      ``devices / processes`` + 1 devices, or a fragment's leaves have several dtypes.
  """

  def __init__(self, task: Task, data: Data, settings: Settings):
    if jax.process_count() != settings.replicas or settings.replicas < 2:
      raise ValueError(
        f"train(settings.exchange_device=True) needs one replica per process and more than one"
        f" process, got settings.replicas={settings.replicas} with {jax.process_count()}"
        " processes.")
    super().__init__(task, data, settings)

  def _compile(self, params, loss_fn) -> None:
    super()._compile(params, loss_fn)
    s = self.settings
    self.exchange_mesh = _exchange_mesh(s.devices)
    (self.exchange_device,) = [d for d in self.exchange_mesh.devices.flat
                               if d.process_index == jax.process_index()]
    self.exchange_sharding = NamedSharding(self.exchange_mesh, P(REPLICA))
    one = [jax.ShapeDtypeStruct(p.shape[1:], p.dtype) for p in jax.tree.leaves(params)]
    ids = assign_fragments("streaming_diloco", one, s.num_fragments, "balanced")
    self.fragment_leaves = [[j for j, i in enumerate(ids) if i == f]
                            for f in range(s.num_fragments)]
    in_flight = jax.tree.leaves(self.initial.opt_state.in_flight)
    self._exchanges = [self._exchange_program([in_flight[j] for j in leaves])
                       for leaves in self.fragment_leaves]
    programs = [_collective_bytes(c, self.exchange_mesh) for c in self._exchanges]
    self.collectives["exchange"] = {
      "unconditional": {}, "conditional": [p["unconditional"] for p in programs],
      "operands": {"unconditional": {},
                   "conditional": [p["operands"]["unconditional"] for p in programs]}}
    self.pending: dict[int, tuple[int, Any]] = {}
    """The exchanges in flight: fragment -> (the step before which it lands, its outputs)."""

  def _exchange_program(self, leaves: list[Any]) -> Any:
    """The compiled exchange of one fragment's ``in_flight`` leaves (``[workers, ...]``): the
    replicas' mean of each, in one ``psum`` of a flat buffer over the exchange mesh."""
    s, r = self.settings, self.settings.replicas
    dtypes = {x.dtype for x in leaves}
    if len(dtypes) != 1:
      raise ValueError(f"train(settings.exchange_device=True) packs a fragment's leaves into one"
                       f" buffer and needs one dtype, got {sorted(map(str, dtypes))}.")
    comm = _checks.check_comm_dtype("train", s.comm_dtype)

    def mean(*parts):
      flat = jnp.concatenate([x.reshape(-1) for x in parts])
      total = _axis.worker_mean(flat, REPLICA, r, comm)  # the library's psum, / r in the dtype
      out, start = [], 0
      for x in parts:
        out.append(total[start:start + x.size].reshape(x.shape))
        start += x.size
      return tuple(out)

    specs = (P(REPLICA),) * len(leaves)
    program = jax.jit(jax.shard_map(mean, mesh=self.exchange_mesh, in_specs=specs,
                                    out_specs=specs))
    return program.lower(*[
      jax.ShapeDtypeStruct((r, *x.shape[1:]), x.dtype, sharding=self.exchange_sharding)
      for x in leaves]).compile()

  def step(self, state: State, step: int) -> tuple[State, Any]:
    """Lands the exchanges due before ``step``, runs it, and sends the fragments it sends."""
    s = self.settings
    state = self._land(state, lambda when: when == step)
    state, loss = super().step(state, step)
    if self.algorithm.communicates(s, step):
      for f in range(s.num_fragments):
        if optax_dist.streaming_diloco_syncs(step, sync_period=s.sync_period,
                                             num_fragments=s.num_fragments, fragment=f):
          self._send(state, f, step + s.overlap)
    return state, loss

  def _send(self, state: State, fragment: int, lands: int) -> None:
    """Dispatches the exchange of ``fragment``'s ``in_flight`` leaves, landing before ``lands``."""
    leaves = jax.tree.leaves(state.opt_state.in_flight)
    inputs = []
    for j in self.fragment_leaves[fragment]:
      x = leaves[j]  # every training device of this process holds the replica's own value
      moved = jax.device_put(x.addressable_shards[0].data, self.exchange_device)
      inputs.append(jax.make_array_from_single_device_arrays(
        (self.settings.replicas, *x.shape[1:]), self.exchange_sharding, [moved]))
    jax.block_until_ready(inputs)  # the copies only, before the next step donates the state
    self.pending[fragment] = (lands, self._exchanges[fragment](*inputs))

  def _land(self, state: State, due: Callable[[int], bool]) -> State:
    """``state`` with the means of the pending exchanges whose landing step is ``due`` in place
    of their fragments' ``in_flight`` leaves (waits for those exchanges)."""
    ready = [f for f, (lands, _) in self.pending.items() if due(lands)]
    if not ready:
      return state
    leaves, treedef = jax.tree.flatten(state.opt_state.in_flight)
    for f in ready:
      _, means = self.pending.pop(f)
      for j, mean in zip(self.fragment_leaves[f], means, strict=True):
        x, local = leaves[j], mean.addressable_shards[0].data
        copies = [jax.device_put(local, shard.device) for shard in x.addressable_shards]
        leaves[j] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)
    opt_state = state.opt_state._replace(in_flight=treedef.unflatten(leaves))
    return state._replace(opt_state=opt_state)

  def settle(self, state: State) -> State:
    return self._land(state, lambda lands: True)


def _bytes_per_device(tree: Any) -> int:
  """The bytes of one device's shards of ``tree``'s arrays (every shard of an array has one
  size: the params are split only on dimensions the devices divide)."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def fsdp_spec(shape: tuple[int, ...], k: int) -> P:
  """The spec of a param of ``shape`` inside one replica: :data:`FSDP` on its largest dimension
  divisible by ``k`` (the first of equal ones), ``P()`` (whole on every device) if none is."""
  divisible = [d for d, n in enumerate(shape) if n % k == 0]
  if not divisible:
    return P()
  axis = max(divisible, key=lambda d: (shape[d], -d))
  return P(*(FSDP if d == axis else None for d in range(len(shape))))


def _collective_bytes(compiled: Any, mesh: jax.sharding.Mesh) -> dict[str, Any]:
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


_STEP_KINDS = {None: "every_step", True: "communication_step", False: "non_communication_step"}
"""The results' names of the compiled steps, by their ``communicate`` hint."""


def _mesh(settings: Settings) -> jax.sharding.Mesh:
  """The workers' mesh: 1-D over :data:`AXIS`, or with ``replicas`` R > 1, ``(R, devices / R)``
  over ``(REPLICA, DATA)``, each replica's workers on consecutive devices (of one process when
  every process holds a replica)."""
  s = settings
  devices = _devices(s.devices, s.exchange_device)
  if s.replicas == 1:
    return jax.make_mesh((s.devices,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)
  if s.devices % s.replicas:
    raise ValueError(
      f"train(settings.replicas={s.replicas}) must divide settings.devices={s.devices}: the"
      " replicas have equal numbers of workers.")
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return jax.sharding.Mesh(np.array(devices).reshape(s.replicas, s.devices // s.replicas),
                           (REPLICA, DATA), axis_types=(AxisType.Auto, AxisType.Auto))


def _global_mesh(settings: Settings) -> jax.sharding.Mesh:
  """The global view's mesh: ``(R, D, K)`` over ``(REPLICA, DATA, FSDP)`` with ``R`` the
  replicas, ``K`` the ``fsdp`` devices a replica's params are sharded over and ``D = devices /
  (R K)``; the devices in order (by process, then id), so device ``i`` is :func:`_mesh`'s
  worker ``i``.

  Raises:
    ValueError: ``fsdp`` not positive, or not dividing the devices of a replica.
  """
  s = settings
  if s.devices % s.replicas:
    raise ValueError(
      f"train(settings.replicas={s.replicas}) must divide settings.devices={s.devices}: the"
      " replicas have equal numbers of devices.")
  per_replica = s.devices // s.replicas
  if s.fsdp < 1 or per_replica % s.fsdp:
    raise ValueError(
      f"train(settings.fsdp={s.fsdp}) must be a positive divisor of the devices of a replica,"
      f" settings.devices / settings.replicas = {per_replica}: each replica's params are"
      " sharded over fsdp of its devices.")
  devices = sorted(_devices(s.devices), key=lambda d: (d.process_index, d.id))
  shape = (s.replicas, per_replica // s.fsdp, s.fsdp)
  return jax.sharding.Mesh(np.array(devices).reshape(shape), (REPLICA, DATA, FSDP),
                           axis_types=(AxisType.Auto,) * 3)


def _devices(devices: int, exchange_device: bool = False) -> list[Any]:
  """The first ``devices`` of ``jax.devices()``; raises ``ValueError`` if that is not all there.

  With ``exchange_device``, the first ``devices / processes`` of each process's devices (by id),
  the last one of each being left to the exchanges (:func:`_exchange_mesh`).
  """
  if exchange_device:
    return [d for per_process in _process_devices(devices) for d in per_process[:-1]]
  available = jax.devices()
  if devices > len(available):
    raise ValueError(
      f"train(settings.devices={devices}) needs {devices} devices but JAX has {len(available)};"
      f' set jax.config.update("jax_num_cpu_devices", {devices}) before JAX initialises.')
  if jax.process_count() > 1 and devices != len(available):
    raise ValueError(
      f"train(settings.devices={devices}): with {jax.process_count()} processes every device is"
      f" a worker; pass devices={len(available)}, the number of devices of all processes.")
  return available[:devices]


def _process_devices(devices: int) -> list[list[Any]]:
  """Each process's devices by id, ``devices / processes`` training devices and one more for the
  exchanges: raises ``ValueError`` if a process has another number."""
  processes = jax.process_count()
  per_process = devices // processes
  grouped = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
             for p in range(processes)]
  for p, local in enumerate(grouped):
    if devices % processes or len(local) != per_process + 1:
      raise ValueError(
        f"train(settings.devices={devices}, settings.exchange_device=True) needs"
        f" devices / processes = {devices / processes:g} training devices and one for the"
        f" exchanges in each of the {processes} processes, but process {p} has {len(local)};"
        f' set jax.config.update("jax_num_cpu_devices", {per_process + 1}) before JAX'
        " initialises.")
  return grouped


def _exchange_mesh(devices: int) -> jax.sharding.Mesh:
  """The exchanges' mesh over :data:`REPLICA`: the last device of each process (by id), in
  process order (replica ``r`` is process ``r``'s)."""
  extra = [local[-1] for local in _process_devices(devices)]
  return jax.sharding.Mesh(np.array(extra), (REPLICA,), axis_types=(AxisType.Auto,))


def _check_batch_size(settings: Settings, n_train: int, n_local: int) -> None:
  if n_local < settings.batch_size:
    raise ValueError(
      f"train(settings.batch_size={settings.batch_size}) is larger than each worker's shard of"
      f" the training set ({n_train} examples over {settings.devices} workers: {n_local} each).")


def _progress_bar(settings: Settings, done: int, enabled: bool) -> Any:
  from tqdm.auto import tqdm

  return tqdm(total=settings.steps, initial=done, desc=settings.algorithm, unit="step",
              disable=not enabled, leave=False, file=sys.stderr)


def train(
  task: Task,
  data: Data,
  settings: Settings,
  *,
  on_step: Callable[[int], None] | None = None,
  progress: bool = False,
  checkpoint_dir: str | None = None,
  checkpoint_every: int = 0,
  resume: bool = False,
  final_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Trains ``task`` on ``data`` with ``settings.algorithm`` over ``settings.devices`` workers.

  Worker ``i`` owns the ``i``-th of ``devices`` equal shards of the training set and draws
  minibatches from a fresh permutation of its shard every epoch. All workers start from the same
  params (:func:`initial_params`, the same for every algorithm given the seed). The test metric
  is measured at step 0, every ``eval_every`` steps and at the end, for the params
  :func:`optax_dist.eval_params` returns and for the workers' own params, each averaged over the
  workers. After ``jax.distributed.initialize`` the workers are the devices of every process,
  and every process calls ``train`` with the same arguments; the results are the same on all.

  With ``settings.fsdp`` K the run is on the global view (:class:`GlobalRun`): one jitted
  ``jax.vmap`` step over the replicas, each replica's params and state sharded over K of its
  devices; device ``i`` trains on worker ``i``'s examples, so the losses are those of the
  per-device step to float rounding. The state then has a leading replica axis.

  With ``settings.exchange_device`` (:class:`ExchangeDeviceRun`) the ``streaming_diloco``
  exchanges across the replicas run on one extra device per process (JAX must have
  ``devices / processes`` + 1 CPU devices in each), beside the steps between a fragment's send
  and its landing; the params and state are the in-step route's.

  With ``checkpoint_dir`` and ``checkpoint_every > 0``, the state is saved with Orbax every
  ``checkpoint_every`` steps and at the end; with ``resume``, training continues from the latest
  checkpoint there (from the start if there is none) and ends with the params of an
  uninterrupted run. Without ``resume``, the checkpoints there are replaced.

  Args:
    on_step: called with the step number after each step.
    progress: show a progress bar on stderr.
    final_state: if given, filled with the final ``params`` and ``opt_state`` as NumPy arrays with
      a leading worker axis (with ``fsdp``, replica axis), gathered from every process.

  Returns:
    A dict of the settings, the final metrics, ``communication_rounds``, ``wall_time_s``
    (compilation included; summed over the resumed runs), ``num_dropped``
    (``drop_stale_gradients`` only), ``resumed_from_step`` (with ``resume``), ``resized``
    (``{"step", "from_workers", "to_workers"}``, when ``resume`` continued a checkpoint of
    another number of workers: see :func:`resize`), ``history``
    (the lists of :func:`record_keys`; ``train_loss`` is the workers' mean minibatch loss),
    ``collective_bytes`` (per compiled step, ``every_step`` or ``communication_step`` and
    ``non_communication_step``: the bytes each device sends into collectives, by the mesh axes
    they span, e.g. ``{"data": ..., "replica": ...}``, within a replica and across replicas
    apart; ``unconditional``, on every execution, and ``conditional``, a list with each
    conditional exchange's, e.g. one per fragment of ``streaming_diloco``, of which one runs on
    a sync step; ``operands``, the same structure counting the arrays they carry; read from
    the compiled program, see :func:`optax_dist.communication_report`; with ``exchange_device``
    also ``exchange``, the exchange programs', per device of the exchange mesh,
    ``conditional`` holding one per fragment, and the steps' own have none across replicas),
    ``step_times`` (the seconds of each step this call ran, from the step's start until its
    loss is ready on this process: evaluations and checkpoints excluded; after ``resume``, the
    steps after the checkpoint's) and ``bytes_per_device`` (``params``, ``opt_state``: one
    device's shards; ``step_arguments``: the compiled step's arguments on one device, from its
    ``memory_analysis``, the device's shard of the training set included).

  Raises:
    ValueError: too few devices, a batch larger than a worker's shard, replicas not dividing
      the devices; with ``fsdp``, K not dividing a replica's devices, or an algorithm fed stale
      gradients; with ``exchange_device``, replicas other than the processes or a process
      without exactly one device beyond its training devices (and the refusals of
      :func:`optax_dist.cli.algorithms.check_exchange`).
    CheckpointMismatchError: ``resume`` from a checkpoint written with other settings.
  """
  start = time.perf_counter()
  settings = settings.resolved()
  if settings.fsdp is not None:
    run = GlobalRun(task, data, settings)
  elif settings.exchange_device:
    run = ExchangeDeviceRun(task, data, settings)
  else:
    run = Run(task, data, settings)
  resized = None
  record = {key: [] for key in record_keys(task)}
  state, earlier_time, resumed_from = run.initial, 0.0, None
  checkpoints = None
  if checkpoint_dir is not None and (checkpoint_every > 0 or resume):
    checkpoints = Checkpoints(checkpoint_dir, settings.as_dict(), resume=resume)
    if resume:
      state, record, earlier_time, resumed_from, resized = _restore(
        run, checkpoints, state, record)
  first = (resumed_from or 0) + 1
  if first == 1:
    run.measure(state, record, 0, None)

  def save(s: int, state: State) -> State:
    if checkpoints is not None and checkpoint_every > 0 and (
        s % checkpoint_every == 0 or s == settings.steps):
      state = run.settle(state)  # no exchange in flight outside the state
      checkpoints.save(s, state._asdict(), {
        "record": record, "wall_time_s": earlier_time + time.perf_counter() - start})
    return state

  step_times = []
  with _progress_bar(settings, first - 1, progress) as bar:
    state = _loop(run, state, record, first, save=save, on_step=on_step, bar=bar,
                  step_times=step_times)
  state = run.settle(state)
  if checkpoints is not None:
    checkpoints.close()
  if final_state is not None:
    final_state.update(to_host({"params": state.params, "opt_state": state.opt_state}))
  result = _result(task, settings, state, record, earlier_time + time.perf_counter() - start)
  result["step_times"] = step_times
  result["collective_bytes"] = run.collectives
  result["bytes_per_device"] = run.bytes_per_device
  if resumed_from is not None:
    result["resumed_from_step"] = resumed_from
  if resized is not None:
    result["resized"] = resized
  return result


def _loop(run: Run, state: State, record: dict[str, list], first: int, *, save: Callable,
          on_step: Callable | None, bar: Any, step_times: list[float]) -> State:
  """Trains from step ``first`` to the end: evaluates, saves, reports progress; the last state.

  Appends each step's seconds (the step until its loss is ready) to ``step_times``.
  """
  settings = run.settings
  for s in range(first, settings.steps + 1):
    started = time.perf_counter()
    state, loss = run.step(state, s)
    # One step at a time: XLA CPU's collectives time out when many steps' worth of device
    # threads queue up on few cores.
    jax.block_until_ready(loss)
    step_times.append(time.perf_counter() - started)
    if s % settings.eval_every == 0 or s == settings.steps:
      run.measure(state, record, s, loss)
    state = save(s, state)
    bar.update(1)
    if on_step is not None:
      on_step(s)
  return state


def _restore(run: Run, checkpoints: Any, state: State, record: dict[str, list]) -> tuple:
  """``(state, record, earlier wall time, step, resize)`` of the latest checkpoint (step 0 if
  none); ``resize`` is ``None``, or ``{"step", "from_workers", "to_workers"}`` when the checkpoint
  had another number of workers and the state was moved to this run's with
  :func:`optax_dist.resize_state`. On the global view (:class:`GlobalRun`) the state is per
  replica and restores onto this run's mesh whatever the number of devices."""
  restored = checkpoints.restore(state._asdict(), run.replicated,
                                 per_worker=run.state_per_worker)
  if restored is None:
    return state, record, 0.0, 0, None
  saved, meta = restored
  saved, change = State(**saved), None
  workers = meta["settings"]["devices"]
  if workers != run.settings.devices and run.state_per_worker:
    saved = resize(run, saved)
    change = {"step": meta["step"], "from_workers": workers, "to_workers": run.settings.devices}
  return saved, meta["record"], meta["wall_time_s"], meta["step"], change


def resize(run: Run, state: State) -> State:
  """``state`` of another number of workers, moved to ``run``'s by
  :func:`optax_dist.resize_state` (the inner optimizer states averaged), and sharded over them.

  ``drop_stale_gradients``' params history is the same on every worker (it trains with
  ``tower``): worker 0's goes to every new worker.
  """
  workers = run.settings.devices
  # On host values: every process computes the same, locally.
  params, opt_state, history = _replicated_value(state)
  opt_state, params = optax_dist.resize_state(run.tx, opt_state, params, workers)
  history = jax.tree.map(lambda h: np.broadcast_to(h[:1], (workers, *h.shape[1:])), history)
  return State(*run.shard(_replicated_value((params, opt_state))), run.shard(history))


def _replicated_value(tree: Any) -> Any:
  """The host value of ``tree``'s arrays, each whole on every device (and process)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), tree)


def _result(task: Task, settings: Settings, state: State, record: dict[str, list],
            wall_time: float) -> dict[str, Any]:
  """The results of a finished run (see :func:`train`): the settings of the recipe, those the
  algorithm reads (:attr:`Algorithm.settings`), the final metrics and the history."""
  s, algorithm = settings, ALGORITHMS[settings.algorithm]
  result = {
    "algorithm": s.algorithm,
    "task": s.task,
    "metric": task.metric_key,
    "devices": s.devices,
    "replicas": s.replicas,
    "fsdp": s.fsdp,
    "steps": s.steps,
    "batch_size": s.batch_size,
    "learning_rate": s.learning_rate,
    "param_dtype": s.param_dtype,
    **{key: getattr(s, key) for key in algorithm.settings},
    "communication_rounds": algorithm.communication_rounds(s, s.steps),
    **{key: record[key][-1] for key in metric_keys(task)},
    "final_train_loss": record["train_loss"][-1],
    "wall_time_s": wall_time,
    "history": record,
  }
  if algorithm.stale_gradients:
    # The same on every worker; read from a shard this process holds.
    dropped = state.opt_state.num_dropped.addressable_shards[0].data
    result["num_dropped"] = int(np.asarray(dropped)[0])
  return result
