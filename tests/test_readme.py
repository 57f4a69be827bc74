"""README.md runs as written: its ```python blocks, and the extras its install lines name.

Convention for README.md: every ```python block runs on its own, in a fresh namespace, unless its
first line is ``# continues the previous block``; then it runs in the namespace the previous block
left. The blocks run in one fresh Python process on the default CPU device (no emulated devices:
a reader's machine has one), in an empty temporary working directory.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONTINUES = "# continues the previous block"

_OPEN = re.compile(r"^(?P<fence>`{3,})python\s*$")

# Runs the blocks: each one compiled with README.md's line numbers, so that a traceback points at
# the line of the README; a block continuing the previous one shares its namespace.
_RUNNER = """
import json, sys
namespace = None
for first_line, continues, source in json.load(open(sys.argv[1])):
  if not continues:
    namespace = {"__name__": "__main__"}
  exec(compile("\\n" * (first_line - 1) + source, "README.md", "exec"), namespace)
"""


def python_blocks(text: str) -> list[tuple[int, bool, str]]:
  """The ```python blocks of ``text``: (line of the first code line, continues?, source)."""
  blocks, lines = [], text.splitlines()
  i = 0
  while i < len(lines):
    match = _OPEN.match(lines[i])
    if match:
      start, body = i + 2, []
      i += 1
      while i < len(lines) and lines[i].strip() != match["fence"]:
        body.append(lines[i])
        i += 1
      if i == len(lines):
        raise AssertionError(f"README.md: unclosed ```python block at line {start - 1}")
      continues = bool(body) and body[0].strip() == CONTINUES
      blocks.append((start, continues, "\n".join(body) + "\n"))
    i += 1
  return blocks


def run_blocks(blocks, tmp_path) -> subprocess.CompletedProcess:
  tmp_path.mkdir(parents=True, exist_ok=True)
  spec = tmp_path / "blocks.json"
  spec.write_text(json.dumps(blocks))
  work = tmp_path / "work"
  work.mkdir()
  env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
  env.pop("XLA_FLAGS", None)
  return subprocess.run(
    [sys.executable, "-c", _RUNNER, str(spec)],
    cwd=work, env=env, capture_output=True, text=True, timeout=300, check=False,
  )


def test_python_blocks_parser():
  text = (
    "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\n# continues the previous block\nb = a\n"
    "```\n````python\nc = 2\n````\n"
  )
  assert python_blocks(text) == [
    (3, False, "a = 1\n"),
    (9, True, "# continues the previous block\nb = a\n"),
    (13, False, "c = 2\n"),
  ]


def test_runner_fails_on_a_name_the_block_does_not_define(tmp_path):
  """A fresh block does not see the previous block's names; a continuing one does."""
  proc = run_blocks([(1, False, "import math\n"), (3, False, "math.pi\n")], tmp_path / "a")
  assert proc.returncode != 0 and "NameError: name 'math' is not defined" in proc.stderr
  assert 'File "README.md", line 3' in proc.stderr
  proc = run_blocks([(1, False, "import math\n"), (3, True, f"{CONTINUES}\nmath.pi\n")],
                    tmp_path / "b")
  assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_readme_blocks_run_as_written(tmp_path):
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 9, f"expected the README's examples, found {len(blocks)} blocks"
  assert not blocks[0][1], "the first ```python block cannot continue a previous one"
  for line, _, source in blocks:
    ast.parse(source, filename=f"README.md:{line}")  # a syntax error names its block first
  proc = run_blocks(blocks, tmp_path)
  assert proc.returncode == 0, f"a README.md code block failed:\n{proc.stderr[-4000:]}"


def test_readme_install_lines_name_existing_extras():
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
  ]
  text = README.read_text()
  named = set(re.findall(r"""pip install ["']?(?:\.|optax-dist)\[(\w+)\]""", text))
  named |= set(re.findall(r"optax-dist\[(\w+)\]", text))
  assert {"checkpoint", "examples"} <= named, named
  assert named <= set(extras), f"README.md names extras {sorted(named - set(extras))} that do not exist"
  assert re.search(r"`pip install \.`", text), "README.md should say how to install from a clone"


@pytest.mark.parametrize("extra", ["checkpoint", "examples"])
def test_extras_bring_what_the_optional_modules_import(extra):
  """``checkpoint`` brings Orbax and ``examples`` brings Flax (and Orbax, for the command)."""
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0] for d in deps[extra]}
  needed = {"checkpoint": {"orbax-checkpoint"}, "examples": {"flax", "orbax-checkpoint"}}[extra]
  assert needed <= names, (extra, names)


# ------------------------------------------------------------------------------------------
# An optional module without its extra: one line saying which extra to install.

_WITHOUT = {
  "flax": ("flax", "import optax_dist.flax", "`optax_dist.flax` needs Flax", "examples"),
  "orbax": (
    "orbax",
    "from optax_dist.checkpoint import save_eval_params; save_eval_params('c', None, {'w': 0.0})",
    "`optax_dist.checkpoint.save_eval_params` needs orbax-checkpoint",
    "checkpoint",
  ),
}


@pytest.mark.parametrize("missing", sorted(_WITHOUT))
def test_optional_module_without_its_dependency_names_the_extra(missing, tmp_path):
  package, code, says, extra = _WITHOUT[missing]
  # None in sys.modules makes `import package` fail as if it were not installed.
  script = f"import sys\nsys.modules[{package!r}] = None\n{code}\n"
  proc = subprocess.run(
    [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
    env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False,
  )
  assert proc.returncode == 1, proc.stderr
  errors = [line for line in proc.stderr.splitlines() if re.match(r"^\w*Error\b", line)]
  assert len(errors) == 1 and "During handling" not in proc.stderr, proc.stderr
  assert errors[0].startswith(f"ImportError: {says}"), errors[0]
  assert f'`pip install "optax-dist[{extra}]"`' in errors[0], errors[0]


# ------------------------------------------------------------------------------------------
# Packaging: `make dist` builds an sdist and a wheel holding every subpackage, without warnings.


def _missing_dist_tools() -> str | None:
  import importlib.metadata
  import importlib.util

  for module in ("build", "twine"):
    if importlib.util.find_spec(module) is None:
      return f"{module} is not installed (the `dist` extra)"
  major = int(importlib.metadata.version("setuptools").split(".")[0])
  return None if major >= 77 else "setuptools < 77 cannot build an SPDX license"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """The sdist and the wheel built from a copy of the checkout, and the build's output."""
  import shutil

  if reason := _missing_dist_tools():
    pytest.skip(reason)
  src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, src / name)
  shutil.copytree(ROOT / "optax_dist", src / "optax_dist",
                  ignore=shutil.ignore_patterns("__pycache__"))
  env = dict(os.environ)
  env.pop("PYTHONDONTWRITEBYTECODE", None)  # else setuptools warns that it skips byte-compiling
  # --no-isolation: this environment's setuptools (>= 77, checked above), no download.
  proc = subprocess.run(
    [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
    env=env, capture_output=True, text=True, timeout=300, check=False,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
  sources = sorted(p.relative_to(src).as_posix() for p in (src / "optax_dist").rglob("*.py"))
  return wheel, sdist, sources, proc.stdout + proc.stderr


def test_build_has_no_warnings(built):
  output = built[3]
  warnings = [line for line in output.splitlines() if re.search(r"(?i)warn|deprecat", line)]
  assert not warnings, "\n".join(warnings)


def test_wheel_holds_every_module_and_the_license(built):
  import zipfile

  wheel, _, sources, _ = built
  names = set(zipfile.ZipFile(wheel).namelist())
  packages = {s.rsplit("/", 1)[0] for s in sources if s.endswith("/__init__.py")}
  assert "optax_dist" in packages and len(sources) > 10, sources
  missing = [s for s in sources if s not in names]
  assert not missing, f"the wheel lacks {missing}"
  info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
  assert f"{info}/licenses/LICENSE" in names
  metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
  assert "License-Expression: Apache-2.0" in metadata
  for extra in ("checkpoint", "examples", "dist"):
    assert f"Provides-Extra: {extra}" in metadata
  # The command's entry point names a module that the wheel holds.
  entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
  target = re.search(r"^optax-dist = ([\w.]+):\w+$", entry, re.MULTILINE)[1]
  assert target.replace(".", "/") + ".py" in names, (target, entry)


def test_sdist_holds_the_sources_and_the_license(built):
  import tarfile

  _, sdist, sources, _ = built
  with tarfile.open(sdist) as tar:
    names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
  assert {"LICENSE", "README.md", "pyproject.toml"} <= names
  assert not [s for s in sources if s not in names]


def test_twine_check_passes(built):
  wheel, sdist, _, _ = built
  proc = subprocess.run(
    [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
    capture_output=True, text=True, timeout=120, check=False,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
