"""Checkpointing with Orbax: exact resume of every transformation, and the swapping saver.

Exact resume: training S steps straight must give bitwise the params and optimizer state of
training k steps, saving with Orbax, restoring in a fresh process into an abstract target (shapes,
dtypes and shardings only) and training S - k more, for one worker and for eight workers under
``jax.shard_map``. k falls in the middle of a communication period. This file is also the script
that the fresh process runs (``python test_checkpoint.py resume CKPT_DIR OUT_DIR``).

A damaged checkpoint of the training command: ``--resume`` goes back to the intact one before it
and ends as an uninterrupted run; with none intact, the command says so in one line.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import jax

if __name__ == "__main__":  # the fresh process: eight CPU devices, set before JAX starts
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import optax_dist

ocp = pytest.importorskip("orbax.checkpoint")

WORKERS = 8
STEPS = 7  # S
SPLIT = 4  # k: after step 3's exchange (period 3), before step 6's
PERIOD = 3
NAMES = ("moving_average", "elastic_average", "agn", "drop_stale_gradients", "tower")
NAMES += ("diloco", "local_sgd", "streaming_diloco")  # k = 4: mid-period, after a warm-up
CASES = tuple((name, n) for name in NAMES for n in (1, WORKERS))

# A tiny linear model on fixed data: worker w fits rows DATA_X[w] to DATA_Y[w] * (1 + t / 10).
_rng = np.random.default_rng(0)
DATA_X = _rng.normal(size=(WORKERS, 5, 3)).astype(np.float32)
DATA_Y = _rng.normal(size=(WORKERS, 5)).astype(np.float32)
INIT = {"w": np.array([0.5, -0.25, 1.0], np.float32), "b": (np.float32(0.1),)}


def make_tx(name, axis_name):
  inner = optax.adam(0.05)
  if name == "moving_average":
    return optax_dist.moving_average(inner, 0.9, use_num_updates=True)
  if name == "elastic_average":
    return optax_dist.elastic_average(
      inner, communication_period=PERIOD, rho=0.5, axis_name=axis_name
    )
  if name == "agn":
    return optax_dist.agn(inner, communication_period=PERIOD, axis_name=axis_name)
  if name == "drop_stale_gradients":
    return optax_dist.drop_stale_gradients(inner, max_staleness=1)
  if name == "tower":
    return optax_dist.tower(inner, axis_name)  # axis_name=None with one worker: no reduction
  if name == "diloco":  # syncs on steps 3 and 6
    return optax_dist.diloco(inner, sync_period=PERIOD, axis_name=axis_name)
  if name == "local_sgd":  # warm-up on steps 1 and 2, model average on step 5
    return optax_dist.local_sgd(inner, sync_period=PERIOD, warmup_steps=2, axis_name=axis_name)
  if name == "streaming_diloco":  # "w" syncs on steps 1, 4, 7 and "b" on 3, 6
    return optax_dist.streaming_diloco(
      inner, sync_period=PERIOD, num_fragments=2, fragments={"w": 0, "b": (1,)}, mixing=0.5,
      axis_name=axis_name,
    )
  raise AssertionError(name)


def loss(params, x, y, t):
  pred = x @ params["w"] + params["b"][0]
  return jnp.mean((pred - y * (1.0 + t / 10.0)) ** 2)


def worker_step(tx, params, opt_state, x, y, t):
  grads = jax.grad(loss)(params, x, y, t)
  # grad_step = t // 2 falls behind: steps 3 and 5 are dropped with max_staleness=1. The other
  # transformations ignore it (unknown extra args).
  updates, opt_state = tx.update(grads, opt_state, params, grad_step=t // 2)
  return optax.apply_updates(params, updates), opt_state


def _stack(tree):
  return jax.tree.map(lambda a: a[None], tree)


def _unstack(tree):
  return jax.tree.map(lambda a: a[0], tree)


class Run:
  """Init and step functions, data and shardings of every case on ``num_workers`` workers.

  The cases' trees are keyed by name and share one init and one step program (one compile per
  worker count, not per case); each case is its own transformation on its own params.
  """

  def __init__(self, num_workers):
    self.num_workers = num_workers
    if num_workers == 1:
      txs = {name: make_tx(name, None) for name in NAMES}
      self.sharding = SingleDeviceSharding(jax.devices()[0])
      self.init = jax.jit(lambda p: {name: tx.init(p[name]) for name, tx in txs.items()})
      self.step = jax.jit(lambda p, s, x, y, t: _step_all(txs, p, s, x[0], y[0], t))
      self.data = (DATA_X[:1], DATA_Y[:1])
      self.params = jax.device_put({name: INIT for name in NAMES}, self.sharding)
    else:
      txs = {name: make_tx(name, "w") for name in NAMES}
      mesh = jax.make_mesh((num_workers,), ("w",))
      self.sharding = NamedSharding(mesh, P("w"))

      def init(p):
        return _stack({name: tx.init(_unstack(p[name])) for name, tx in txs.items()})

      def step(p, s, x, y, t):
        return _stack(_step_all(txs, _unstack(p), _unstack(s), x[0], y[0], t))

      spec = P("w")
      self.init = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=spec, out_specs=spec))
      self.step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 4 + (P(),), out_specs=spec)
      )
      self.data = jax.device_put((DATA_X, DATA_Y), self.sharding)
      stacked = jax.tree.map(lambda a: np.stack([a] * num_workers), INIT)  # same on every worker
      self.params = jax.device_put({name: stacked for name in NAMES}, self.sharding)

  def abstract_train_states(self):
    """Each case's train state as ``jax.ShapeDtypeStruct`` leaves with their shardings."""
    opt_states = jax.eval_shape(self.init, self.params)
    return {name: jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.sharding),
      {"params": self.params[name], "opt_state": opt_states[name]},
    ) for name in NAMES}

  def train(self, params, opt_state, start, stop):
    for t in range(start, stop):
      params, opt_state = self.step(params, opt_state, *self.data, jnp.int32(t))
    return params, opt_state


@functools.cache
def run_of(num_workers):
  """The :class:`Run` on ``num_workers`` workers, built once per process (its programs too)."""
  return Run(num_workers)


def _step_all(txs, params, opt_state, x, y, t):
  """:func:`worker_step` of every case: ``(params, opt_state)``, each keyed by name."""
  stepped = {name: worker_step(tx, params[name], opt_state[name], x, y, t)
             for name, tx in txs.items()}
  return {k: v[0] for k, v in stepped.items()}, {k: v[1] for k, v in stepped.items()}


def case_dir(root, name, num_workers):
  return os.path.join(root, f"{name}-{num_workers}")


def flat(tree):
  """The leaves of ``tree`` as NumPy arrays, keyed by their paths."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def bitwise_equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def resume_all(ckpt_root, out_root):
  """The fresh process: restore every case at step SPLIT, train to STEPS, write the results."""
  for n in (1, WORKERS):
    run, restored = Run(n), {}
    for name, abstract in run.abstract_train_states().items():
      with ocp.StandardCheckpointer() as ckpt:
        restored[name] = ckpt.restore(case_dir(ckpt_root, name, n), abstract)
      assert jax.tree.structure(restored[name]) == jax.tree.structure(abstract), name
      for leaf in jax.tree.leaves(restored[name]):
        assert leaf.sharding.is_equivalent_to(run.sharding, leaf.ndim), (name, leaf.sharding)
    params, opt_state = run.train({name: restored[name]["params"] for name in NAMES},
                                  {name: restored[name]["opt_state"] for name in NAMES},
                                  SPLIT, STEPS)
    for name in NAMES:
      tree = {"params": params[name], "opt_state": opt_state[name]}
      np.savez(case_dir(out_root, name, n) + ".npz", **flat(tree))


def _subprocess_env():
  return dict(os.environ, JAX_PLATFORMS="cpu")


# ----------------------------------------------------------------------------------------------
# Tests.


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """Straight runs in this process (saving at SPLIT) and resumed runs from one fresh process."""
  ckpt_root = tmp_path_factory.mktemp("ckpt")
  out_root = tmp_path_factory.mktemp("out")
  straight = {}
  for n in (1, WORKERS):
    run = run_of(n)
    params, opt_state = run.train(run.params, run.init(run.params), 0, SPLIT)
    for name in NAMES:
      with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(case_dir(str(ckpt_root), name, n),
                  {"params": params[name], "opt_state": opt_state[name]})
    params, opt_state = run.train(params, opt_state, SPLIT, STEPS)
    for name in NAMES:
      straight[name, n] = flat({"params": params[name], "opt_state": opt_state[name]})
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "resume", str(ckpt_root), str(out_root)],
    env=_subprocess_env(), capture_output=True, text=True, timeout=600, check=False,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  return straight, str(out_root)


@pytest.mark.slow
@pytest.mark.parametrize("name,num_workers", CASES)
def test_resume_in_fresh_process_is_bitwise_exact(resumed, name, num_workers):
  straight, out_root = resumed
  want = straight[name, num_workers]
  with np.load(case_dir(out_root, name, num_workers) + ".npz") as f:
    got = dict(f)
  assert sorted(got) == sorted(want)
  for key in want:
    assert bitwise_equal(got[key], want[key]), (key, got[key], want[key])


def test_resume_cases_exercise_the_state():
  """The runs are not trivial: workers differ, a period is cut, and updates are dropped."""
  run = run_of(1)
  _, state = run.train(run.params, run.init(run.params), 0, STEPS)
  state = state["drop_stale_gradients"]
  assert int(state.num_dropped) == 2 and int(state.global_step) == STEPS - 2
  run = run_of(WORKERS)
  params, state = run.train(run.params, run.init(run.params), 0, SPLIT)
  params, state = params["elastic_average"], state["elastic_average"]
  assert np.all(np.asarray(state.local_step) == SPLIT) and SPLIT % PERIOD != 0
  w = np.asarray(params["w"])
  assert not np.array_equal(w[0], w[1])  # the workers' params differ
  center = np.asarray(state.center["w"])
  np.testing.assert_array_equal(center, np.stack([center[0]] * WORKERS))


# ----------------------------------------------------------------------------------------------
# The swapping saver: a plain Flax model restores the averaged params and scores the same.


@functools.cache
def _digits():
  from sklearn.datasets import load_digits

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def _mlp():
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(32)(x))
      return nn.Dense(10)(x)

  return MLP()


def _accuracy(model, params, x, y):
  logits = jax.jit(model.apply)(params, x)
  return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def _train(model, tx, train, num_workers, steps=100, batch=32):
  """``model``'s init (key 0) trained ``steps`` steps on ``num_workers`` mapped workers, each
  ``batch`` examples a step: ``(params, opt_state)``, from one compiled program."""
  idx = np.random.default_rng(1).integers(0, len(train[0]), size=(steps, num_workers, batch))

  def run(x, y, idx):
    def loss_fn(p, xb, yb):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, xb), yb).mean()

    def step(carry, i):
      p, s = carry
      updates, s = tx.update(jax.grad(loss_fn)(p, x[i], y[i]), s, p)
      return (optax.apply_updates(p, updates), s), None

    params = model.init(jax.random.key(0), x[:1])
    if num_workers == 1:
      return jax.lax.scan(step, (params, tx.init(params)), idx[:, 0])[0]
    params = jax.tree.map(lambda a: jnp.stack([a] * num_workers), params)
    state = jax.vmap(tx.init, axis_name="workers")(params)
    step = jax.vmap(step, axis_name="workers", in_axes=((0, 0), 0))
    return jax.lax.scan(step, (params, state), idx)[0]

  return jax.jit(run)(*train, idx)


def _restore_into_plain_model(path, x):
  """A fresh function: a model with no optimizer restores its params and evaluates them."""
  from optax_dist.checkpoint import restore_params

  model = _mlp()
  abstract = jax.eval_shape(model.init, jax.random.key(42), x[:1])
  return model, restore_params(path, abstract)


@pytest.mark.parametrize("kind", ["moving_average", "elastic_average"])
def test_swapping_saver_restores_eval_params_into_plain_model(tmp_path, kind):
  from optax_dist.checkpoint import save_eval_params

  train, (x_test, y_test) = _digits()
  model = _mlp()
  if kind == "moving_average":
    tx, n, worker = optax_dist.moving_average(optax.adam(1e-2), 0.9, use_num_updates=True), 1, None
  else:
    n, worker = 4, 2
    tx = optax_dist.elastic_average(optax.adam(1e-2), communication_period=4, axis_name="workers")
  params, state = _train(model, tx, train, n)
  expected = optax_dist.eval_params(state, params)
  if worker is not None:
    # The center is the same on every worker; saving any one of them is the plain model's params.
    # (Rows taken on the host: indexing a JAX array compiles a program per shape.)
    expected = jax.tree.map(np.asarray, expected)
    for leaf in jax.tree.leaves(expected):
      assert all(np.array_equal(leaf[0], leaf[i]) for i in range(n))
    expected = jax.tree.map(lambda a: a[worker], expected)
    own_params = jax.tree.map(lambda a: np.asarray(a)[worker], params)
  else:
    own_params = params
  # The average is what gets saved, and it is not the params.
  assert not all(map(bitwise_equal, jax.tree.leaves(expected), jax.tree.leaves(own_params)))
  expected_accuracy = _accuracy(model, expected, x_test, y_test)

  saved = save_eval_params(tmp_path / "eval", state, params, worker=worker)
  del params, own_params, state
  plain, restored = _restore_into_plain_model(tmp_path / "eval", x_test)

  assert jax.tree.structure(restored) == jax.tree.structure(expected)
  for got, want, out in zip(jax.tree.leaves(restored), jax.tree.leaves(expected),
                            jax.tree.leaves(saved)):
    assert bitwise_equal(got, want) and bitwise_equal(out, want)
  assert _accuracy(plain, restored, x_test, y_test) == expected_accuracy
  assert expected_accuracy > 0.8  # the model did learn: the saved params are not the init
  assert sorted(restored["params"]) == ["Dense_0", "Dense_1"]


def test_swapping_saver_without_average_saves_params(tmp_path):
  from optax_dist.checkpoint import restore_params, save_eval_params

  params = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2), jnp.bfloat16)}
  state = optax.adam(0.1).init(params)
  save_eval_params(str(tmp_path / "p"), state, params)
  restored = restore_params(tmp_path / "p")
  for key, value in params.items():
    assert bitwise_equal(restored[key], value)


def test_swapping_saver_ema_differs_from_params(tmp_path):
  """The EMA, not the params, is saved: analytic values, decay 0.5, sgd(1)."""
  from optax_dist.checkpoint import restore_params, save_eval_params

  tx = optax_dist.moving_average(optax.sgd(1.0), 0.5)
  params = {"x": jnp.array([4.0])}
  state = tx.init(params)
  for _ in range(2):  # params 4 -> 3 -> 2; ema 4 -> 3.5 -> 2.75
    updates, state = tx.update({"x": jnp.array([1.0])}, state, params)
    params = optax.apply_updates(params, updates)
  save_eval_params(tmp_path / "ema", state, params)
  np.testing.assert_array_equal(restore_params(tmp_path / "ema", params)["x"], [2.75])


def test_save_eval_params_worker_errors(tmp_path):
  from optax_dist.checkpoint import save_eval_params

  params = {"a": jnp.zeros((2, 3)), "s": jnp.zeros(())}
  with pytest.raises(ValueError, match=r"worker=2.*\['a'\].*\(2, 3\)"):
    save_eval_params(tmp_path / "x", None, {"a": params["a"]}, worker=2)
  with pytest.raises(ValueError, match=r"\['s'\] has shape \(\)"):
    save_eval_params(tmp_path / "y", None, params, worker=0)
  with pytest.raises(TypeError, match="worker"):
    save_eval_params(tmp_path / "z", None, params, worker=0.0)
  save_eval_params(tmp_path / "w", None, {"a": params["a"]}, worker=1)
  with pytest.raises(ValueError, match="exists"):
    save_eval_params(tmp_path / "w", None, {"a": params["a"]}, worker=1)
  save_eval_params(tmp_path / "w", None, {"a": params["a"]}, worker=1, force=True)


def test_missing_orbax_is_a_clear_import_error(tmp_path, monkeypatch):
  # `import optax_dist` never loads orbax (tests/test_api.py); here it is missing altogether.
  from optax_dist.checkpoint import restore_params, save_eval_params

  monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # makes the import fail
  with pytest.raises(ImportError, match=r"save_eval_params.*optax-dist\[checkpoint\]"):
    save_eval_params(tmp_path / "x", None, {"a": jnp.zeros(2)})
  with pytest.raises(ImportError, match=r"restore_params.*orbax-checkpoint"):
    restore_params(tmp_path / "x")


@functools.cache
def _stacked_elastic_average(num_workers):
  """One step of ``num_workers`` mapped workers from zeros (one compiled program, once)."""
  tx = optax_dist.elastic_average(optax.sgd(1.0), communication_period=1, axis_name="workers")

  @jax.jit
  def step(params, grads):
    state = jax.vmap(tx.init, axis_name="workers")(params)
    updates, state = jax.vmap(tx.update, axis_name="workers")(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {"w": np.zeros((num_workers, 3), np.float32), "b": np.zeros(num_workers, np.float32)}
  grads = {"w": np.arange(3.0 * num_workers, dtype=np.float32).reshape(num_workers, 3),
           "b": np.ones(num_workers, np.float32)}
  return (tx, *step(params, grads))


def test_save_eval_params_worker_refuses_a_tree_not_stacked_over_workers(tmp_path):
  """One worker's tree whose leaves all have a leading axis: saving row 0 would be silent."""
  from optax_dist.checkpoint import save_eval_params

  for tx in (optax_dist.moving_average(optax.sgd(1.0), 0.5),
             optax_dist.elastic_average(optax.adam(0.1), communication_period=2)):
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones((4,))}  # same leading size, not stacked
    state = tx.init(params)
    counter = "count" if isinstance(state, optax_dist.MovingAverageState) else "local_step"
    with pytest.raises(ValueError) as info:
      save_eval_params(tmp_path / "x", state, params, worker=0)
    message = str(info.value)
    for part in ("`save_eval_params(worker=0)`", f"opt_state.{counter} has shape ()",
                 "worker=None"):
      assert part in message, message
    assert not (tmp_path / "x").exists()


def test_save_eval_params_worker_refuses_mixed_leading_sizes(tmp_path):
  from optax_dist.checkpoint import save_eval_params

  params = {"a": jnp.zeros((4, 3)), "b": jnp.zeros((3, 4))}
  with pytest.raises(ValueError, match=r"worker=1.*params\['b'\] has shape \(3, 4\) while "
                     r"params\['a'\] has shape \(4, 3\).*worker=None"):
    save_eval_params(tmp_path / "x", None, params, worker=1)
  _, params, state = _stacked_elastic_average(4)
  state = state._replace(local_step=state.local_step[:2])  # one state leaf not over 4 workers
  with pytest.raises(ValueError, match=r"opt_state\.local_step has shape \(2,\)"):
    save_eval_params(tmp_path / "y", state, params, worker=1)


def test_save_eval_params_num_workers(tmp_path):
  from optax_dist.checkpoint import restore_params, save_eval_params

  params = {"w": jnp.arange(12.0).reshape(4, 3)}  # no state with a counter: ambiguous alone
  with pytest.raises(ValueError, match=r"params\['w'\] has shape \(4, 3\) while num_workers=2"):
    save_eval_params(tmp_path / "x", optax.sgd(1.0).init(params), params, worker=0, num_workers=2)
  with pytest.raises(ValueError, match=r"num_workers=4.*only meaningful with `worker=`"):
    save_eval_params(tmp_path / "x", None, params, num_workers=4)
  with pytest.raises(ValueError, match=r"num_workers=\.\.\.\)` must be a positive int, got 0"):
    save_eval_params(tmp_path / "x", None, params, worker=0, num_workers=0)
  with pytest.raises(TypeError, match=r"num_workers"):
    save_eval_params(tmp_path / "x", None, params, worker=0, num_workers=4.0)
  save_eval_params(tmp_path / "x", None, params, worker=2, num_workers=4)
  np.testing.assert_array_equal(restore_params(tmp_path / "x")["w"], [6.0, 7.0, 8.0])


def test_save_eval_params_worker_out_of_range_names_the_axis(tmp_path):
  from optax_dist.checkpoint import save_eval_params

  _, params, state = _stacked_elastic_average(4)
  for worker in (4, -1):
    with pytest.raises(ValueError, match=rf"worker={worker}\)` must be in \[0, 4\).*"
                       r"params\['b'\] has shape \(4,\)"):
      save_eval_params(tmp_path / "x", state, params, worker=worker)


def test_save_eval_params_saves_one_workers_center_of_a_stacked_state(tmp_path):
  from optax_dist.checkpoint import restore_params, save_eval_params

  _, params, state = _stacked_elastic_average(4)
  center = state.center
  assert not np.array_equal(params["w"][0], params["w"][3])  # the workers' own params differ
  saved = save_eval_params(tmp_path / "c", state, params, worker=3)
  restored = restore_params(tmp_path / "c", {"w": jnp.zeros(3), "b": jnp.zeros(())})
  for key in ("w", "b"):
    assert bitwise_equal(restored[key], center[key][3]) and bitwise_equal(saved[key], center[key][3])


# A damaged checkpoint of the training command: ``--resume`` goes back to the intact one before it.

DAMAGE_STEPS, DAMAGE_EVERY = 6, 2  # checkpoints of steps 4 and 6 are kept


def _damage_settings():
  from optax_dist.cli.config import Settings

  return Settings(algorithm="diloco", devices=2, steps=DAMAGE_STEPS, batch_size=16,
                  sync_period=2, eval_every=3)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
  """``(task, data, checkpoints, final state)`` of an uninterrupted run saving every 2 steps."""
  from optax_dist.cli import trainer
  from optax_dist.cli.tasks import TASKS

  task = TASKS["digits"]
  data = task.load(0)
  directory = tmp_path_factory.mktemp("digits") / "checkpoints"
  result = trainer.train(task, data, _damage_settings(), checkpoint_dir=str(directory),
                         checkpoint_every=DAMAGE_EVERY, keep_state=True)
  return task, data, directory, result["final_state"]


def _garble(step_dir):
  """Writes bytes that are not JSON over the file Orbax reads first: the ``meta`` item's."""
  (step_dir / "meta" / "metadata").write_bytes(b"\xff\xfe\x00 not json")


def _empty(step_dir):
  for entry in step_dir.iterdir():
    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


@pytest.mark.parametrize("damage, reason", [
  (_garble, "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
  (_empty, "FileNotFoundError: File {directory}/6/meta/metadata not found."),
], ids=["corrupted", "emptied"])
def test_resume_goes_back_past_a_damaged_checkpoint(digits_run, tmp_path, capsys, damage, reason):
  from optax_dist.cli import trainer
  from optax_dist.cli.orbax_checkpoints import saved_steps

  task, data, checkpoints, uninterrupted = digits_run
  directory = tmp_path / "checkpoints"
  shutil.copytree(checkpoints, directory)
  damage(directory / "6")
  capsys.readouterr()
  result = trainer.train(task, data, _damage_settings(), checkpoint_dir=str(directory),
                         checkpoint_every=DAMAGE_EVERY, resume=True, keep_state=True)
  notice = capsys.readouterr().err.strip().splitlines()
  reason = reason.format(directory=directory)
  assert len(notice) == 1, notice
  assert notice[0].startswith(f"optax-dist: the checkpoint of step 6 is damaged ({reason}")
  assert notice[0].endswith(f"; renamed it {directory / '6.damaged'} and resuming from step 4")
  assert result["resumed_from_step"] == 4
  assert (directory / "6.damaged").is_dir()
  assert saved_steps(str(directory)) == [4, 6]  # step 6 saved again by the resumed run
  resumed, expected = flat(result["final_state"]), flat(uninterrupted)
  assert resumed.keys() == expected.keys()
  assert all(bitwise_equal(resumed[k], expected[k]) for k in expected)


def test_resume_with_every_checkpoint_damaged_is_one_line(digits_run, tmp_path, capsys,
                                                         monkeypatch):
  """Refused before the run is built (nothing compiles)."""
  from optax_dist.cli import trainer
  from optax_dist.cli.main import main

  def built(*args, **kwargs):
    raise AssertionError("the run was built before the checkpoint was refused")

  monkeypatch.setattr(trainer, "Run", built)

  out = tmp_path / "out"
  directory = out / "checkpoints" / "diloco"
  shutil.copytree(digits_run[2], directory)
  _garble(directory / "6")
  _empty(directory / "4")
  capsys.readouterr()
  status = main(["train", "--algorithm", "diloco", "--devices", "2", "--steps", "6",
                 "--sync-period", "2", "--checkpoint-every", "2", "--no-progress", "--resume",
                 "--out", str(out)])
  stdout, stderr = capsys.readouterr()
  assert status == 2 and stdout == "", stdout
  assert "Traceback" not in stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1, stderr
  assert lines[0].startswith("optax-dist: error: argument --resume: no intact checkpoint")
  assert f"{directory / '6'} is damaged (UnicodeDecodeError: " in lines[0]
  assert f"{directory / '4'} is damaged (FileNotFoundError: " in lines[0]
  assert sorted(os.listdir(directory)) == ["4", "6"]  # nothing renamed


# Where the exchanges run is not part of the saved state.


def _streaming_settings(**changes):
  from optax_dist.cli.config import Settings

  return Settings(algorithm="streaming_diloco", devices=2, replicas=2, steps=6, sync_period=4,
                  num_fragments=2, overlap=2, **changes).as_dict()


@pytest.mark.parametrize("saved, resumed", [(False, True), (True, False)],
                         ids=["onto-exchange-device", "off-exchange-device"])
def test_resume_may_move_the_exchanges_to_or_from_the_exchange_device(tmp_path, saved, resumed):
  """A checkpoint holds no exchange in flight outside the state (saved after ``settle``): the
  in-step route and ``--exchange-device`` save the same state, and either resumes the other's."""
  from optax_dist.cli.orbax_checkpoints import CheckpointMismatchError, Checkpoints

  state = {"w": jnp.arange(4.0).reshape(2, 2), "step": jnp.array([3, 3], jnp.int32)}
  writer = Checkpoints(str(tmp_path), _streaming_settings(exchange_device=saved), resume=False)
  writer.save(4, state, {"record": {}, "wall_time_s": 1.0})
  writer.close()
  reader = Checkpoints(str(tmp_path), _streaming_settings(exchange_device=resumed), resume=True)
  restored, meta = reader.restore(state, None)
  assert meta["step"] == 4 and meta["settings"]["exchange_device"] is saved
  assert all(bitwise_equal(restored[k], state[k]) for k in state)
  reader.close()
  with pytest.raises(CheckpointMismatchError, match=r"other settings \(mixing 0.0 -> 0.5\)"):
    Checkpoints(str(tmp_path), _streaming_settings(exchange_device=resumed, mixing=0.5),
                resume=True)


if __name__ == "__main__":
  assert sys.argv[1] == "resume", sys.argv
  resume_all(sys.argv[2], sys.argv[3])
