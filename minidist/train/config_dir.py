"""Where minidist's Hydra configs are: the copy a wheel carries inside the package
(minidist/_configs, put there by setup.py), else the repository's top-level configs/ (a
checkout, or an editable install of one)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the minidist/ folder
CANDIDATES = (PACKAGE / "_configs", PACKAGE.parent / "configs")


def config_dir() -> Path:
    """The folder holding train.yaml and the config groups (strategy/, model/, ...)."""
    for candidate in CANDIDATES:
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"minidist's configs are in none of {[str(c) for c in CANDIDATES]}: reinstall minidist "
                            "(pip install .), or run it from a checkout of the repository")
