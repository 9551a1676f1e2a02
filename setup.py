"""The packages: the repository's app/, engine/ and models/ install as duet.app, duet.engine and
duet.models, so `import app` never resolves to duet. Everything else is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

FOLDERS = ("app", "engine", "models")
# namespaces: models/demo, engine/kernels, app/ui are data folders without __init__.py. The demo
# model's training recipe (models/recipe) runs from the repo and does not ship.
found = find_namespace_packages(include=[f"{folder}*" for folder in FOLDERS], exclude=["models.recipe*"])
setup(packages=[f"duet.{name}" for name in found], package_dir={f"duet.{folder}": folder for folder in FOLDERS})
