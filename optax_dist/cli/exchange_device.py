"""``streaming_diloco``'s exchanges across the replicas on an exchange device beside the steps.

With ``exchange_device`` (``streaming_diloco``, ``overlap`` τ ≥ 1, one replica per process) the
exchanges across the replicas leave the step: each runs on one extra CPU device per process
while the next steps compute, and its mean goes back into the state before the step that lands
it (:class:`ExchangeDeviceRun`: XLA CPU runs a process's multi-device computations one at a
time, so only a computation on another device can run beside the steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dist
from optax_dist.cli.algorithms import REPLICA
from optax_dist.cli.meshes import exchange_mesh
from optax_dist.cli.runs import Run, collective_bytes
from optax_dist.cli.steps import State


class ExchangeDeviceRun(Run):
  r"""A run of ``streaming_diloco`` with ``overlap`` τ ≥ 1 and one replica per process whose
  exchanges across the replicas run on an exchange device (``settings.exchange_device``).

  Why: XLA's CPU client runs the computations that span several devices of a process one after
  another, so an exchange dispatched as its own computation over the training devices would wait
  for the steps, and the steps for it (``benchmarks/results/probe_overlap.json``); a computation
  on one extra device of each process runs beside them. (A GPU would run it on a separate stream.)

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

  The settings must have passed :func:`optax_dist.cli.checks.check_settings` (one replica per
  process, more than one process).

  Raises:
    ValueError: a process has other than ``devices / processes`` + 1 devices, or a fragment's
      leaves have several dtypes.
  """

  def _compile(self, params, loss_fn) -> None:
    super()._compile(params, loss_fn)
    s = self.settings
    self.exchange_mesh = exchange_mesh(s.devices)
    (self.exchange_device,) = [d for d in self.exchange_mesh.devices.flat
                               if d.process_index == jax.process_index()]
    self.exchange_sharding = NamedSharding(self.exchange_mesh, P(REPLICA))
    one = [jax.ShapeDtypeStruct(p.shape[1:], p.dtype) for p in jax.tree.leaves(params)]
    ids = optax_dist.streaming_diloco_fragments(one, s.num_fragments, "balanced")
    self.fragment_leaves = [[j for j, i in enumerate(ids) if i == f]
                            for f in range(s.num_fragments)]
    in_flight = jax.tree.leaves(self.initial.opt_state.in_flight)
    self._exchanges = [self._exchange_program([in_flight[j] for j in leaves])
                       for leaves in self.fragment_leaves]
    programs = [collective_bytes(c, self.exchange_mesh) for c in self._exchanges]
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
    exchange = optax_dist.Exchange(REPLICA, comm_dtype=s.comm_dtype, call="train")

    def mean(*parts):
      flat = jnp.concatenate([x.reshape(-1) for x in parts])
      total = exchange.mean(flat)
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
