"""Maps the design card's top-level folders onto the ``kvferry`` package namespace.

core/, backends/ and sim/ install as kvferry.core, kvferry.backends and kvferry.sim, so nothing
generic (a bare ``core`` or ``sim``) lands in site-packages. Subpackages are found automatically.
"""

from setuptools import find_packages, setup

ROOTS = {"kvferry": "kvferry", "kvferry.core": "core", "kvferry.backends": "backends", "kvferry.sim": "sim"}

packages: list[str] = []
for package, folder in ROOTS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

# Hardware profiles (sim/deploy/profiles/*.toml) are data, read through importlib.resources.
setup(packages=packages, package_dir=ROOTS, package_data={"kvferry.sim.deploy": ["profiles/*.toml"]})
