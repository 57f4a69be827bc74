"""optax_dist: TensorFlow 1.x's distributed optimizer wrappers as optax gradient transformations.

* :func:`moving_average`: an exponential moving average of the params (``MovingAverageOptimizer``).
* :func:`elastic_average`: elastic averaging SGD (``ElasticAverageOptimizer``).
* :func:`agn`: accumulated gradient normalization (``AGNOptimizer``).
* :func:`drop_stale_gradients`: drops updates computed against an old global step
  (``DropStaleGradientOptimizer``).
* :func:`tower` and :func:`all_reduce`: synchronous reduction over device towers
  (``TowerOptimizer``), with :func:`split_batch`.
* :func:`eval_params`: the averaged params to evaluate and to save (``swapping_saver``).
* :func:`accumulate_then_reduce`: gradient accumulation with one all-reduce per accumulated step.
* :func:`communication_report`: the collectives a compiled step issues, and their bytes.
* :class:`Exchange`: the workers' axis, wire format and slices of an exchange, checked once, with
  its collectives (sum, mean, mean with error feedback, gather).
* :func:`apply_if_finite`: ``optax.apply_if_finite`` with the skip agreed across the workers.
* :func:`diloco`, :func:`streaming_diloco` and :func:`local_sgd`: local steps with periodic
  outer steps or model averages (DiLoCo, Streaming DiLoCo, local / post-local SGD).
* :func:`delayed_nesterov`: an outer optimizer whose momentum moves once every N
  pseudo-gradients (asynchronous DiLoCo's, usable as :func:`diloco`'s ``outer``).
* :func:`resize_state`: a run's state and params moved to another number of workers (elastic
  resume).
* :func:`state_shardings`: the shardings of a state stacked over replicas (the global view),
  from one replica's params shardings.
* Each periodic transformation's schedule, the rule its ``update`` applies to its step counter:
  :func:`elastic_average_communicates`, :func:`agn_communicates`, :func:`diloco_syncs`,
  :func:`streaming_diloco_syncs`, :func:`local_sgd_syncs` (and :func:`local_sgd_warming_up`);
  :func:`hinted_step` compiles a step with and without the exchange and calls each by it;
  :func:`streaming_diloco_fragments` gives the fragment of each param leaf.
* The two halves of a DiLoCo-family round, for an exchange outside the jitted step:
  :func:`diloco_payload`, :func:`streaming_diloco_payload` and :func:`local_sgd_payload` (each
  worker's term of the mean), :func:`merge_payloads` (the mean, in rank order) and
  :func:`diloco_outer_step`, :func:`streaming_diloco_outer_step` and
  :func:`local_sgd_outer_step` (the step on the merged mean), :func:`streaming_diloco_land`
  (a worker's landing on a fragment's new anchor); :func:`diloco_synchronize`, the mean and
  the outer step in the program, apart from the inner step.

Workers and towers are the positions along a named mapped axis (``axis_name``), so one code path
runs under ``jax.shard_map``, ``jax.vmap(..., axis_name=...)``, ``jax.jit`` of
``jax.vmap(..., spmd_axis_name=...)`` (the global view) and ``jax.pmap``.
"""

from optax_dist._accounting import (
  Collective,
  Collectives,
  CommunicationReport,
  communication_report,
)
from optax_dist._accumulation import AccumulateThenReduceState, accumulate_then_reduce
from optax_dist._agn import AGNState, agn, agn_communicates
from optax_dist._apply_if_finite import ApplyIfFiniteState, apply_if_finite
from optax_dist._delayed_nesterov import DelayedNesterovState, delayed_nesterov
from optax_dist._diloco import (
  DiLoCoState,
  diloco,
  diloco_outer_step,
  diloco_payload,
  diloco_synchronize,
  diloco_syncs,
)
from optax_dist._drop_stale_gradients import DropStaleGradientsState, drop_stale_gradients
from optax_dist._elastic_average import (
  ElasticAverageState,
  elastic_average,
  elastic_average_communicates,
)
from optax_dist._eval_params import eval_params
from optax_dist._exchange import Exchange, merge_payloads
from optax_dist._fragments import streaming_diloco_fragments
from optax_dist._hinted_step import hinted_step
from optax_dist._local_sgd import (
  LocalSGDState,
  local_sgd,
  local_sgd_outer_step,
  local_sgd_payload,
  local_sgd_syncs,
  local_sgd_warming_up,
)
from optax_dist._moving_average import MovingAverageState, moving_average
from optax_dist._resize import resize_state
from optax_dist._sharding import state_shardings
from optax_dist._streaming_diloco import (
  StreamingDiLoCoState,
  streaming_diloco,
  streaming_diloco_land,
  streaming_diloco_outer_step,
  streaming_diloco_payload,
  streaming_diloco_syncs,
)
from optax_dist._tower import all_reduce, split_batch, tower

__version__ = "0.1.0"

__all__ = (
  "AGNState",
  "AccumulateThenReduceState",
  "ApplyIfFiniteState",
  "Collective",
  "Collectives",
  "CommunicationReport",
  "DelayedNesterovState",
  "DiLoCoState",
  "DropStaleGradientsState",
  "ElasticAverageState",
  "Exchange",
  "LocalSGDState",
  "MovingAverageState",
  "StreamingDiLoCoState",
  "accumulate_then_reduce",
  "agn",
  "agn_communicates",
  "all_reduce",
  "apply_if_finite",
  "communication_report",
  "delayed_nesterov",
  "diloco",
  "diloco_outer_step",
  "diloco_payload",
  "diloco_synchronize",
  "diloco_syncs",
  "drop_stale_gradients",
  "elastic_average",
  "elastic_average_communicates",
  "eval_params",
  "hinted_step",
  "local_sgd",
  "local_sgd_outer_step",
  "local_sgd_payload",
  "local_sgd_syncs",
  "local_sgd_warming_up",
  "merge_payloads",
  "moving_average",
  "resize_state",
  "split_batch",
  "state_shardings",
  "streaming_diloco",
  "streaming_diloco_fragments",
  "streaming_diloco_land",
  "streaming_diloco_outer_step",
  "streaming_diloco_payload",
  "streaming_diloco_syncs",
  "tower",
)
