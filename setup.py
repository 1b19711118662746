"""Maps the design card's top-level folders onto the ``kvferry`` package namespace.

core/, backends/ and sim/ install as kvferry.core, kvferry.backends and kvferry.sim, so nothing
generic (a bare ``core`` or ``sim``) lands in site-packages. Subpackages are found automatically.
"""

from setuptools import Extension, find_packages, setup

ROOTS = {"kvferry": "kvferry", "kvferry.core": "core", "kvferry.backends": "backends", "kvferry.sim": "sim"}

packages: list[str] = []
for package, folder in ROOTS.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

# The native transfer engine (backends/native/engine.c) and its host gather/scatter (copy.c): a
# plain C library with no Python API, loaded with ctypes (backends/nixl/native.py). Built from
# source at install; it links nothing of NIXL's (it opens NIXL's C API at run time), so it builds
# without the nixl wheel.
native_engine = Extension(
    "kvferry.backends.native._kvf_engine",
    sources=["backends/native/engine.c", "backends/native/copy.c"],
    extra_compile_args=["-std=c11", "-O2", "-Wall"],
    libraries=["dl", "pthread"],
    optional=True,  # no compiler: the Python executor runs, and says so in one line
)

# Hardware profiles (sim/deploy/profiles/*.toml) are data, read through importlib.resources.
setup(
    packages=packages,
    package_dir=ROOTS,
    package_data={"kvferry.sim.deploy": ["profiles/*.toml"]},
    ext_modules=[native_engine],
)
