"""Communication accounting: the collectives a compiled step issues, and their bytes.

The compiled program is read from XLA's HLO text (``jax.jit(fn).lower(...).compile().as_text()``),
after XLA's passes have combined, split or removed collectives: what is counted is what runs.
The text is parsed into computations; the walk starts at the ``ENTRY`` computation and follows
the computations each instruction calls (fusions, calls, ``while`` bodies, ``conditional``
branches, async wrappers), remembering which ``conditional`` branches and which loops enclose
each collective.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

KINDS = (
  "all-reduce",
  "all-gather",
  "reduce-scatter",
  "collective-permute",
  "all-to-all",
  "ragged-all-to-all",
  "collective-broadcast",
)
"""The HLO collectives counted (their synchronous opcodes; ``-start``/``-done`` pairs count once)."""


# ----------------------------------------------------------------------------------------------
# The report's types.


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  Attributes:
    kind: the collective, one of ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
      ``"collective-permute"``, ``"all-to-all"``, ``"ragged-all-to-all"``,
      ``"collective-broadcast"`` (an async ``-start``/``-done`` pair is one collective).
    name: the HLO instruction's name, e.g. ``"all-reduce.3"``.
    computation: the name of the HLO computation holding it.
    shapes: the operands' shapes without layouts, e.g. ``("f32[4,3]", "f32[5]")``: XLA combines
      collectives, so one instruction may carry a whole tree.
    bytes: the operands' bytes (elements × itemsize, summed over a tuple): what each device
      contributes per execution.
    result_bytes: the result's bytes per device (for ``all-gather``, :math:`N` times ``bytes``).
    conditionals: the enclosing ``conditional`` branches, outermost first, each as
      ``(conditional instruction name, branch index)``; empty for a collective that runs on
      every execution of the program. Branch indices are XLA's: for an ``int32`` index, the
      index (``lax.cond``'s false branch is 0); for a ``pred``, 0 is the true branch.
    trip_count: how many times it runs per execution of the program: the product of the known
      trip counts of the enclosing ``while`` loops (1 outside loops), or ``None`` if a loop's
      trip count is unknown.
    groups: the groups of devices that communicate together (the HLO's ``replica_groups``, as
      positions in the program's device assignment: for a program jitted over a mesh, indices
      into ``mesh.devices.flat``); empty where the HLO gives none (all devices together).
  """

  kind: str
  name: str
  computation: str
  shapes: tuple[str, ...]
  bytes: int
  result_bytes: int
  conditionals: tuple[tuple[str, int], ...] = ()
  trip_count: int | None = 1
  groups: tuple[tuple[int, ...], ...] = ()

  def axes(self, mesh: Any) -> tuple[str, ...]:
    """The axes of ``mesh`` the collective spans: those along which the devices of one of its
    groups differ (all of them where the HLO gives no groups). ``()`` for a collective within
    single devices.

    Raises:
      ValueError: a group names a device position outside ``mesh``.
    """
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    if not self.groups:
      return tuple(n for n, size in zip(names, shape, strict=True) if size > 1)
    size = int(np.prod(shape))
    spanned = set()
    for group in self.groups:
      if any(not 0 <= d < size for d in group):
        raise ValueError(
          f"`Collective.axes(mesh)`: {self.name} groups devices {group}, outside a mesh of"
          f" {size} devices {dict(zip(names, shape, strict=True))}; pass the mesh the program"
          " was compiled for."
        )
      coords = np.array(np.unravel_index(np.array(group), shape)).T
      spanned |= {names[a] for a in range(len(shape)) if len(set(coords[:, a])) > 1}
    return tuple(n for n in names if n in spanned)


@dataclasses.dataclass(frozen=True)
class Collectives:
  """A sequence of :class:`Collective` with their totals.

  ``count`` and ``bytes`` count each collective once per execution of the program: a collective
  inside a loop of known trip count :math:`T` counts :math:`T` times (once if :math:`T` is
  unknown).

  Attributes:
    items: the collectives, in program order.
  """

  items: tuple[Collective, ...] = ()

  def __iter__(self) -> Iterator[Collective]:
    return iter(self.items)

  def __len__(self) -> int:
    return len(self.items)

  def __bool__(self) -> bool:
    return bool(self.items)

  @property
  def count(self) -> int:
    """The number of collective executions."""
    return sum(_times(c) for c in self.items)

  @property
  def bytes(self) -> int:
    """The operands' bytes, summed over the executions."""
    return sum(_times(c) * c.bytes for c in self.items)

  @property
  def result_bytes(self) -> int:
    """The results' bytes, summed over the executions."""
    return sum(_times(c) * c.result_bytes for c in self.items)

  def of_kind(self, kind: str) -> Collectives:
    """The collectives of one kind (e.g. ``"all-reduce"``)."""
    if kind not in KINDS:
      raise ValueError(
        f"`Collectives.of_kind(kind=...)` must be one of {', '.join(map(repr, KINDS))},"
        f" got {kind!r}."
      )
    return Collectives(tuple(c for c in self.items if c.kind == kind))

  def over(self, mesh: Any, axes: str | tuple[str, ...]) -> Collectives:
    """The collectives that span exactly the mesh ``axes`` (a name or a tuple of names, in the
    mesh's order), e.g. ``over(mesh, "replica")`` for the exchanges across replicas."""
    wanted = (axes,) if isinstance(axes, str) else tuple(axes)
    return Collectives(tuple(c for c in self.items if c.axes(mesh) == wanted))

  def by_axes(self, mesh: Any) -> dict[tuple[str, ...], tuple[int, int]]:
    """``{mesh axes: (count, bytes)}``: how much crosses each set of axes (e.g. inside a replica
    and across replicas apart)."""
    keys = dict.fromkeys(c.axes(mesh) for c in self.items)
    return {k: (self.over(mesh, k).count, self.over(mesh, k).bytes) for k in keys}

  def by_kind(self) -> dict[str, tuple[int, int]]:
    """``{kind: (count, bytes)}`` for each kind present."""
    kinds = dict.fromkeys(c.kind for c in self.items)
    return {k: (self.of_kind(k).count, self.of_kind(k).bytes) for k in kinds}

  def __str__(self) -> str:
    if not self.items:
      return "none"
    return ", ".join(f"{n} {k} ({b:,} B)" for k, (n, b) in self.by_kind().items())


def _times(c: Collective) -> int:
  return 1 if c.trip_count is None else c.trip_count


@dataclasses.dataclass(frozen=True)
class CommunicationReport:
  """The collectives of a compiled program, by the steps that execute them.

  A training step with periodic communication (:func:`elastic_average`, :func:`agn`,
  :func:`accumulate_then_reduce`) puts its collectives inside a ``conditional`` whose predicate
  is only known at run time. The report separates the collectives every execution runs
  (``unconditional``) from those inside ``conditional`` branches (``conditional``), and names
  the two paths through the branches: at every ``conditional``, ``communication_step`` takes the
  branch issuing the most bytes and ``non_communication_step`` the branch issuing the fewest
  (for the transformations here, the branch with the collectives and the one without).

  :attr:`per_conditional` gives each ``conditional``'s collectives apart: the bytes of one
  exchange of each periodic transformation (e.g. a tower's per-step all-reduce and a DiLoCo
  sync in the same step function, or each fragment of ``streaming_diloco``).

  Attributes:
    collectives: every collective of the program, in program order.
    communication_step: the collectives of an execution that takes, at each ``conditional``,
      the branch with the most bytes (the unconditional ones included): an upper bound on one
      step where the conditionals communicate on different steps.
    non_communication_step: likewise with the fewest bytes.
  """

  collectives: Collectives
  communication_step: Collectives
  non_communication_step: Collectives

  @property
  def unconditional(self) -> Collectives:
    """The collectives outside every ``conditional`` branch: they run on every step."""
    return Collectives(tuple(c for c in self.collectives if not c.conditionals))

  @property
  def conditional(self) -> Collectives:
    """The collectives inside a ``conditional`` branch: they run on some steps only."""
    return Collectives(tuple(c for c in self.collectives if c.conditionals))

  @property
  def per_conditional(self) -> dict[str, Collectives]:
    """For each ``conditional`` holding collectives, those of its costliest branch.

    Keyed by the innermost enclosing ``conditional``'s HLO name, in program order. Each entry
    is what one periodic exchange issues when it happens: a ``streaming_diloco`` step shows one
    entry per fragment (each about params / F bytes), a ``diloco(tower(...))`` step shows the
    tower's all-reduce under ``unconditional`` and the DiLoCo sync as one entry. (The
    ``communication_step`` total adds every conditional's costliest branch, as if all of them
    ran on one step: an upper bound where, as for the fragments, they run on different steps.)
    """
    branches: dict[str, dict[int, list[Collective]]] = {}
    for c in self.conditional:
      name, index = c.conditionals[-1]
      branches.setdefault(name, {}).setdefault(index, []).append(c)
    return {
      name: Collectives(tuple(max(by_index.values(), key=lambda b: Collectives(tuple(b)).bytes)))
      for name, by_index in branches.items()
    }

  @classmethod
  def from_hlo_text(cls, text: str) -> CommunicationReport:
    """The report of a compiled HLO module given as text (``Compiled.as_text()``)."""
    module = _parse_module(text)
    return cls(
      collectives=Collectives(tuple(_walk(module, "all"))),
      communication_step=Collectives(tuple(_walk(module, "max"))),
      non_communication_step=Collectives(tuple(_walk(module, "min"))),
    )

  def __str__(self) -> str:
    lines = [f"every step: {self.unconditional}"]
    lines += [f"when {name} communicates: {c}" for name, c in self.per_conditional.items()]
    lines += [
      f"communication step: {self.communication_step}",
      f"non-communication step: {self.non_communication_step}",
    ]
    return "\n".join(lines)


def communication_report(
  fn: Callable[..., Any], *args: Any, stage: str = "compiled", **kwargs: Any
) -> CommunicationReport:
  r"""Compiles ``fn(*args, **kwargs)`` and reports the collectives it issues, and their bytes.

  The step is compiled with ``jax.jit(fn).lower(*args, **kwargs).compile()`` (``fn``'s own
  ``lower`` if it is already jitted) and its HLO text is read: every ``all-reduce``,
  ``all-gather``, ``reduce-scatter``, ``collective-permute`` and ``all-to-all`` that XLA left in
  the program after its optimisations for this backend (it combines small all-reduces into one
  tuple-shaped instruction, removes collectives whose results are unused, and inserts those
  that automatic sharding needs). The bytes of a collective are

  .. math::

    \text{bytes} = \textstyle\sum_{\text{operands}} \text{elements} \times \text{itemsize}

  per device and per execution, and ``result_bytes`` likewise for its result (:math:`N\times`
  the bytes for an ``all-gather`` over :math:`N` devices). Collectives inside ``conditional``
  branches run only on the steps that take the branch: see :class:`CommunicationReport`.

  Arguments need not be concrete: ``jax.ShapeDtypeStruct`` with a ``sharding`` works, so
  nothing is run. Only ``shard_map``/``pmap`` programs (or automatic sharding) issue
  collectives: under ``vmap(axis_name=...)`` a ``psum`` is a plain sum on one device.

  .. note::

    A backend may change a collective's dtype: XLA's CPU compiler widens ``bfloat16``
    collectives to ``float32`` (after rounding the values to ``bfloat16``), so a
    ``comm_dtype=jnp.bfloat16`` exchange shows ``float32`` bytes there (GPU and TPU
    communicate ``bfloat16`` natively). ``stage="lowered"`` reports the collectives as the program
    requests them,
    before any backend pass.

  Args:
    fn: the step to compile, a function of arrays (jitted or not). Static arguments: pass an
      already jitted ``fn`` (``jax.jit(step, static_argnums=...)``).
    args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    stage: ``"compiled"`` (default): the collectives of the program XLA compiled for this
      backend, as they run; ``"lowered"``: those of the program JAX lowered
      (``Lowered.as_text(dialect="hlo")``), one per collective call of the step (a ``psum`` of a
      tree: one per leaf), in the requested dtypes, without those automatic sharding adds.
      (Being keyword-only here, ``fn`` cannot receive a keyword argument named ``stage``: pass
      it bound, e.g. with ``functools.partial``.)
    kwargs: its keyword arguments.

  Returns:
    A :class:`CommunicationReport`. Its ``unconditional`` collectives run on every step; its
    ``communication_step`` and ``non_communication_step`` collect, at every ``conditional``, the
    branch with the most and with the fewest bytes.

  Collectives:
    None: ``fn`` is compiled, not run.

  Raises:
    ValueError: ``stage`` not ``"compiled"`` or ``"lowered"``; the program's text has no
      ``ENTRY`` computation (not an HLO module).

  Examples:
    An all-reduce of a ``float32[3]`` gradient, on one device's mesh:

    >>> import jax, jax.numpy as jnp, optax, optax_dist
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("w",), devices=jax.devices()[:1])
    >>> tx = optax_dist.tower(optax.sgd(0.1), "w")
    >>> step = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
    ...                      in_specs=P("w"), out_specs=P("w"))
    >>> g = jax.device_put(jnp.ones(3), NamedSharding(mesh, P("w")))
    >>> report = optax_dist.communication_report(step, g)
    >>> report.unconditional.count, report.unconditional.bytes
    (1, 12)
    >>> print(report.unconditional)
    1 all-reduce (12 B)

  References:
    XLA, `Operation semantics <https://openxla.org/xla/operation_semantics>`_ (``AllReduce``,
    ``AllGather``, ``ReduceScatter``, ``CollectivePermute``, ``AllToAll``, ``Conditional``).
    JAX, ``jax.stages.Compiled.as_text`` and ``jax.stages.Lowered.as_text``.
  """
  if stage not in ("compiled", "lowered"):
    raise ValueError(
      f"`communication_report(stage=...)` must be one of 'compiled', 'lowered', got {stage!r}."
    )
  lower = getattr(fn, "lower", None)
  lowered = lower(*args, **kwargs) if callable(lower) else jax.jit(fn).lower(*args, **kwargs)
  if stage == "lowered":
    return CommunicationReport.from_hlo_text(lowered.as_text(dialect="hlo"))
  return CommunicationReport.from_hlo_text(lowered.compile().as_text())


# ----------------------------------------------------------------------------------------------
# Parsing HLO text.
#
# A module's text is a list of computations:
#
#   %region_1.2 (param.1: (f32[4,3], f32[5])) -> (f32[4,3], f32[5]) {
#     %all_gather.9 = f32[8,4,3]{2,1,0} all-gather(%fusion.1), channel_id=1, dimensions={0}, ...
#     ROOT %tuple = (f32[4,3]{1,0}, f32[5]{0}) tuple(%a, %b)
#   }
#   ENTRY %main.4 (...) -> ... {
#     %conditional.1 = (...) conditional(%p, %t, %f), branch_computations={%region_0, %region_1}
#   }
#
# An instruction is `[ROOT] %name = <shape> <opcode>(<operands>), <attributes>`, where a shape is
# an array `f32[4,3]{1,0}` or a tuple `(f32[4,3]{1,0}, /*index=5*/f32[5]{0})`. Operands are names
# (`%x`), with their shapes in some printing modes (`f32[4]{0} %x`); a name's shape is found in the
# instruction that defines it, in the same computation. The lowered (not yet compiled) module's
# text drops the `%` and the computations' signatures (`ENTRY main.7 {`).

_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(=]+)\s*(?:\(|\{$)")
_INSTRUCTION = re.compile(r"^(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][\w\-.]*)\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLEE = re.compile(
  r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([^\s,{}()]+)"
)
_CALLEE_LIST = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str


@dataclasses.dataclass
class _Module:
  entry: str
  computations: dict[str, list[_Instruction]]


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at ``text[start]``."""
  depth = 0
  pairs = {"(": ")", "{": "}", "[": "]"}
  closers = set(pairs.values())
  for i in range(start, len(text)):
    if text[i] in pairs:
      depth += 1
    elif text[i] in closers:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _split_top_level(text: str) -> list[str]:
  parts, depth, current = [], 0, []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(current).strip())
      current = []
    else:
      current.append(ch)
  if "".join(current).strip():
    parts.append("".join(current).strip())
  return parts


def _parse_instruction(line: str) -> _Instruction | None:
  m = _INSTRUCTION.match(line)
  if m is None:
    return None
  name, rest = m.group(1), m.group(2)
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    return None
  shape, after = rest[:end], rest[end:]
  op = _OPCODE.match(after)
  if op is None:
    return None
  open_paren = op.end() - 1
  close = _balanced(after, open_paren)
  operands = tuple(_split_top_level(after[open_paren + 1 : close - 1]))
  return _Instruction(name, shape, op.group(1), operands, after[close:])


_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA_GROUPS = re.compile(
  r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
)

_MESH_GROUPS = re.compile(
  r"replica_groups=mesh\[([^\]]*)\]"
  r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?\s*\{([^}]*)\}"
)


def _iota(dims: str, transpose: str | None) -> np.ndarray:
  """XLA's iota list ``[dims]T(transpose)``: ``arange`` reshaped to ``dims``, then transposed."""
  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(int(np.prod(shape))).reshape(shape)
  return ids.transpose([int(a) for a in transpose.split(",")]) if transpose else ids


def _mesh_groups(match: re.Match) -> tuple[tuple[int, ...], ...]:
  """The groups of XLA's mesh form ``mesh['a'=2,'b'=4] {'b'}``: the device positions laid out on
  the named axes (``arange``, or the mesh's ``device_ids``, an iota list ``[2,2,2]T(0,2,1)`` or
  the positions themselves), one group per position on the axes not listed; ``()`` for a form
  read no further (sub-axes such as ``'b':(1)2``)."""
  sizes = dict((name, int(n)) for name, n in re.findall(r"'([^']+)'=(\d+)", match.group(1)))
  grouped = [entry.strip() for entry in match.group(3).split(",") if entry.strip()]
  if not all(re.fullmatch(r"'[^']+'", e) and e[1:-1] in sizes for e in grouped):
    return ()
  names, grouped = list(sizes), [e[1:-1] for e in grouped]
  listed = match.group(2) or ""
  iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", listed)
  if iota:
    ids = _iota(iota.group(1), iota.group(2))
  elif listed:
    ids = np.array([int(d) for d in listed.split(",") if d.strip()])
  else:
    ids = np.arange(int(np.prod(list(sizes.values()))))
  ids = ids.reshape(list(sizes.values()))
  order = [names.index(n) for n in names if n not in grouped] + [names.index(n) for n in grouped]
  size = int(np.prod([sizes[n] for n in grouped]))
  return tuple(tuple(int(d) for d in g) for g in ids.transpose(order).reshape(-1, size))


def _replica_groups(attributes: str) -> tuple[tuple[int, ...], ...]:
  """The ``replica_groups`` of an instruction: explicit (``{{0,4},{1,5}}``), iota
  (``[4,2]<=[2,4]T(1,0)``: the device positions ``arange`` reshaped to the dims, transposed,
  then cut into the groups) or over mesh axes (``mesh['a'=2,'b'=4] {'b'}``, see
  :func:`_mesh_groups`); ``()`` if absent."""
  m = _MESH_GROUPS.search(attributes)
  if m:
    return _mesh_groups(m)
  m = _IOTA_GROUPS.search(attributes)
  if m:
    ids = _iota(m.group(3), m.group(4))
    return tuple(tuple(int(d) for d in g) for g in ids.reshape(int(m.group(1)), int(m.group(2))))
  m = _EXPLICIT_GROUPS.search(attributes)
  if not m:
    return ()
  groups = re.findall(r"\{([\d,\s]*)\}", m.group(1))
  return tuple(tuple(int(d) for d in g.split(",") if d.strip()) for g in groups if g.strip())


def _parse_module(text: str) -> _Module:
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  for raw in text.splitlines():
    line = _COMMENT.sub("", raw).strip()
    if current is None:
      m = _HEADER.match(line)
      if m and line.endswith("{") and " = " not in line and not line.startswith("HloModule"):
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
    elif line == "}":
      current = None
    elif line:
      instruction = _parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError(
      "`communication_report`: the compiled program's text has no ENTRY computation; expected"
      " the HLO text of a compiled module (`jax.jit(fn).lower(...).compile().as_text()`)."
    )
  return _Module(entry, computations)


def _shape_bytes(shape: str) -> int:
  """Bytes of an array or tuple shape: elements × itemsize, summed over the arrays."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in ("token", "opaque"):
      continue
    bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+?(\d+)", dtype).group(1))
    sizes = [int(re.sub(r"[^\d]", "", d) or 0) for d in dims.split(",") if d.strip()]
    total += math.prod(sizes) * bits // 8
  return total


def _strip_layouts(shape: str) -> tuple[str, ...]:
  return tuple(f"{dtype}[{dims}]" for dtype, dims in _ARRAY.findall(shape))


def _callees(instruction: _Instruction) -> list[str]:
  names = [m.group(2) for m in _CALLEE.finditer(instruction.attributes)]
  for m in _CALLEE_LIST.finditer(instruction.attributes):
    names.extend(n.strip().lstrip("%") for n in m.group(2).split(",") if n.strip())
  return names


def _collective_kind(opcode: str) -> str | None:
  if opcode in KINDS:
    return opcode
  if opcode.endswith("-start") and opcode[: -len("-start")] in KINDS:
    return opcode[: -len("-start")]
  return None


def _walk(module: _Module, policy: str) -> list[Collective]:
  """The collectives reached from ENTRY; at a conditional, all branches or the max/min one."""

  def visit(comp: str, conditionals: tuple, trip_count: int | None) -> list[Collective]:
    instructions = module.computations.get(comp, [])
    shapes = {i.name: i.shape for i in instructions}
    done_shapes = {  # the result of an async `-start` is the shape of its `-done`
      i.operands[0].split()[-1].lstrip("%"): i.shape
      for i in instructions
      if i.opcode.endswith("-done") and i.operands
    }
    found: list[Collective] = []
    for ins in instructions:
      kind = _collective_kind(ins.opcode)
      if kind is not None:
        operand_shapes = []
        for operand in ins.operands:
          ref = operand.split()[-1].lstrip("%")
          operand_shapes.append(operand if _ARRAY.search(operand.split("%")[0]) else
                                shapes.get(ref, ""))
        if not any(operand_shapes):  # an unknown operand: an all-reduce's result has its shape
          operand_shapes = [ins.shape]
        result = (done_shapes.get(ins.name, ins.shape) if ins.opcode.endswith("-start")
                  else ins.shape)
        found.append(
          Collective(
            kind=kind,
            name=ins.name,
            computation=comp,
            shapes=tuple(s for o in operand_shapes for s in _strip_layouts(o)),
            bytes=sum(_shape_bytes(o) for o in operand_shapes),
            result_bytes=_shape_bytes(result),
            conditionals=conditionals,
            trip_count=trip_count,
            groups=_replica_groups(ins.attributes),
          )
        )
        continue  # its `to_apply` is a scalar reduction, not communication
      if ins.opcode in ("async-update", "async-done"):
        continue  # the wrapped computation is counted once, at its `async-start`
      callees = _callees(ins)
      if ins.opcode == "conditional":
        branches = [
          visit(branch, conditionals + ((ins.name, index),), trip_count)
          for index, branch in enumerate(_branch_order(ins, callees))
        ]
        if policy == "all":
          found.extend(c for branch in branches for c in branch)
        elif branches:
          pick = max if policy == "max" else min
          found.extend(pick(branches, key=lambda b: (Collectives(tuple(b)).bytes, len(b))))
      elif ins.opcode == "while":
        m = _TRIP_COUNT.search(ins.attributes)
        inner = None if m is None or trip_count is None else trip_count * int(m.group(1))
        for callee in callees:
          found.extend(visit(callee, conditionals, inner))
      else:
        for callee in callees:
          found.extend(visit(callee, conditionals, trip_count))
    return found

  return visit(module.entry, (), 1)


def _branch_order(instruction: _Instruction, callees: list[str]) -> list[str]:
  """A conditional's branches in XLA's index order (a ``pred`` conditional: true, then false)."""
  attributes = instruction.attributes
  m = re.search(r"\bbranch_computations=\{([^}]*)\}", attributes)
  if m:
    return [n.strip().lstrip("%") for n in m.group(1).split(",") if n.strip()]
  true = re.search(r"\btrue_computation=%?([^\s,{}()]+)", attributes)
  false = re.search(r"\bfalse_computation=%?([^\s,{}()]+)", attributes)
  return [g.group(1) for g in (true, false) if g] or callees
