"""The device numerics of the asynchronous emulator: one event of each protocol.

A simulator holds the carry of :func:`optax_dist.async_emulator.emulate`'s ``lax.scan`` (the
server, center or anchor and the N workers' rows) and turns one :class:`Event` into the next
carry and a :class:`Record`. The protocols' math is in :mod:`.protocols`; nothing here is
re-exported by the package.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dist import _axis
from optax_dist._drop_stale_gradients import DropStaleGradientsState
from optax_dist.async_emulator.protocols import AGN, DiLoCo, Downpour

STEP, RESTART, NOOP = 0, 1, 2
"""The kinds of events on the device (``NOOP`` pads the last chunk)."""


class Event(NamedTuple):
  """One event as the device sees it (a slice of the schedule)."""

  worker: jax.Array  # int32[]
  kind: jax.Array  # int32[]: STEP, RESTART or NOOP
  index: jax.Array  # int32[B]: rows of the flattened data
  next_read: jax.Array  # int32[N] (explicit read steps) or int32[0]


class Record(NamedTuple):
  """What the device reports per event; the integer bookkeeping (server steps, staleness) follows
  from it and the schedule on the host (on the host, by :mod:`.emulation`)."""

  loss: jax.Array  # float32[]: the worker's minibatch loss (NaN for restarts)
  committed: jax.Array  # bool[]: the event exchanged with the server
  accepted: jax.Array  # bool[]: committed and not dropped


def _stack(tree, n):
  """``n`` copies of ``tree``, one per worker: every leaf stacked on a leading axis ``[n, ...]``."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a)), tree)


_READ_GROUP = 8
"""Leaves read by one ``lax.cond`` in :func:`_take`: XLA's CPU runtime runs a branch of at most
8 kernels sequentially, a longer one concurrently on its thread pool, which costs far more here."""


def _take(stacked, w):
  """Worker ``w``'s copy of a stacked tree.

  The read goes through ``lax.cond``s (whose predicate always holds) so that it lands in buffers
  of its own: plain dynamic slices get fused into their many consumers, some of which XLA then
  schedules after the row's write, and it then copies the whole stacks on every event.
  """
  leaves, treedef = jax.tree.flatten(stacked)
  out = []
  for start in range(0, len(leaves), _READ_GROUP):
    group = leaves[start:start + _READ_GROUP]

    def read(group=group):
      return [jax.lax.dynamic_index_in_dim(a, w, keepdims=False) for a in group]

    def empty(group=group):
      return [jnp.zeros(a.shape[1:], a.dtype) for a in group]

    out += jax.lax.cond(w >= 0, read, empty)
  return treedef.unflatten(out)


def _put(stacked, w, tree):
  """``stacked`` with worker ``w``'s copy replaced by ``tree`` (in place under ``jit``)."""
  return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, w, 0), stacked, tree)


def _drop_stale_state(state):
  """The first ``DropStaleGradientsState`` in a depth-first walk of ``state``, or ``None``."""
  def is_dss(x):
    return isinstance(x, DropStaleGradientsState)

  for node in jax.tree.leaves(state, is_leaf=is_dss):
    if is_dss(node):
      return node
  return None


def _nan_if(pred, loss):
  return jnp.where(pred, loss.astype(jnp.float32), jnp.float32(jnp.nan))


def _select(pred, on_true, on_false, every_event_is_a_step):
  """``optax.tree.where``, skipped when the schedule has only steps (``pred`` is then True)."""
  return on_true if every_event_is_a_step else optax.tree.where(pred, on_true, on_false)


class DownpourSim:
  """Carry: server params and state, an own commit counter, N snapshots and their read steps."""

  def __init__(self, protocol, loss_fn, num_workers, explicit_reads, only_steps):
    self.server = optax.with_extra_args_support(protocol.server)
    self.loss_fn = loss_fn
    self.n = num_workers
    self.explicit_reads = explicit_reads
    self.only_steps = only_steps

  def global_step(self, opt_state, commits):
    dss = _drop_stale_state(opt_state)
    return commits if dss is None else dss.global_step

  def dropped(self, opt_state):
    dss = _drop_stale_state(opt_state)
    return jnp.zeros([], jnp.int32) if dss is None else dss.num_dropped

  def init(self, params):
    params = jax.tree.map(jnp.asarray, params)
    opt_state = self.server.init(params)
    commits = jnp.zeros([], jnp.int32)
    snap_step = jnp.full([self.n], self.global_step(opt_state, commits), jnp.int32)
    return (params, opt_state, commits, _stack(params, self.n), snap_step)

  def server_params(self, carry):
    return carry[0]

  def event(self, carry, ev, batch):
    params, opt_state, commits, snaps, snap_step = carry
    is_step, is_restart = ev.kind == STEP, ev.kind == RESTART
    w = ev.worker
    snap, read = _take(snaps, w), snap_step[w]

    loss, grads = jax.value_and_grad(self.loss_fn)(snap, batch)
    updates, new_state = self.server.update(grads, opt_state, params, grad_step=read)
    new_params = optax.apply_updates(params, updates)
    dropped = self.dropped(new_state) > self.dropped(opt_state)
    params = _select(is_step, new_params, params, self.only_steps)
    opt_state = _select(is_step, new_state, opt_state, self.only_steps)
    commits = commits + is_step.astype(jnp.int32)
    step_after = self.global_step(opt_state, commits)

    if self.explicit_reads:  # every worker whose next commit reads this step refreshes
      fresh = ev.next_read == step_after
      snaps = jax.tree.map(
        lambda s, p: jnp.where(fresh.reshape((-1,) + (1,) * p.ndim), p[None], s), snaps, params)
      snap_step = jnp.where(fresh, step_after, snap_step)
    else:  # the worker reads right after its own commit or restart
      reads = is_step | is_restart
      snaps = _put(snaps, w, _select(reads, params, snap, self.only_steps))
      snap_step = snap_step.at[w].set(jnp.where(reads, step_after, read))

    record = Record(loss=_nan_if(is_step, loss), committed=is_step, accepted=is_step & ~dropped)
    return (params, opt_state, commits, snaps, snap_step), record

  def outputs(self, carry):
    return carry[0], carry[3], carry[1]


class CenterSim:
  """Elastic averaging and AGN. Carry: the center and its shared optimizer state (AGN), and the
  workers' rows (local params and local state, whose shared fields are ``None``)."""

  def __init__(self, protocol, loss_fn, num_workers, only_steps):
    self.tx = protocol.transformation(num_workers)
    self.period = protocol.communication_period
    self.agn = isinstance(protocol, AGN)
    self.loss_fn = loss_fn
    self.n = num_workers
    self.only_steps = only_steps

  def local(self, state):  # the worker's own part of the state
    if self.agn:
      return state._replace(center=None, center_inner_state=None)
    return state._replace(center=None)

  def shared(self, state):
    return (state.center, state.center_inner_state) if self.agn else (state.center, None)

  def full(self, local, shared):
    center, center_inner_state = shared
    if self.agn:
      return local._replace(center=center, center_inner_state=center_inner_state)
    return local._replace(center=center)

  def init(self, params):
    params = jax.tree.map(jnp.asarray, params)
    state = self.tx.init(params)
    return (self.shared(state), _stack((params, self.local(state)), self.n))

  def server_params(self, carry):
    return carry[0][0]

  def event(self, carry, ev, batch):
    shared, rows = carry
    is_step, is_restart = ev.kind == STEP, ev.kind == RESTART
    w = ev.worker
    x, local = _take(rows, w)

    loss, grads = jax.value_and_grad(self.loss_fn)(x, batch)
    # The update runs under `vmap` over a batch of one: the transformation's `lax.cond` on the
    # communication step then becomes a select of both branches (same result). On CPU a
    # conditional inside the scan costs more than the exchange it skips.
    one = (grads, self.full(local, shared), x)
    updates, new_state = jax.tree.map(
      lambda a: a[0], jax.vmap(self.tx.update)(*jax.tree.map(lambda a: a[None], one)))
    new_x = optax.apply_updates(x, updates)
    committed = is_step & (new_state.local_step % self.period == 0)
    new_row = (new_x, self.local(new_state))
    if self.only_steps:
      shared, row = self.shared(new_state), new_row
    else:
      shared = optax.tree.where(is_step, self.shared(new_state), shared)
      center = shared[0]
      fresh = (center, self.local(self.tx.init(center)))  # a restart starts from the center
      row = optax.tree.where(is_restart, fresh, optax.tree.where(is_step, new_row, (x, local)))
    rows = _put(rows, w, row)

    record = Record(loss=_nan_if(is_step, loss), committed=committed, accepted=committed)
    return (shared, rows), record

  def outputs(self, carry):
    shared, rows = carry[0], carry[1]
    return shared[0], rows[0], shared[1]


class DiLoCoSim:
  """Asynchronous DiLoCo. Carry: the anchor and the outer state, and the workers' rows (local
  params, the anchor each read, inner state, local step).

  ``periods``: each worker's local steps per commit (``dylu``), or ``None`` for H everywhere.
  """

  def __init__(self, protocol, loss_fn, num_workers, only_steps, periods=None):
    self.inner = _axis.wrap_inner(protocol.inner)
    self.outer = protocol.outer
    self.period = protocol.sync_period
    self.periods = periods
    self.loss_fn = loss_fn
    self.n = num_workers
    self.only_steps = only_steps

  def fresh(self, anchor):
    """A worker (re)starting from ``anchor``: it reads it and trains from it, step 0."""
    return (anchor, anchor, self.inner.init(anchor), jnp.zeros([], jnp.int32))

  def init(self, params):
    anchor = jax.tree.map(jnp.asarray, params)
    return (anchor, self.outer.init(anchor)), _stack(self.fresh(anchor), self.n)

  def server_params(self, carry):
    return carry[0][0]

  def commit(self, shared, read, new_x):
    """The server's outer step on the pseudo-gradient ``read - new_x``, from the current anchor."""
    anchor, outer_state = shared
    delta = jax.tree.map(lambda r, x: r - x.astype(r.dtype), read, new_x)
    steps, new_outer_state = self.outer.update(delta, outer_state, anchor)
    new_anchor = optax.apply_updates(anchor, steps)
    return (_axis.keep_dtypes(new_anchor, anchor),
            _axis.keep_dtypes(new_outer_state, outer_state))

  def event(self, carry, ev, batch):
    shared, rows = carry
    is_step, is_restart = ev.kind == STEP, ev.kind == RESTART
    w = ev.worker
    row = _take(rows, w)
    x, read, inner_state, local_step = row

    loss, grads = jax.value_and_grad(self.loss_fn)(x, batch)
    updates, inner_state = self.inner.update(grads, inner_state, x)
    new_x = optax.apply_updates(x, updates)
    local_step = local_step + 1
    period = self.period if self.periods is None else jnp.asarray(self.periods, jnp.int32)[w]
    committed = is_step & (local_step % period == 0)
    # The commit is computed on every event and selected (see CenterSim on conditionals).
    shared = optax.tree.where(committed, self.commit(shared, read, new_x), shared)
    anchor = shared[0]
    new_x, read = optax.tree.where(committed, (anchor, anchor), (new_x, read))  # read again
    stepped = (new_x, read, inner_state, local_step)
    if self.only_steps:
      row = stepped
    else:
      row = optax.tree.where(
        is_restart, self.fresh(anchor), optax.tree.where(is_step, stepped, row))
    rows = _put(rows, w, row)

    record = Record(loss=_nan_if(is_step, loss), committed=committed, accepted=committed)
    return (shared, rows), record

  def outputs(self, carry):
    (anchor, outer_state), rows = carry
    return anchor, rows[0], outer_state


def simulator(protocol, loss_fn, num_workers, explicit_reads, only_steps, periods=None):
  """The simulator of ``protocol``'s events.

  ``explicit_reads``: the schedule gives downpour's read steps. ``only_steps``: every event is a
  step (no restart, no padding), so no event needs a select between a step and something else.
  ``periods``: DiLoCo with ``dylu``: each worker's local steps per commit.
  """
  if isinstance(protocol, Downpour):
    return DownpourSim(protocol, loss_fn, num_workers, explicit_reads, only_steps)
  if isinstance(protocol, DiLoCo):
    return DiLoCoSim(protocol, loss_fn, num_workers, only_steps, periods)
  return CenterSim(protocol, loss_fn, num_workers, only_steps)
