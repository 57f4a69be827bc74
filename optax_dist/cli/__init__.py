"""The ``optax-dist`` command: data-parallel training with the optax_dist transformations.

One concern per module:

* :mod:`~optax_dist.cli.main`: the entry point; parses the command line and runs a subcommand;
* the subcommands, each a module with ``add_parser(subparsers)`` and ``run(args)``:
  :mod:`~optax_dist.cli.train` (``train``), :mod:`~optax_dist.cli.compare` (``compare``),
  :mod:`~optax_dist.cli.async_run` (``async``: the emulated asynchronous protocols),
  :mod:`~optax_dist.cli.plan` (``plan``: each method's utilization over a link) and
  :mod:`~optax_dist.cli.ft_replica` (``replica``: one replica of a fault-tolerant run);
* :mod:`~optax_dist.cli.ft_train`: ``train --fault-tolerant``, the task in replica processes
  over torchft (the launcher's configuration, the run, its summary);
* :mod:`~optax_dist.cli.ft_flags`: the ``--fault-tolerant`` flags, their defaults and refusals;
* :mod:`~optax_dist.cli.ft_task`: a task as the replicas train it (settings, round protocol, a
  replica's share of the data, evaluation of its checkpoints);
* :mod:`~optax_dist.cli.arguments`: the flags' types and the flags of ``train`` and ``compare``;
* :mod:`~optax_dist.cli.config`: the settings of a training run, their defaults, and the settings
  a command line asks for;
* :mod:`~optax_dist.cli.checks`: every rule the settings obey, checked before anything loads;
* :mod:`~optax_dist.cli.tasks`: the problems to train on (data, model, loss, metric);
* :mod:`~optax_dist.cli.text`: the ``lm`` task's corpus (the standard library's sources);
* :mod:`~optax_dist.cli.models`: the Flax models of the tasks;
* :mod:`~optax_dist.cli.algorithms`: the table of algorithms (``ALGORITHMS``, one record each:
  how to build it, its schedule, its settings) and the inner optimizer;
* :mod:`~optax_dist.cli.pipeline`: the workers' shards of the data and the minibatch order;
* :mod:`~optax_dist.cli.trainer`: the task-agnostic training loop, checkpoints and resuming;
* :mod:`~optax_dist.cli.runs`: a run's mesh, data, initial state and compiled functions;
* :mod:`~optax_dist.cli.steps`: the step and evaluation functions a run compiles;
* :mod:`~optax_dist.cli.meshes`: the devices, the meshes and the global view's param shardings;
* :mod:`~optax_dist.cli.exchange_device`: ``streaming_diloco``'s exchanges on an extra device;
* :mod:`~optax_dist.cli.orbax_checkpoints`: the trainer's Orbax checkpoints and exact resuming;
* :mod:`~optax_dist.cli.processes`: several ``jax.distributed`` processes and their watchdog;
* :mod:`~optax_dist.cli.progress`: the phases and the steps a run shows on stderr as it goes;
* :mod:`~optax_dist.cli.reports`: the tables, the JSON files and the plots;
* :mod:`~optax_dist.cli.errors`: one-line errors and the check of the ``examples`` extra.

Importing this package imports neither Flax nor the other modules of the ``examples`` extra.
"""
