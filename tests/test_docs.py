"""The documentation: API coverage, runnable code blocks, quoted error messages, the Sphinx build.

Convention for code in ``docs/*.md``: every fenced block opened with exactly ```` ```python ````
is runnable. A page's blocks run in order, sharing one namespace, with eight emulated CPU devices:
every page in a fresh namespace and working directory of one Python process that the pages share,
so that JAX and the package are imported once, not once a page. The package's submodules a page
imported are forgotten after it, so a page that uses ``optax_dist.flax`` without importing it
fails. Python that must not run (TF 1.x code, multi-process scripts) is written as a
``{code-block} python`` directive instead, which this file does not collect.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import pathlib
import re
import select
import subprocess
import sys
import warnings

import pytest

import optax_dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and p.name != "README.md")

_OPEN = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})python\s*$")

# Runs pages, one a line of its standard input ({"cwd": ..., "blocks": [...]}), and answers each on
# the file descriptor argv[1] with one line: the traceback (null if the page ran) and the page's
# output. Each block is compiled with the page's path and its line numbers, so a traceback points
# at the line of the .md file.
_RUNNER = """
import contextlib, io, json, os, sys, traceback
import jax
jax.config.update("jax_num_cpu_devices", 8)
import optax_dist
answers = os.fdopen(int(sys.argv[1]), "w")
for request in sys.stdin:
  page, loaded, output = json.loads(request), set(sys.modules), io.StringIO()
  os.chdir(page["cwd"])
  namespace, error = {"__name__": "__main__"}, None
  try:
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
      for path, first_line, source in page["blocks"]:
        exec(compile("\\n" * (first_line - 1) + source, path, "exec"), namespace)
  except BaseException:
    error = traceback.format_exc()
  for name in sorted(set(sys.modules) - loaded, reverse=True):
    if name.startswith("optax_dist."):  # the next page imports it again if it uses it
      parent, _, child = name.rpartition(".")
      del sys.modules[name]
      if getattr(sys.modules.get(parent), child, None) is not None:
        delattr(sys.modules[parent], child)
  answers.write(json.dumps({"error": error, "output": output.getvalue()[-4000:]}) + "\\n")
  answers.flush()
"""


class _PageRunner:
  """The process that runs the pages' blocks, started again if a page killed it."""

  def __init__(self, log: pathlib.Path):
    self.log, self.proc, self.answers = log, None, None

  def _start(self):
    read, write = os.pipe()
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    with open(self.log, "a") as log:
      self.proc = subprocess.Popen(
        [sys.executable, "-c", _RUNNER, str(write)], stdin=subprocess.PIPE, stdout=log,
        stderr=log, pass_fds=(write,), env=env, text=True,
      )
    os.close(write)
    self.answers = os.fdopen(read)

  def run(self, blocks, cwd: pathlib.Path, timeout: float) -> str | None:
    """Runs one page's blocks; returns None, or why they failed."""
    if self.proc is None or self.proc.poll() is not None:
      self._start()
    self.proc.stdin.write(json.dumps({"cwd": str(cwd), "blocks": blocks}) + "\n")
    self.proc.stdin.flush()
    if not select.select([self.answers], [], [], timeout)[0]:
      self.close()
      return f"no answer within {timeout} s"
    line = self.answers.readline()
    if not line:  # the process died: the page crashed it
      self.close()
      return f"the process running the pages died:\n{self.log.read_text()[-4000:]}"
    answer = json.loads(line)
    return answer["error"] and answer["output"] + answer["error"]

  def close(self):
    if self.proc is not None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
      self.answers.close()
      self.proc = None


@pytest.fixture(scope="module")
def page_runner(tmp_path_factory):
  runner = _PageRunner(tmp_path_factory.mktemp("pages") / "runner.log")
  yield runner
  runner.close()


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
  """The ```python blocks of ``page``: (line number of the block's first code line, source)."""
  blocks, lines = [], page.read_text().splitlines()
  i = 0
  while i < len(lines):
    match = _OPEN.match(lines[i])
    if match:  # a fence may be indented (inside a list item): the body loses that indent
      indent, fence, start, body = len(match["indent"]), match["fence"], i + 2, []
      i += 1
      while i < len(lines) and lines[i].strip() != fence:
        body.append(lines[i][indent:])
        i += 1
      if i == len(lines):
        raise AssertionError(f"{page}: unclosed ```python block at line {start - 1}")
      blocks.append((start, "\n".join(body) + "\n"))
    i += 1
  return blocks


def test_python_blocks_parser_finds_blocks_and_skips_directives(tmp_path):
  page = tmp_path / "p.md"
  page.write_text(
    "text\n```python\na = 1\n```\n```{code-block} python\nnot run\n```\n````python\nb = 2\n````\n"
    "- item\n\n  ```python\n  if b:\n    c = 3\n  ```\n"
  )
  assert python_blocks(page) == [(3, "a = 1\n"), (9, "b = 2\n"), (14, "if b:\n  c = 3\n")]


# ------------------------------------------------------------------------------------------
# (a) The API reference names every public name.


def _documented_names() -> list[str]:
  source = (DOCS / "api.md").read_text()
  assert ".. currentmodule:: optax_dist" in source
  return re.findall(r"^\.\. auto(?:function|class|data)::\s+(\S+)\s*$", source, re.MULTILINE)


def test_api_reference_documents_every_public_name():
  documented = _documented_names()
  missing = sorted(set(optax_dist.__all__) - set(documented))
  assert not missing, f"docs/api.md lacks an autofunction/autoclass entry for {missing}"


def test_api_reference_documents_only_existing_names_once():
  documented = _documented_names()
  assert len(documented) == len(set(documented)), f"duplicate entries in docs/api.md: {documented}"
  top_level = [name for name in documented if "." not in name]
  unknown = sorted(set(top_level) - set(optax_dist.__all__))
  assert not unknown, f"docs/api.md documents names not in optax_dist.__all__: {unknown}"
  for dotted in sorted(set(documented) - set(top_level)):  # optional modules: optax_dist.flax.X
    module, _, attr = dotted.rpartition(".")
    assert module.startswith("optax_dist."), dotted
    try:
      mod = importlib.import_module(module)
    except ImportError as e:  # an optional dependency is missing: nothing to check here
      pytest.skip(f"{module} needs an optional dependency: {e}")
    assert hasattr(mod, attr), f"docs/api.md documents {dotted}, which does not exist"


# ------------------------------------------------------------------------------------------
# (b) Every ```python block runs.


def test_every_page_is_collected():
  names = {p.relative_to(DOCS).as_posix() for p in PAGES}
  for page in ("index.md", "getting_started.md", "migration.md", "distributed.md", "errors.md",
               "api.md", "algorithms/moving_average.md", "algorithms/elastic_average.md",
               "algorithms/agn.md", "algorithms/drop_stale_gradients.md", "algorithms/tower.md",
               "algorithms/eval_params.md"):
    assert page in names
  # The pages that teach an algorithm must show running code.
  for page in PAGES:
    if page.parent.name == "algorithms" or page.name == "getting_started.md":
      assert python_blocks(page), f"{page} has no runnable ```python block"


@pytest.mark.slow
@pytest.mark.parametrize(
  "page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.relative_to(DOCS).as_posix()
)
def test_code_blocks_run(page, page_runner, tmp_path):
  blocks = [(str(page.relative_to(ROOT)), line, src) for line, src in python_blocks(page)]
  for path, line, src in blocks:
    ast.parse(src, filename=f"{path}:{line}")  # a syntax error names its block before any run
  failure = page_runner.run(blocks, tmp_path, timeout=600)
  assert failure is None, f"{page.name}: a code block failed\n{failure[-4000:]}"


def test_page_runner_forgets_the_package_submodules_a_page_imported(page_runner, tmp_path):
  """A page that uses ``optax_dist.flax`` unimported fails after one that imported it; a failure
  names the page's line."""
  assert page_runner.run([("a.md", 1, "import optax_dist.flax\n")], tmp_path, timeout=120) is None
  failure = page_runner.run([("b.md", 3, "import optax_dist\n\noptax_dist.flax\n")], tmp_path,
                            timeout=120)
  assert 'File "b.md", line 5' in failure and "AttributeError" in failure, failure


# ------------------------------------------------------------------------------------------
# The error messages quoted in docs/errors.md are the ones raised.

_ROW = re.compile(r"^\|(?P<what>[^|]*)\|\s*`(?P<call>[^`]+)`\s*\|\s*``\s(?P<raised>.+?)\s``\s*\|\s*$")


def _error_rows() -> list[tuple[str, str, str]]:
  rows = []
  for line in (DOCS / "errors.md").read_text().splitlines():
    match = _ROW.match(line)
    if match:
      rows.append((match["what"].strip(), match["call"], match["raised"]))
  return rows


def test_errors_page_quotes_the_raised_messages():
  rows = _error_rows()
  assert len(rows) >= 20, f"expected the table of bad inputs in docs/errors.md, found {len(rows)}"
  setup = python_blocks(DOCS / "errors.md")[0][1]
  namespace: dict = {}
  exec(setup, namespace)
  for what, call, raised in rows:
    kind, _, message = raised.partition(": ")
    with pytest.raises(Exception) as info, warnings.catch_warnings():
      warnings.simplefilter("error")  # the rows of the Warnings table raise as their category
      eval(call, namespace)
    got = f"{type(info.value).__name__}: {info.value}"
    if message.endswith("…"):
      assert type(info.value).__name__ == kind and str(info.value).startswith(message[:-1]), (
        f"{what}: {call}\n  page: {raised}\n  real: {got}"
      )
    else:
      assert got == raised, f"{what}: {call}\n  page: {raised}\n  real: {got}"


PRIVATE_CHECKS = ("_quantize.py",)  # its helpers are reached only through comm_dtype and
# comm_block_size, whose rows are on the page


def _checked_arguments(path: pathlib.Path) -> set[str]:
  """The arguments ``path`` checks: named in a raised (or warned) message as ``(name=...)`` or
  ``(name=True)``, or passed by name to one of ``_checks``' ``check_*`` functions."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Raise) or (
        isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "warn"):
      for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
          names |= set(re.findall(r"\((\w+)=(?:\.\.\.|True)?(?:\)|$)", sub.value))
    if isinstance(node, ast.Call):
      called = getattr(node.func, "attr", getattr(node.func, "id", ""))
      if called.startswith("check_"):
        names |= {a.value for a in node.args[1:]
                  if isinstance(a, ast.Constant) and str(a.value).isidentifier()}
  return names


def test_errors_page_covers_every_checked_argument():
  checked = {}
  for path in sorted((ROOT / "optax_dist").glob("_*.py")):
    if path.name not in PRIVATE_CHECKS:
      for name in _checked_arguments(path):
        checked.setdefault(name, path.name)
  documented = {name for what, _, _ in _error_rows() for name in re.findall(r"`(\w+)", what)}
  assert len(checked) > 30, checked  # the scan finds the checks
  missing = {name: where for name, where in checked.items() if name not in documented}
  assert not missing, f"docs/errors.md has no row for these checked arguments: {missing}"


# ------------------------------------------------------------------------------------------
# (c) The site builds with warnings as errors.


def _missing_build_deps() -> list[str]:
  return [m for m in ("sphinx", "myst_parser", "furo") if importlib.util.find_spec(m) is None]


@pytest.mark.slow
@pytest.mark.skipif(bool(_missing_build_deps()), reason="install the `docs` extra to build the site")
def test_sphinx_build_succeeds_with_warnings_as_errors(tmp_path):
  """In this process, which has imported JAX and the package that autodoc imports (a
  subprocess would import them again). The extensions' Python deprecation warnings are ignored,
  as a plain ``sphinx-build`` does; the build's own warnings are errors."""
  from sphinx.cmd.build import build_main

  out, warnings_file = tmp_path / "html", tmp_path / "warnings.txt"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", PendingDeprecationWarning)
    status = build_main(["-W", "--keep-going", "-q", "-w", str(warnings_file), "-b", "html",
                         "-d", str(tmp_path / "doctrees"), str(DOCS), str(out)])
  assert status == 0, f"sphinx-build failed:\n{warnings_file.read_text()[-5000:]}"
  api = (out / "api.html").read_text()
  for name in optax_dist.__all__:
    assert f'id="optax_dist.{name}"' in api, f"api.html has no entry for {name}"
  for page in PAGES:
    assert (out / page.relative_to(DOCS).with_suffix(".html")).exists(), page
