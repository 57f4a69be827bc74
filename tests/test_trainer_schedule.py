"""The trainer's two compiled steps: the static ``communicate`` hint it takes from each
algorithm's schedule (:data:`optax_dist.cli.algorithms.ALGORITHMS`, the library's schedule
functions) must agree with each transformation's counter rule.

Each algorithm with a schedule is trained on digits, in process on the 8 emulated devices, and
the compiled step the trainer calls at each step (the one for ``communicate=True`` or ``False``)
is recorded: the hints are the library's schedule at the transformation's count (steps from 1),
which :mod:`tests.test_communication_hint` shows gives the counter rule's results. streaming_diloco
(whose hint also picks the fragment) is trained a second time with the counter rule (its
``schedule`` removed, so one step with the conditional is compiled): the final params and
optimizer state agree to float rounding; a hint one step off the rule moves them by orders of
magnitude more. diloco's sync steps run the step without the exchange and then an exchange
program: the same params and state as a second compiled step, bit for bit in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import pytest

import optax_dist
from optax_dist.cli import algorithms, trainer
from optax_dist.cli.algorithms import ALGORITHMS
from optax_dist.cli.config import Settings
from optax_dist.cli.tasks import TASKS

CASES = {
  "elastic_average": {"communication_period": 3},
  "agn": {"communication_period": 3},
  "local_sgd": {"sync_period": 3, "warmup_steps": 2},
  "diloco": {"sync_period": 4},
  "streaming_diloco": {"sync_period": 4, "num_fragments": 2},
}

LIBRARY = {  # each algorithm's schedule, called as the library documents it
  "elastic_average": lambda s, t: optax_dist.elastic_average_communicates(
    t, communication_period=s.communication_period),
  "agn": lambda s, t: optax_dist.agn_communicates(t, communication_period=s.communication_period),
  "local_sgd": lambda s, t: optax_dist.local_sgd_syncs(
    t, sync_period=s.sync_period, warmup_steps=s.warmup_steps),
  "diloco": lambda s, t: optax_dist.diloco_syncs(t, sync_period=s.sync_period),
  "streaming_diloco": lambda s, t: optax_dist.streaming_diloco_syncs(
    t, sync_period=s.sync_period, num_fragments=s.num_fragments),
}


def trained(name, **kwargs):
  """The result of training ``name`` on digits for 12 steps (:data:`CASES`' periods)."""
  task = TASKS["digits"]
  settings = Settings(algorithm=name, steps=12, eval_every=12, batch_size=8, **CASES[name],
                      **kwargs)
  return trainer.train(task, task.load(0), settings, keep_state=True)


def test_the_table_schedules_are_the_library_schedules():
  """Every algorithm with a period has the library's schedule; the others have none."""
  assert set(LIBRARY) == {n for n, a in ALGORITHMS.items() if a.schedule is not None}
  assert set(LIBRARY) == {n for n, a in ALGORITHMS.items() if a.period_name is not None}
  for name in LIBRARY:
    settings = Settings(algorithm=name, steps=40, **CASES[name]).resolved()
    table = [ALGORITHMS[name].communicates(settings, t) for t in range(1, 41)]
    assert table == [bool(LIBRARY[name](settings, t)) for t in range(1, 41)], name
  for name in set(ALGORITHMS) - set(LIBRARY):
    assert ALGORITHMS[name].communicates(Settings(algorithm=name).resolved(), 1) is None


class Recorded:
  """A compiled step that appends its ``communicate`` hint to ``calls`` when called."""

  def __init__(self, compiled, hint, calls):
    self.compiled, self.hint, self.calls = compiled, hint, calls

  def __call__(self, *args):
    self.calls.append(self.hint)
    return self.compiled(*args)

  def __getattr__(self, name):
    return getattr(self.compiled, name)


class Synced(Recorded):
  """The exchange program of a sync step run apart (``diloco``): called after the step compiled
  with ``communicate=False``, it makes that step's entry ``True``."""

  def __call__(self, *args):
    self.calls[-1] = True
    return self.compiled(*args)


def record_steps(monkeypatch) -> list[bool | None]:
  """The ``communicate`` hint of each compiled step the trainer calls, in order (from now on)."""
  calls = []
  add_step, compile_sync = trainer.Run._add_step, trainer.Run._compile_sync

  def recorded_sync(run):
    compile_sync(run)
    run._sync = Synced(run._sync, True, calls)

  monkeypatch.setattr(trainer.Run, "_add_step", lambda run, hint, compiled: add_step(
    run, hint, Recorded(compiled, hint, calls)))
  monkeypatch.setattr(trainer.Run, "_compile_sync", recorded_sync)
  return calls


@functools.cache
def hinted(name):
  """``(calls, result)``: the hints of the compiled steps the trainer called in ``trained(name)``,
  and its result (trained once per process: the diloco run serves two tests)."""
  with pytest.MonkeyPatch.context() as m:
    calls = record_steps(m)
    return calls, trained(name)


@pytest.mark.parametrize("name", list(CASES))
def test_hinted_steps_train_as_the_counter_rule(name, monkeypatch):
  settings = Settings(algorithm=name, steps=12, **CASES[name]).resolved()
  schedule = [bool(LIBRARY[name](settings, t)) for t in range(1, 13)]
  assert any(schedule) and not all(schedule)
  calls, result = hinted(name)
  assert calls == schedule
  if name != "streaming_diloco":
    return
  monkeypatch.setitem(algorithms.ALGORITHMS, name,
                      dataclasses.replace(ALGORITHMS[name], schedule=None))
  ruled = trained(name)["final_state"]
  chex.assert_trees_all_close(result["final_state"], ruled, rtol=1e-5, atol=1e-6)


def test_diloco_s_sync_apart_from_the_step_is_the_in_step_sync(monkeypatch):
  """diloco's sync steps run the step compiled with ``communicate=False`` then the exchange
  program (:func:`optax_dist.diloco_synchronize`): in float32 the params and state are those of
  a second step compiled with ``communicate=True``, bit for bit, with quantized payloads and
  error feedback across replicas too, and the bytes recorded for a sync step are that step's."""
  cases = [{}, {"replicas": 2, "devices": 4, "comm_dtype": "int8", "comm_block_size": 8,
                "error_feedback": True}]
  assert CASES["diloco"] == {"sync_period": 4}  # the first case is test_hinted_...[diloco]'s run
  for kwargs in cases:
    if kwargs:
      with monkeypatch.context() as m:
        calls = record_steps(m)
        apart = trained("diloco", **kwargs)
    else:
      calls, apart = hinted("diloco")
    assert calls == [t % 4 == 0 for t in range(1, 13)]
    with monkeypatch.context() as m:
      m.setitem(algorithms.ALGORITHMS, "diloco",
                dataclasses.replace(ALGORITHMS["diloco"], synchronize=None))
      in_step = trained("diloco", **kwargs)
    chex.assert_trees_all_equal(apart["final_state"], in_step["final_state"])
    assert apart["collective_bytes"] == in_step["collective_bytes"], kwargs


def test_communication_rounds_count_the_schedule():
  local_sgd, streaming = ALGORITHMS["local_sgd"], ALGORITHMS["streaming_diloco"]
  settings = Settings(algorithm="local_sgd", steps=12, sync_period=3, warmup_steps=2).resolved()
  # warm-up steps 1 and 2 all-reduce; the averages are on steps 5, 8 and 11
  assert [t for t in range(1, 13) if local_sgd.communicates(settings, t)] == [5, 8, 11]
  assert local_sgd.communication_rounds(settings, 12) == 2 + 3
  settings = Settings(algorithm="streaming_diloco", sync_period=4, num_fragments=2).resolved()
  assert [t for t in range(1, 13) if streaming.communicates(settings, t)] == [2, 4, 6, 8, 10, 12]
  assert ALGORITHMS["sync"].communication_rounds(Settings().resolved(), 7) == 7
