"""pyproject.toml builds without setuptools' deprecation of the `license = {text = ...}` table (builds stop working
after 2027-02-18): the license is an SPDX expression, which needs setuptools >= 77 as the build backend."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_license_is_an_spdx_expression_and_the_backend_can_read_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    (requirement,) = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(map(int, re.search(r">=\s*([\d.]+)", requirement).group(1).split("."))) >= (77,)


def test_the_metadata_builds_without_a_deprecation(tmp_path):
    """setuptools' own metadata step on pyproject.toml (a copy, beside an empty package, so nothing is written in
    the repository): no deprecation warning, and the wheel's METADATA says the license as an expression."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / "README.md", tmp_path)
    (tmp_path / "kvbench").mkdir()
    (tmp_path / "kvbench" / "__init__.py").write_text("")
    (tmp_path / "out").mkdir()
    build = "from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel('out'))"
    done = subprocess.run([sys.executable, "-W", "always", "-c", build], cwd=tmp_path, capture_output=True,
                          text=True, check=True)
    assert "deprecated" not in done.stderr.lower(), done.stderr
    metadata = (tmp_path / "out" / done.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
