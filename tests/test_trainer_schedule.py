"""The trainer's two compiled steps: the static ``communicate`` hint it derives from
``optax_dist.cli.algorithms.communicates`` must agree with each transformation's counter rule.

Each algorithm with a schedule is trained twice on digits, in process on the 8 emulated devices:
with the hint (the trainer's default) and with the counter rule (``communicates`` patched to give
no hint, so one step with the conditional is compiled). The final params and optimizer state
agree to float rounding; a hint one step off the rule moves them by orders of magnitude more.
"""

from __future__ import annotations

import chex
import pytest

from optax_dist.cli import algorithms, trainer
from optax_dist.cli.config import Settings
from optax_dist.cli.tasks import TASKS

CASES = {
  "elastic_average": {"communication_period": 3},
  "agn": {"communication_period": 3},
  "local_sgd": {"sync_period": 3, "warmup_steps": 2},
  "diloco": {"sync_period": 4},
  "streaming_diloco": {"sync_period": 4, "num_fragments": 2},
}


def trained(name, **kwargs):
  task = TASKS["digits"]
  settings = Settings(algorithm=name, steps=12, eval_every=12, batch_size=8, **CASES[name],
                      **kwargs)
  final = {}
  trainer.train(task, task.load(0), settings, final_state=final)
  return final


@pytest.mark.parametrize("name", list(CASES))
def test_hinted_steps_train_as_the_counter_rule(name, monkeypatch):
  settings = Settings(algorithm=name, steps=12, **CASES[name]).resolved()
  schedule = [algorithms.communicates(settings, t) for t in range(1, 13)]
  assert any(schedule) and not all(schedule)
  hinted = trained(name)
  monkeypatch.setattr(trainer, "communicates", lambda settings, step: None)
  ruled = trained(name)
  chex.assert_trees_all_close(hinted, ruled, rtol=1e-5, atol=1e-6)


def test_communication_rounds_count_the_schedule():
  settings = Settings(algorithm="local_sgd", steps=12, sync_period=3, warmup_steps=2).resolved()
  # warm-up steps 1 and 2 all-reduce; the averages are on steps 5, 8 and 11
  assert [t for t in range(1, 13) if algorithms.communicates(settings, t)] == [5, 8, 11]
  assert algorithms.communication_rounds(settings, 12) == 2 + 3
  settings = Settings(algorithm="streaming_diloco", sync_period=4, num_fragments=2).resolved()
  assert [t for t in range(1, 13) if algorithms.communicates(settings, t)] == [2, 4, 6, 8, 10, 12]
  assert algorithms.communicates(Settings(algorithm="sync").resolved(), 1) is None
