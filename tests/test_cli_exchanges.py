"""The command's exchange options reach the library's transformations, and bad ones are refused.

``--comm-dtype`` (float or block-quantized), ``--comm-block-size``, ``--error-feedback``,
``--overlap``, ``--eager`` and ``--mixing``: parsed into the settings, built by
:func:`optax_dist.cli.algorithms.make_optimizer` into the same transformation as the library's
own built by hand, recorded in the results, and refused with a one-line error naming the flag,
the value and the algorithm where the algorithm does not take them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_dist
from optax_dist._quantize import wire_bytes

pytest.importorskip("flax")
pytest.importorskip("sklearn")

from optax_dist.cli import trainer  # noqa: E402
from optax_dist.cli.algorithms import AXIS, inner_optimizer, make_optimizer  # noqa: E402
from optax_dist.cli.checks import check_settings  # noqa: E402
from optax_dist.cli.config import DEFAULTS, Settings, settings_of  # noqa: E402
from optax_dist.cli.main import build_parser, main  # noqa: E402
from optax_dist.cli.runs import initial_params  # noqa: E402
from optax_dist.cli.tasks import TASKS  # noqa: E402

WORKERS = 4
EXCHANGE = ("comm_dtype", "comm_block_size", "error_feedback", "overlap", "eager", "mixing")


def _settings(*flags: str) -> Settings:
  return settings_of(build_parser().parse_args(["train", *flags]), TASKS["digits"])


def test_flags_reach_the_settings_with_the_library_s_defaults():
  s = _settings("--algorithm", "streaming_diloco", "--comm-dtype", "e3m0", "--comm-block-size",
                "64", "--overlap", "2", "--eager", "--mixing", "0.25")
  assert (s.comm_dtype, s.comm_block_size, s.overlap, s.eager, s.mixing) == (
    "e3m0", 64, 2, True, 0.25)
  assert _settings("--algorithm", "diloco", "--comm-dtype", "int8",
                   "--error-feedback").error_feedback
  d = _settings()
  assert (d.comm_dtype, d.comm_block_size, d.error_feedback, d.overlap, d.eager, d.mixing) == (
    None, 256, False, 0, False, 0.0)


def _hand_built(s: Settings, params) -> optax.GradientTransformation:
  """The library's transformation of ``s``, built by hand from its documented arguments."""
  inner, outer = inner_optimizer(s), optax.sgd(0.7, momentum=0.9, nesterov=True)
  block = s.comm_block_size if s.comm_dtype in ("int8", "float4_e2m1fn", "e3m0") else None
  comm = {"comm_dtype": s.comm_dtype, "comm_block_size": block}
  if s.algorithm == "diloco":
    return optax_dist.diloco(inner, outer, sync_period=s.sync_period, axis_name=AXIS,
                             error_feedback=s.error_feedback, **comm)
  if s.algorithm == "streaming_diloco":
    return optax_dist.streaming_diloco(
      inner, outer, sync_period=s.sync_period, num_fragments=s.num_fragments,
      fragments="balanced", mixing=s.mixing, overlap=s.overlap, eager=s.eager, axis_name=AXIS,
      error_feedback=s.error_feedback, **comm)
  if s.algorithm == "local_sgd":
    return optax_dist.local_sgd(inner, sync_period=s.sync_period, axis_name=AXIS, **comm)
  if s.algorithm == "elastic_average":
    return optax_dist.elastic_average(inner, communication_period=s.communication_period,
                                      moving_rate=s.moving_rate, axis_name=AXIS, **comm)
  if s.algorithm == "agn":
    return optax_dist.agn(inner, communication_period=s.communication_period, axis_name=AXIS,
                          **comm)
  return optax_dist.tower(inner, AXIS, comm_dtype=s.comm_dtype)


CASES = {
  "diloco int8, blocks of 8, error feedback": dict(
    algorithm="diloco", comm_dtype="int8", comm_block_size=8, error_feedback=True),
  "streaming_diloco e3m0, overlap 1, eager, mixing": dict(
    algorithm="streaming_diloco", comm_dtype="e3m0", comm_block_size=8, num_fragments=2,
    overlap=1, eager=True, mixing=0.25),
  "streaming_diloco int8, error feedback": dict(
    algorithm="streaming_diloco", comm_dtype="int8", comm_block_size=8, num_fragments=2,
    error_feedback=True),
  "local_sgd float4_e2m1fn": dict(algorithm="local_sgd", comm_dtype="float4_e2m1fn",
                                  comm_block_size=8),
  "elastic_average int8": dict(algorithm="elastic_average", comm_dtype="int8",
                               comm_block_size=16),
  "agn e3m0": dict(algorithm="agn", comm_dtype="e3m0", comm_block_size=8),
  "sync float8_e4m3fn": dict(algorithm="sync", comm_dtype="float8_e4m3fn"),
}


def _trajectory(tx, params, grads, steps: int):
  """Each step's updates (stacked, steps first) and the final state of ``tx`` over ``WORKERS``
  vmapped workers, fed the same per-worker gradients scaled by the step: one compiled program
  (a ``lax.scan`` over the steps), not one per operation as an eager run compiles."""

  def run(params, grads):
    def step(carry, t):
      params, state = carry
      updates, state = tx.update(jax.tree.map(lambda g: g * t, grads), state, params)
      return (optax.apply_updates(params, updates), state), updates

    (_, state), out = jax.lax.scan(step, (params, tx.init(params)),
                                   jnp.arange(1, steps + 1, dtype=jnp.float32))
    return out, state

  return jax.jit(jax.vmap(run, axis_name=AXIS))(params, grads)


@pytest.mark.parametrize("case", CASES)
def test_make_optimizer_builds_the_library_s_transformation(case):
  """Same updates and state, bit for bit, as the library's built by hand with the options; and
  unlike the default exchange's (the options change the numbers)."""
  s = Settings(devices=WORKERS, steps=8, sync_period=4, communication_period=2,
               learning_rate=0.1, optimizer="sgd", **CASES[case]).resolved()
  rng = np.random.default_rng(0)
  shapes = {"w": (6, 7), "b": (7,)}
  one = {k: rng.normal(size=v).astype(np.float32) for k, v in shapes.items()}
  params = jax.tree.map(lambda p: np.broadcast_to(p, (WORKERS, *p.shape)), one)
  # Magnitudes over four decades within each leaf: the block size changes the rounding.
  grads = {k: (rng.normal(size=(WORKERS, *v)) * np.logspace(-3, 1, np.prod(v)).reshape(v))
           .astype(np.float32) for k, v in shapes.items()}
  got = _trajectory(make_optimizer(s), params, grads, 6)
  want = _trajectory(_hand_built(s, one), params, grads, 6)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  plain = dataclasses.replace(s, **{k: DEFAULTS[k] for k in EXCHANGE})
  default = _trajectory(_hand_built(plain, one), params, grads, 6)[0]
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got[0]),
                                                        jax.tree.leaves(default)))


def test_quantized_run_sends_codes_and_scales_and_records_the_options():
  """A 2-step digits run of diloco with int8 in blocks of 32 and error feedback: the sync step
  sends int8 codes and float32 scales, 1/4 of float32's bytes plus 4 bytes per block; the
  results record the options."""
  task = TASKS["digits"]
  s = Settings(algorithm="diloco", devices=WORKERS, steps=2, sync_period=2, eval_every=2,
               batch_size=8, comm_dtype="int8", comm_block_size=32, error_feedback=True)
  result = trainer.train(task, task.load(0), s, keep_state=True)
  final = result["final_state"]
  assert {k: result[k] for k in ("comm_dtype", "comm_block_size", "error_feedback")} == {
    "comm_dtype": "int8", "comm_block_size": 32, "error_feedback": True}
  assert final["opt_state"].error_feedback is not None
  sizes = [x.size // WORKERS for x in jax.tree.leaves(final["params"])]
  steps = result["collective_bytes"]
  sync = (steps["communication_step"]["unconditional"][AXIS]
          - steps["non_communication_step"]["unconditional"][AXIS])  # less the loss' mean
  assert sync == wire_bytes(sum(sizes), "int8", 32)  # every leaf end to end, one last block
  assert sum(4 * n for n in sizes) / sync > 3.5  # about 4x fewer than float32's


def test_quantized_exchange_across_replicas_over_a_float32_tower():
  """diloco in int8 across 2 replicas: the tower within a replica reduces in float32 (as many
  bytes as without the format) and each device sends only the int8 codes and scales of its
  slice across replicas."""
  task = TASKS["digits"]
  common = dict(algorithm="diloco", devices=WORKERS, replicas=2, steps=2, sync_period=2,
                eval_every=2, batch_size=8)
  runs = {c: trainer.train(task, task.load(0), Settings(**common, comm_dtype=c,
                                                        comm_block_size=32 if c else 256))
          for c in (None, "int8")}
  example = tuple((k, (1,) + v.shape[1:], str(v.dtype)) for k, v in task.load(0).train.items())
  sizes = [np.size(p) for p in jax.tree.leaves(initial_params(task, 0, example))]
  plain, quantized = (runs[c]["collective_bytes"]["communication_step"]["unconditional"]
                      for c in (None, "int8"))
  k = WORKERS // 2  # devices per replica, each sending its 1/k slice across
  assert quantized["data"] == plain["data"]  # within a replica: float32 either way
  assert plain["replica"] == sum(4 * -(-n // k) for n in sizes)
  assert quantized["replica"] == wire_bytes(sum(-(-n // k) for n in sizes), "int8", 32)


REFUSED = {
  "sync with int8": (["--algorithm", "sync", "--comm-dtype", "int8"],
                     "argument --comm-dtype: sync takes float32, bfloat16, float8_e4m3fn only,"
                     " got int8"),
  "compare with e3m0": (["--comm-dtype", "e3m0"], "argument --comm-dtype: sync takes"),
  "error feedback on elastic_average": (
    ["--algorithm", "elastic_average", "--comm-dtype", "int8", "--error-feedback"],
    "argument --error-feedback: elastic_average does not take it (only diloco,"
    " streaming_diloco), got --error-feedback"),
  "error feedback in float32": (["--algorithm", "diloco", "--error-feedback"],
                                "argument --error-feedback: `diloco(error_feedback=True)` needs a"
                                " quantized comm_dtype"),
  "overlap on diloco": (["--algorithm", "diloco", "--overlap", "1"],
                        "argument --overlap: diloco does not take it (only streaming_diloco),"
                        " got --overlap 1"),
  "mixing on local_sgd": (["--algorithm", "local_sgd", "--mixing", "0.5"],
                          "argument --mixing: local_sgd does not take it"),
  "eager on diloco": (["--algorithm", "diloco", "--eager"],
                      "argument --eager: diloco does not take it"),
  "eager without overlap": (["--algorithm", "streaming_diloco", "--eager"],
                            "argument --eager: `streaming_diloco(eager=True)` needs overlap >= 1"),
  "overlap as long as the period": (
    ["--algorithm", "streaming_diloco", "--sync-period", "5", "--overlap", "5"],
    "argument --overlap: `streaming_diloco(overlap=...)` must be an int in [0, sync_period) ="
    " [0, 5)"),
  "block size on a float exchange": (["--algorithm", "diloco", "--comm-block-size", "64"],
                                     "argument --comm-block-size: sets the blocks of a"
                                     " block-quantized --comm-dtype"),
  "block size on sync": (["--algorithm", "sync", "--comm-block-size", "64"],
                         "argument --comm-block-size: sync does not take it"),
  "odd blocks of 4-bit codes": (
    ["--algorithm", "agn", "--comm-dtype", "e3m0", "--comm-block-size", "7"],
    "argument --comm-block-size: `agn(comm_block_size=...)` must be even with"
    " comm_dtype='e3m0'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_bad_combinations_are_one_line_errors(case, tmp_path, capsys):
  flags, message = REFUSED[case]
  command = "train" if "--algorithm" in flags else "compare"
  assert main([command, *flags, "--out", str(tmp_path), "--no-progress"]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.startswith(f"optax-dist: error: {message}"), captured.err
  assert len(captured.err.strip().splitlines()) == 1
  with pytest.raises(ValueError, match="argument --"):  # train() refuses them too
    settings = settings_of(build_parser().parse_args([command, *flags]), TASKS["digits"])
    check_settings(settings, (settings.algorithm,), processes=1, train_examples=lambda: 1000)
