"""Inert ``torchvision`` for the CPU test lane of the SGLang integration.

SGLang imports torchvision at module import time (``from torchvision.io import decode_jpeg``),
and every torchvision wheel on PyPI links the CUDA torch libraries, so with a CPU torch the
real package fails to import. This stub makes every ``torchvision`` and ``torchvision.*`` name
an importable placeholder; calling one raises NotImplementedError. Put this folder's parent on
``sys.path`` only for the SGLang tests .
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Placeholder:
    """Stands for any torchvision attribute; usable as a base class, fails when called."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"torchvision stub: {self._name} is not available on the CPU test lane")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(modname: str):
    def __getattr__(item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{modname}.{item}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``torchvision.<x>`` import with an empty package of placeholders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleFinder())

__getattr__ = _module_getattr("torchvision")
