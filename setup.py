"""Packaging beyond pyproject.toml: a wheel carries configs/ (which stays at the repository's
top level) as minidist/_configs, where minidist.train.config finds it once installed."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConfigs(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads configs/ where it is
            return
        target = Path(self.build_lib) / "minidist" / "_configs"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(Path(__file__).resolve().parent / "configs", target,
                        ignore=shutil.ignore_patterns("__pycache__"))


setup(cmdclass={"build_py": BuildWithConfigs})
