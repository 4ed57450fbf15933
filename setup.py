"""Package discovery; every other setting is in pyproject.toml.

idem is one import namespace laid out in three directories: ``idem/`` is ``idem``,
``retry/`` is ``idem.retry`` and ``spark/`` is ``idem.spark`` (pyproject's
``package-dir``). setuptools' own ``packages.find`` names a package after its
directory, so it would ship ``retry/`` as a top-level ``retry``; here every package
below each directory is found and named under its root.
"""

from setuptools import find_packages, setup

ROOTS = {"idem": "idem", "idem.retry": "retry", "idem.spark": "spark"}


def discovered() -> list[str]:
    """Each root and every package below its directory, named under the root."""
    names: list[str] = []
    for root, directory in ROOTS.items():
        names.append(root)
        names.extend(f"{root}.{sub}" for sub in find_packages(directory))
    return names


setup(packages=discovered())
