"""The notebooks in ``notebooks/``: their Colab set-up, no stored outputs, and a run top to bottom.

Each notebook is executed with nbclient in a fresh ipykernel of this interpreter (a kernelspec
written for ``sys.executable``, so the kernel imports the same ``optax_dist``), with a temporary
working directory so that checkpoints and other files land outside the repository. A notebook
fails on any cell's error, including the ``assert`` statements the notebooks make about their own
results.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")
for _module in ("flax", "sklearn", "matplotlib", "orbax.checkpoint"):  # used by the notebooks
  pytest.importorskip(_module)

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
COLAB_URL = "https://colab.research.google.com/github/optax-dist/optax_dist/blob/main/notebooks/{}"
CELL_TIMEOUT_S = 300

params = pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])


def _read(path: Path):
  return nbformat.read(path, as_version=4)


def _code_cells(nb):
  return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_notebooks_exist():
  names = {p.stem for p in NOTEBOOKS}
  assert {"quickstart", "easgd_vs_sync", "ema_and_checkpoints"} <= names, names


@params
def test_valid_and_without_outputs(path):
  nb = _read(path)
  nbformat.validate(nb)
  for i, cell in enumerate(_code_cells(nb)):
    assert cell.outputs == [], f"{path.name}: code cell {i} has stored outputs; clear them"
    assert cell.execution_count is None, f"{path.name}: code cell {i} has an execution count"


@params
def test_colab_badge_in_first_cell(path):
  first = _read(path).cells[0]
  assert first.cell_type == "markdown", f"{path.name}: the first cell must be markdown"
  url = COLAB_URL.format(path.name)
  assert f"]({url})" in first.source, f"{path.name}: no 'Open in Colab' badge linking to {url}"
  assert "colab-badge.svg" in first.source


@params
def test_first_code_cell_installs_only_in_colab(path):
  source = _code_cells(_read(path))[0].source
  lines = source.splitlines()
  guard = [i for i, line in enumerate(lines) if re.fullmatch(
    r'if "google\.colab" in sys\.modules:', line.strip())]
  assert guard, f"{path.name}: the first code cell must test `\"google.colab\" in sys.modules`"
  assert "import sys" in lines[: guard[0]], f"{path.name}: `import sys` must precede the guard"
  installs = [i for i, line in enumerate(lines) if re.search(r"[%!]pip install", line)]
  assert installs, f"{path.name}: the first code cell must pip install optax-dist"
  for i in installs:
    assert i > guard[0] and lines[i].startswith((" ", "\t")), (
      f"{path.name}: `{lines[i].strip()}` must be inside the Colab-only `if` block"
    )
    assert "optax-dist" in lines[i] or "optax_dist" in lines[i]


@params
def test_devices_configured_before_use(path):
  """Notebooks mapping over a mesh set the emulated CPU devices before they first use JAX."""
  sources = [cell.source for cell in _code_cells(_read(path))]
  uses_mesh = any("shard_map" in s or "make_mesh" in s for s in sources)
  if not uses_mesh:
    return
  config = [i for i, s in enumerate(sources) if 'jax_num_cpu_devices", 8' in s]
  assert config, f"{path.name}: uses a mesh but never sets `jax_num_cpu_devices`"
  first_use = min(i for i, s in enumerate(sources) if "jax." in s)
  assert config[0] == first_use, f"{path.name}: set the devices in the first cell that uses JAX"
  lines = sources[config[0]].splitlines()
  before = lines[: next(i for i, line in enumerate(lines) if "jax_num_cpu_devices" in line)]
  for line in before:  # nothing but `import jax` and other config updates may come first
    if "jax" in line and not line.startswith("#"):
      assert line in ("import jax",) or line.startswith("jax.config.update("), (
        f"{path.name}: `{line}` runs before the devices are configured"
      )


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory):
  """A kernelspec ``python3`` that runs this interpreter (not whatever ``python`` is on PATH)."""
  kernels = tmp_path_factory.mktemp("kernels")
  kernelspec.write_kernel_spec(path=str(kernels / "python3"))
  manager = KernelSpecManager(kernel_dirs=[str(kernels)])
  argv = manager.get_kernel_spec("python3").argv
  assert argv[0] == sys.executable, argv
  return manager


@pytest.mark.slow
@params
def test_runs_top_to_bottom(path, kernel_spec_manager, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  nb = _read(path)
  km = KernelManager(kernel_name="python3", kernel_spec_manager=kernel_spec_manager)
  client = nbclient.NotebookClient(
    nb,
    km=km,
    kernel_name="python3",
    timeout=CELL_TIMEOUT_S,
    resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
  )
  start = time.perf_counter()
  try:
    client.execute()  # raises CellExecutionError on the first failing cell
  finally:
    if km.has_kernel:  # the client does not shut down a kernel manager it was given
      km.shutdown_kernel(now=True)
  elapsed = time.perf_counter() - start
  print(f"{path.name}: {elapsed:.1f} s")
  errors = [o for cell in _code_cells(nb) for o in cell.outputs if o.output_type == "error"]
  assert not errors
  assert all(cell.execution_count is not None for cell in _code_cells(nb))
  # Files a notebook writes stay in its working directory, not in the repository.
  assert not (NOTEBOOKS_DIR / "checkpoints").exists()
