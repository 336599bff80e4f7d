"""pflower: partially personalized federated learning on Flower.

The version lives in one place, ``pyproject.toml``; ``__version__`` reads it from the
installed package's metadata.
"""

from importlib import metadata

try:
    __version__ = metadata.version("pflower")
except metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
