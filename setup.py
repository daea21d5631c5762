"""The one compiled piece: kvtier._chainkeys (chained xxh3-128 page keys in C, see kvtier/hashing.py).

Optional: it needs a C compiler and xxhash.h (Debian/Ubuntu: ``apt-get install libxxhash-dev``;
``./run.sh test`` installs it). Without them the build goes on and kvtier hashes the same keys in
Python, slower (``kvtier.hashing.NATIVE_KEYS`` says which one runs)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier._chainkeys", ["kvtier/_chainkeys.c"], extra_compile_args=["-O3"], optional=True)])
