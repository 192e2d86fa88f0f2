"""Pick a KV transport by its config name; optional dependencies are imported only here."""
from __future__ import annotations

import importlib

from transfer.base import KVTransport

# name → (module, class, what to install when the module's dependency is missing)
_BACKENDS = {
    "local": ("transfer.local", "LocalTransport", None),
    "nixl": ("transfer.nixl_transport", "NixlTransport", "pip install 'pd-cluster[transfer]'  (GPUs: 'pd-cluster[gpu]')"),
    "ucx": ("transfer.ucx_transport", "UcxTransport", "pip install 'pd-cluster[ucx]'  (CUDA 13: ucxx-cu13)"),
    "ray": ("transfer.ray_transport", "RayTransport", "pip install 'ray[default]'"),
}


def make_transport(backend: str, name: str | None = None, **kwargs) -> KVTransport:
    """A new, unregistered transport of the named backend (local, nixl, ucx, ray)."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown KV transport {backend!r}; choose one of {sorted(_BACKENDS)}")
    module, cls, install = _BACKENDS[backend]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"the {backend!r} KV transport needs a package that is missing "
                          f"({e}); install it with: {install}") from e
    return getattr(mod, cls)(name, **kwargs)
