"""The wheel holds every module: build it from this checkout, install it alone in a fresh
virtual environment (torch and the other dependencies reached through a path entry, not
installed again), and import every library module from it, not from the checkout."""

from __future__ import annotations

import pathlib
import shutil
import site
import subprocess
import sys
import venv
import zipfile

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = {"composable": "shardwise.composable", "mesh": "shardwise.mesh", "checkpoint": "shardwise.checkpoint"}


def _library_modules() -> list[str]:
    names = []
    for folder, pkg in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and parts[-1] == "__main__":
                continue
            names.append(".".join([pkg, *parts]))
    return names


def test_wheel_installs_every_module(tmp_path):
    dist, src = tmp_path / "dist", tmp_path / "src"
    # from a copy: a build/ folder left in the checkout would carry stale modules into the wheel
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".hypothesis", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"pip wheel failed:\n{build.stdout}\n{build.stderr}"
    (wheel,) = dist.glob("shardwise-*.whl")
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env)
    py = env / "bin" / "python"
    target = pathlib.Path(subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    with zipfile.ZipFile(wheel) as z:  # a pure-Python wheel installs by unpacking
        z.extractall(target)
    # the dependencies (torch, einops, ...) from this environment, as a plain path entry: the
    # editable install's import hook in it is a .pth file, which a path entry does not run
    (target / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    modules = _library_modules()
    assert "shardwise.composable._fsdp._layout" in modules and "shardwise.checkpoint" in modules
    code = (
        "import importlib, sys\n"
        f"mods = {modules!r}\n"
        "for m in mods:\n"
        "    mod = importlib.import_module(m)\n"
        f"    assert mod.__file__.startswith({str(target)!r}), (m, mod.__file__)\n"
        "print(len(mods))\n"
    )
    run = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, f"importing from the wheel failed:\n{run.stdout}\n{run.stderr}"
    assert int(run.stdout.strip()) == len(modules)
