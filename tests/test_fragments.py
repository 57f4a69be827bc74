"""`optax_dist.streaming_diloco_fragments`: the assignment `streaming_diloco`'s `init` uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_dist

PARAMS = {"a": jnp.zeros((4, 3)), "b": jnp.zeros(5), "c": jnp.zeros(2), "d": jnp.zeros(9)}


def test_contiguous_runs_by_element_count():
  # 28 elements; before each leaf 0, 12, 17, 19: floor(3 c / 28) = 0, 1, 1, 2.
  assert optax_dist.streaming_diloco_fragments(PARAMS, 3) == (0, 1, 1, 2)
  assert optax_dist.streaming_diloco_fragments(PARAMS, 3, "contiguous") == (0, 1, 1, 2)


def test_balanced_gives_the_largest_leaf_to_the_emptiest_fragment():
  # 12 -> 0; 9 -> 1; 5 -> 1 (9 < 12); 2 -> 0 (12 < 14).
  assert optax_dist.streaming_diloco_fragments(PARAMS, 2, "balanced") == (0, 1, 0, 1)


def test_a_tree_of_ids_is_read_in_leaf_order():
  ids = {"a": 1, "b": 0, "c": 1, "d": 0}
  assert optax_dist.streaming_diloco_fragments(PARAMS, 2, ids) == (1, 0, 1, 0)


def test_abstract_params_suffice():
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
  assert optax_dist.streaming_diloco_fragments(shapes, 2, "balanced") == (0, 1, 0, 1)


@pytest.mark.parametrize("strategy", ["contiguous", "balanced"])
def test_it_is_the_assignment_of_init(strategy):
  """Each fragment's outer state holds exactly the leaves the function assigns to it."""
  ids = optax_dist.streaming_diloco_fragments(PARAMS, 2, None if strategy == "contiguous"
                                               else strategy)
  tx = optax_dist.streaming_diloco(
    optax.sgd(1.0), optax.sgd(1.0, momentum=0.9), num_fragments=2,
    fragments=None if strategy == "contiguous" else strategy)
  state = tx.init(PARAMS)
  for f, outer_state in enumerate(state.outer_state):
    trace = jax.tree.leaves(outer_state[0].trace, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    held = tuple(not isinstance(t, optax.MaskedNode) for t in trace)
    assert held == tuple(i == f for i in ids)


@pytest.mark.parametrize(("args", "error", "message"), [
  ((PARAMS, 0), ValueError, r"`streaming_diloco_fragments\(num_fragments=...\)` must be a"
                            r" positive int"),
  ((PARAMS, 2, "strided"), ValueError,
   r"`streaming_diloco_fragments\(strategy=...\)` must be one of 'contiguous', 'balanced'"),
  ((PARAMS, 2, {"a": 0, "b": 2, "c": 1, "d": 0}), ValueError, r"ids must be in \[0, num_"),
  ((PARAMS, 2, {"a": 0, "b": 0}), ValueError, r"must have the params' tree structure"),
  ((PARAMS, 2, {"a": 0, "b": 0, "c": 0, "d": 0}), ValueError, r"assigns no leaf to fragment 1"),
  ((PARAMS, 5), ValueError, r"`streaming_diloco_fragments\(num_fragments=...\)` must leave no"
                            r" fragment empty, got 5 fragments for 4 param leaves of sizes"),
  ((PARAMS, 2, {"a": 0.5, "b": 0, "c": 1, "d": 0}), TypeError, r"an int fragment id"),
])
def test_bad_arguments_name_the_function(args, error, message):
  with pytest.raises(error, match=message):
    optax_dist.streaming_diloco_fragments(*args)
