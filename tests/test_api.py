"""The public surface: ``__all__``, docstrings (sections and runnable examples), light imports."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import types

import pytest

import optax_dist

PUBLIC = sorted(optax_dist.__all__)
FUNCTIONS = [n for n in PUBLIC if inspect.isfunction(getattr(optax_dist, n))]
CLASSES = [n for n in PUBLIC if inspect.isclass(getattr(optax_dist, n))]
MODULES = sorted(m.name for m in pkgutil.walk_packages(optax_dist.__path__, prefix="optax_dist."))


def test_all_lists_exactly_the_public_names():
  namespace = {
    name
    for name, value in vars(optax_dist).items()
    if not name.startswith("_")
    # Submodules of the package appear as attributes once imported; they are not re-exports.
    and not (isinstance(value, types.ModuleType) and value.__name__.startswith("optax_dist."))
  }
  assert len(optax_dist.__all__) == len(set(optax_dist.__all__)), "duplicates in __all__"
  assert sorted(set(optax_dist.__all__) - namespace) == [], "in __all__ but not defined"
  assert sorted(namespace - set(optax_dist.__all__)) == [], "public but missing from __all__"


def test_public_surface_is_complete():
  # The names the documentation promises; every transformation's state class is public too.
  expected = {
    "moving_average",
    "MovingAverageState",
    "elastic_average",
    "ElasticAverageState",
    "agn",
    "AGNState",
    "drop_stale_gradients",
    "DropStaleGradientsState",
    "tower",
    "all_reduce",
    "split_batch",
    "eval_params",
  }
  assert expected <= set(PUBLIC)
  for name in PUBLIC:  # re-exported from the private modules, never defined in __init__
    assert getattr(optax_dist, name).__module__.startswith("optax_dist._")


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_a_docstring(name):
  doc = inspect.getdoc(getattr(optax_dist, name))
  assert doc and len(doc.strip()) > 40
  first = doc.splitlines()[0]
  assert first.endswith(".") and len(first) <= 100, "one-line summary"


@pytest.mark.parametrize("name", CLASSES)
def test_classes_document_their_fields(name):
  cls = getattr(optax_dist, name)
  doc = inspect.getdoc(cls)
  assert re.search(r"^Attributes:$", doc, re.MULTILINE)
  fields = cls._fields if hasattr(cls, "_fields") else [f.name for f in dataclasses.fields(cls)]
  assert fields
  for field in fields:
    assert re.search(rf"^\s+{field}:", doc, re.MULTILINE), f"{name}.{field} is not documented"


def sections(doc: str) -> dict[str, str]:
  """The docstring's Google-style sections, by title."""
  found, title = {}, None
  for line in doc.splitlines():
    m = re.match(r"^([A-Z][A-Za-z ]*):$", line)
    if m:
      title = m.group(1)
      found[title] = ""
    elif title is not None:
      found[title] += line + "\n"
  return found


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_docstrings_have_the_sections(name):
  fn = getattr(optax_dist, name)
  doc = inspect.getdoc(fn)
  found = sections(doc)
  required = ["Returns", "Collectives", "Raises", "Examples", "References"]
  if inspect.signature(fn).parameters:
    required.insert(0, "Args")
  for title in required:
    assert found.get(title, "").strip(), f"{name}: missing or empty section {title!r}"
  assert ">>>" in found["Examples"], f"{name}: the Examples section has no doctest"
  assert "Error" in found["Raises"]
  if "Args" in found:
    for param in inspect.signature(fn).parameters:
      assert re.search(rf"^\s+{param}:", found["Args"], re.MULTILINE), (
        f"{name}: {param} undocumented"
      )


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
  if module_name.startswith("optax_dist.fault_tolerance.torchft_"):  # the engine, its session
    pytest.importorskip("torchft")  # the ft extra (make test installs it and requires it)
  module = importlib.import_module(module_name)
  result = doctest.testmod(
    module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False
  )
  assert result.failed == 0
  defines_public = any(getattr(optax_dist, n).__module__ == module_name for n in FUNCTIONS)
  if defines_public:
    assert result.attempted > 0


def test_every_public_function_example_was_run():
  # Each public function's docstring is collected by doctest from its defining module.
  finder = doctest.DocTestFinder()
  for name in FUNCTIONS:
    fn = getattr(optax_dist, name)
    tests = finder.find(fn, name, globs={})
    assert sum(len(t.examples) for t in tests) > 0, name


def test_importing_does_not_load_heavy_optional_packages():
  code = (
    "import sys, optax_dist\n"
    "heavy = ('flax', 'chex', 'sklearn', 'matplotlib', 'tqdm', 'orbax')\n"
    "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
  )
  assert out.stdout.strip() == "", f"importing optax_dist loaded: {out.stdout.strip()}"


def test_version():
  assert re.fullmatch(r"\d+\.\d+\.\d+", optax_dist.__version__)
