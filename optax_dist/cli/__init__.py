"""The ``optax-dist`` command: data-parallel training with the optax_dist transformations.

One concern per module:

* :mod:`~optax_dist.cli.main`: the entry point; runs the subcommands ``train``, ``compare`` and
  ``async``;
* :mod:`~optax_dist.cli.arguments`: the command line (flags, their checks, the help);
* :mod:`~optax_dist.cli.config`: the settings of a training run and their defaults;
* :mod:`~optax_dist.cli.tasks`: the problems to train on (data, model, loss, metric);
* :mod:`~optax_dist.cli.text`: the ``lm`` task's corpus (the standard library's sources);
* :mod:`~optax_dist.cli.models`: the Flax models of the tasks;
* :mod:`~optax_dist.cli.algorithms`: the table of algorithms (``ALGORITHMS``, one record each:
  how to build it, its schedule, its settings) and the inner optimizer;
* :mod:`~optax_dist.cli.pipeline`: the workers' shards of the data and the minibatch order;
* :mod:`~optax_dist.cli.trainer`: the task-agnostic training loop over a mesh of workers;
* :mod:`~optax_dist.cli.checkpoints`: Orbax checkpoints and exact resuming;
* :mod:`~optax_dist.cli.launcher`: several ``jax.distributed`` processes and their watchdog;
* :mod:`~optax_dist.cli.async_run`: the ``async`` subcommand's emulated protocols;
* :mod:`~optax_dist.cli.plan`: the ``plan`` subcommand: each method's utilization over a link;
* :mod:`~optax_dist.cli.reports`: the tables, the JSON files and the plots;
* :mod:`~optax_dist.cli.errors`: one-line errors and the check of the ``examples`` extra.

Importing this package imports neither Flax nor the other modules of the ``examples`` extra.
"""
