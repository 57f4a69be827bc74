"""Compute utilization and wall-clock per step of each method over a given link, before renting it.

An analytic model, pure Python arithmetic: nothing measured, nothing run on a device (the
settings are checked by building ``optax_dist.streaming_diloco`` with them). For a model of
``num_params`` values whose training step computes for ``step_time`` seconds on each of
``num_replicas`` replicas joined by a link of ``bandwidth`` bit/s, :func:`plan` gives per method
the bytes each replica sends, the time of one exchange, the wall-clock per step and the compute
utilization; :func:`required_bandwidth` solves for the bandwidth that reaches a target
utilization.

The model (units: bytes, seconds, bit/s). Write N for ``num_params``, b for ``bits``, M for
``num_replicas``, T for ``step_time``, W for ``bandwidth``, λ for ``latency``, H for
``sync_period``, F for ``num_fragments``, τ for ``overlap`` and β for ``backward_overlap``.

* What a method exchanges, and how often. Every exchange is one ring all-reduce of V values of b
  bits each (B = V · b / 8 bytes), every p steps:

  ============================  ========  ========  ===========
  method                        V         p         hidden (τ')
  ============================  ========  ========  ===========
  ``sync`` (data parallel)      N         1         0
  ``diloco``                    N         H         0
  ``streaming_diloco``          N / F     H / F     0
  ``streaming_diloco_overlap``  N / F     H / F     τ
  ============================  ========  ========  ===========

* A ring all-reduce of B bytes over M replicas: each replica sends (and receives)
  2 (M − 1) / M · B bytes in 2 (M − 1) messages, so one exchange takes

  .. math:: t = \\frac{2 (M - 1)}{M} \\cdot \\frac{8 B}{W} + 2 (M - 1) \\lambda

  (M = 1: no exchange, t = 0).
* What compute hides. An exchange runs beside the last β · T seconds of the step that starts it
  (β = 2/3: it starts with the backward pass, as gradient buckets are reduced while the backward
  pass runs; β = 0: it starts after the step), and with an overlap of τ steps also beside the next
  τ steps, whose results wait for it. The window is ``h = min((β + τ') · T, p · T)``: the link
  carries one exchange at a time, so no window exceeds the period. Only what exceeds it stalls the
  replicas: ``stall = max(0, t − h)`` per exchange. ``diloco`` and ``streaming_diloco`` block
  (τ' = 0); ``streaming_diloco_overlap`` merges a fragment's outer update τ steps after sending
  it (``streaming_diloco(..., overlap=τ)``).
* Per step, averaged over the period: wall-clock ``T + stall / p`` seconds, bytes sent
  ``2 (M − 1) / M · B / p``, compute utilization ``T / (T + stall / p)``.
* The bandwidth for a target utilization u (:func:`required_bandwidth`), in closed form: the
  stall allowed per exchange is ``p · T · (1 / u − 1)``, so

  .. math:: W_u = \\frac{2 (M - 1) / M \\cdot 8 B}{p T (1 / u - 1) + h - 2 (M - 1) \\lambda},

  infinite when the latency alone exceeds the denominator's other terms, 0 when M = 1.

Quantized exchanges (``comm_dtype=jnp.int8`` or ``jnp.float4_e2m1fn``) are ``bits`` = 8 or 4;
count each block's float32 scale in ``bits`` (4 + 32 / 128 = 4.25 bits for float4 in blocks of
128). The model ignores the time of the outer optimizer step, stragglers, and any link traffic
other than these exchanges (within a replica, the synchronous reduction is part of ``step_time``).

References:
  Douillard et al., *Streaming DiLoCo with overlapping communication: Towards a Distributed Free
  Lunch*, 2025 (https://arxiv.org/abs/2501.18512), Figure 4 and its table of the bandwidth each
  method needs; docs/planner.md compares them with this model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Sequence

import optax

import optax_dist

__all__ = ["METHODS", "MethodPlan", "plan", "required_bandwidth"]

METHODS = ("sync", "diloco", "streaming_diloco", "streaming_diloco_overlap")
"""The methods :func:`plan` knows, in the order it reports them."""


@dataclasses.dataclass(frozen=True)
class MethodPlan:
  """One method's communication and timing under :func:`plan`'s model.

  Attributes:
    method: one of :data:`METHODS`.
    period: steps between two exchanges (p; 1 for ``sync``, H for ``diloco``, H / F for the
      streaming methods).
    exchange_bytes: bytes each replica sends in one exchange, 2 (M − 1) / M · B.
    bytes_per_step: bytes each replica sends per step, averaged over the period.
    exchange_time: seconds one exchange takes on the link (t).
    stall_time: seconds the replicas wait per exchange, beyond what compute hides.
    wall_time: wall-clock seconds per step, averaged over the period.
    utilization: compute time over wall-clock time, in (0, 1].
  """

  method: str
  period: float
  exchange_bytes: float
  bytes_per_step: float
  exchange_time: float
  stall_time: float
  wall_time: float
  utilization: float


def _fail(where: str, name: str, constraint: str, value) -> ValueError:
  return ValueError(f"`{where}({name}=...)` must be {constraint}, got {value!r}.")


def _real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check(where: str, *, num_params, step_time, latency, sync_period, num_fragments, overlap,
           bits, num_replicas, backward_overlap, methods) -> tuple[str, ...]:
  """Raises ``ValueError`` naming the first bad argument; returns ``methods`` as a tuple."""
  for name, value in (("num_params", num_params), ("step_time", step_time), ("bits", bits)):
    if not (_real(value) and 0 < value < math.inf):
      raise _fail(where, name, "a positive finite number", value)
  if not (_real(latency) and 0 <= latency < math.inf):
    raise _fail(where, "latency", "a finite number of seconds >= 0", latency)
  for name, value in (("sync_period", sync_period), ("num_fragments", num_fragments),
                      ("num_replicas", num_replicas)):
    if not (_int(value) and value >= 1):
      raise _fail(where, name, "a positive int", value)
  if not (_int(overlap) and overlap >= 0):
    raise _fail(where, "overlap", "an int >= 0 (inner steps)", overlap)
  if not (_real(backward_overlap) and 0 <= backward_overlap <= 1):
    raise _fail(where, "backward_overlap", "a fraction of the step in [0, 1]", backward_overlap)
  methods = (methods,) if isinstance(methods, str) else tuple(methods)
  unknown = [m for m in methods if m not in METHODS]
  if not methods or unknown or len(set(methods)) < len(methods):
    raise _fail(where, "methods", f"distinct names among {', '.join(METHODS)}", methods)
  _check_with_library(where, sync_period, num_fragments, overlap)
  return methods


_ARGUMENT = re.compile(r"^`\w+\((\w+)=")  # `fn(name=...)`, how the library's errors begin


def _check_with_library(where: str, sync_period: int, num_fragments: int, overlap: int) -> None:
  """Builds ``streaming_diloco`` with H, F and τ, so that its rules (``overlap < sync_period``)
  hold here; its ``ValueError`` is raised again under ``where`` and the argument it names."""
  try:
    optax_dist.streaming_diloco(optax.identity(), optax.identity(), sync_period=sync_period,
                                num_fragments=num_fragments, overlap=overlap)
  except ValueError as e:
    raise ValueError(f"`{where}({_ARGUMENT.match(str(e))[1]}=...)`: {e}") from None


def _schedule(method: str, num_params: float, sync_period: int, num_fragments: int,
              overlap: int) -> tuple[float, float, int]:
  """``(values per exchange V, period p in steps, hidden steps τ')`` of ``method``."""
  if method == "sync":
    return num_params, 1.0, 0
  if method == "diloco":
    return num_params, float(sync_period), 0
  fragment, period = num_params / num_fragments, sync_period / num_fragments
  return fragment, period, (overlap if method == "streaming_diloco_overlap" else 0)


def _ring(values: float, bits: float, num_replicas: int) -> tuple[float, float]:
  """``(bits each replica sends, its 2 (M − 1) messages)`` in a ring all-reduce of ``values``."""
  m = num_replicas
  return 2 * (m - 1) / m * values * bits, 2 * (m - 1)


def plan(*, num_params: float, step_time: float, bandwidth: float, latency: float = 0.0,
         sync_period: int = 100, num_fragments: int = 1, overlap: int = 0, bits: float = 32,
         num_replicas: int = 2, backward_overlap: float = 0.0,
         methods: Sequence[str] = METHODS) -> dict[str, MethodPlan]:
  """Each method's bytes, exchange time, wall-clock per step and compute utilization.

  The model is the module's (:mod:`optax_dist.planner`): ring all-reduces, data parallel every
  step, DiLoCo every H steps blocking, Streaming DiLoCo 1 / F of the params every H / F steps,
  with the overlap τ hiding up to τ · ``step_time`` of each exchange.

  Args:
    num_params: values in the model (N); a fragment holds N / F of them.
    step_time: seconds of compute per step on each replica (T), including the reductions within
      the replica.
    bandwidth: bit/s of the link between replicas (W); ``math.inf`` for a free link.
    latency: seconds per message (λ); a ring all-reduce sends 2 (M − 1) messages in sequence.
    sync_period: inner steps between two syncs of the same params (H), as
      ``diloco(sync_period=...)``.
    num_fragments: fragments of ``streaming_diloco`` (F), synced in turn, one every H / F steps.
    overlap: inner steps (τ) between sending a fragment and applying its outer update, as
      ``streaming_diloco(overlap=...)``; used by ``streaming_diloco_overlap`` only.
    bits: bits per exchanged value, for every method (32: float32, 16: bfloat16, 4: float4; add
      the scales' share for blocked quantization).
    num_replicas: replicas in the ring (M); 1 exchanges nothing.
    backward_overlap: fraction of the step (β, in [0, 1]) at its end during which an exchange
      started by that step already runs (2/3: from the start of the backward pass; 0: after the
      step).
    methods: names among :data:`METHODS`.

  Returns:
    ``{method: MethodPlan}`` in the order of ``methods``.

  Raises:
    ValueError: naming the argument, the constraint and the value, for a non-positive count,
      time, bandwidth or ``bits``, a negative latency or overlap, a ``backward_overlap`` outside
      [0, 1], or an unknown method; for settings ``optax_dist.streaming_diloco`` refuses
      (``overlap >= sync_period``), its own message after ``plan``'s argument.

  Examples:
    >>> from optax_dist.planner import plan
    >>> p = plan(num_params=1e9, step_time=0.1, bandwidth=1e9, bits=16, sync_period=100,
    ...          methods=("diloco",))["diloco"]
    >>> p.exchange_time  # 2 GB over 1 Gbit/s, two replicas
    16.0
    >>> round(p.utilization, 3)  # 10 s of compute, then 16 s of exchange
    0.385
  """
  methods = _check("plan", num_params=num_params, step_time=step_time, latency=latency,
                   sync_period=sync_period, num_fragments=num_fragments, overlap=overlap,
                   bits=bits, num_replicas=num_replicas, backward_overlap=backward_overlap,
                   methods=methods)
  if not (_real(bandwidth) and bandwidth > 0):
    raise _fail("plan", "bandwidth", "a positive number of bit/s (math.inf allowed)", bandwidth)
  plans = {}
  for method in methods:
    values, period, hidden = _schedule(method, num_params, sync_period, num_fragments, overlap)
    sent_bits, messages = _ring(values, bits, num_replicas)
    exchange_time = sent_bits / bandwidth + messages * latency
    window = min((backward_overlap + hidden) * step_time, period * step_time)
    stall = max(0.0, exchange_time - window)
    wall = step_time + stall / period
    plans[method] = MethodPlan(
      method=method, period=period, exchange_bytes=sent_bits / 8,
      bytes_per_step=sent_bits / 8 / period, exchange_time=exchange_time, stall_time=stall,
      wall_time=wall, utilization=step_time / wall,
    )
  return plans


def required_bandwidth(*, num_params: float, step_time: float, latency: float = 0.0,
                       sync_period: int = 100, num_fragments: int = 1, overlap: int = 0,
                       bits: float = 32, num_replicas: int = 2, backward_overlap: float = 0.0,
                       target_utilization: float = 0.95,
                       methods: Sequence[str] = METHODS) -> dict[str, float]:
  """The bandwidth (bit/s) at which each method reaches ``target_utilization``.

  Closed form of :func:`plan`'s model (the module docstring's W_u): the smallest bandwidth whose
  stall per exchange is at most ``period · step_time · (1 / target_utilization − 1)``. Plugging it
  back into :func:`plan` gives ``target_utilization`` (when it is reachable at all). The other
  arguments are :func:`plan`'s.

  Args:
    target_utilization: the compute utilization to reach, in (0, 1].

  Returns:
    ``{method: bit/s}`` in the order of ``methods``: ``math.inf`` when latency alone keeps the
    utilization below the target, ``0.0`` when there is nothing to send (one replica).

  Raises:
    ValueError: as :func:`plan`, and for a ``target_utilization`` outside (0, 1].

  Examples:
    >>> from optax_dist.planner import required_bandwidth
    >>> w = required_bandwidth(num_params=1e9, step_time=0.1, bits=16, backward_overlap=2 / 3,
    ...                        methods=("sync",))["sync"]
    >>> round(w / 1e9, 1)  # Gbit/s for data parallel at 95% (the paper: 222)
    222.4
  """
  methods = _check("required_bandwidth", num_params=num_params, step_time=step_time,
                   latency=latency, sync_period=sync_period, num_fragments=num_fragments,
                   overlap=overlap, bits=bits, num_replicas=num_replicas,
                   backward_overlap=backward_overlap, methods=methods)
  if not (_real(target_utilization) and 0 < target_utilization <= 1):
    raise _fail("required_bandwidth", "target_utilization", "in (0, 1]", target_utilization)
  needed = {}
  for method in methods:
    values, period, hidden = _schedule(method, num_params, sync_period, num_fragments, overlap)
    sent_bits, messages = _ring(values, bits, num_replicas)
    window = min((backward_overlap + hidden) * step_time, period * step_time)
    allowed = period * step_time * (1 / target_utilization - 1) + window - messages * latency
    if sent_bits == 0:
      needed[method] = 0.0
    elif allowed <= 0:
      needed[method] = math.inf
    else:
      needed[method] = sent_bits / allowed
  return needed
