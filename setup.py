# The checkout keeps the Hydra configs at the top level (configs/); the wheel ships them as gem/configs.
# pyproject.toml cannot map one subpackage to another folder while discovering the rest, hence this file.
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["gem", "gem.*"]) + ["gem.configs"],
    package_dir={"gem.configs": "configs"},
)
