"""Reading Megatron-LM's pickled files without trusting them.

Megatron checkpoints are untrusted input: nothing in them may run code. Two readers:

- `load_torch_file`: `torch.load(weights_only=True)` (tensors, containers, numbers, strings).
  Megatron also pickles `argparse.Namespace` (its args) and objects of classes megacoat does not
  have (enums such as `AttnBackend` inside the args, numpy RNG states, TransformerEngine extra
  state). Namespace is allow-listed as itself; every other class the file names is allow-listed
  as an inert `Opaque` record under the same name: it only stores the values the file gives it
  and never calls anything. The classes are found by reading the pickle's opcodes first
  (nothing executed), so megatron-core need not be installed.
- `load_dcp_metadata`: the `.metadata` file of a PyTorch distributed checkpoint (torch_dist)
  is a plain pickle (protocol 4+, which torch's weights-only unpickler does not read). It is
  read by an unpickler whose `find_class` returns only inert records and a few torch value
  types (Size, dtypes), so no callable of the file's choosing is ever reached.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import pickle
import pickletools
import zipfile
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ..checkpoint.format import CheckpointError


class Opaque:
    """Stand-in for a class megacoat does not import: keeps what the pickle passes, runs nothing."""

    _qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self._qualified_name} {self.args!r}>"


def _opaque_class(module: str, name: str) -> type:
    cls = type(name.split(".")[-1], (Opaque,), {"_qualified_name": f"{module}.{name}"})
    cls.__module__, cls.__qualname__ = module, name  # the key torch's allow-list matches on
    return cls


def _pickle_globals(data: bytes) -> List[Tuple[str, str]]:
    """(module, name) of every GLOBAL / STACK_GLOBAL in a pickle, without executing it."""
    found, strings = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.append((module, name))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.append((strings[-2], strings[-1]))
    return found


def _torch_zip_pickles(path: str) -> Iterator[bytes]:
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.filename.endswith(".pkl"):
                yield z.read(info)


def _allowed_by_torch(module: str, name: str) -> bool:
    return module.startswith("torch") or module in ("collections", "builtins", "_codecs")


@contextlib.contextmanager
def _allow(classes: list):
    if hasattr(torch.serialization, "safe_globals"):  # torch >= 2.5: scoped
        with torch.serialization.safe_globals(classes):
            yield
        return
    torch.serialization.add_safe_globals(classes)  # torch 2.4: process-wide, but only inert classes
    yield


def load_torch_file(path: str) -> Any:
    """A file written by `torch.save` (Megatron's model_optim_rng.pt, common.pt), on the CPU."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a torch.save zip file (truncated or damaged, or the pre-1.6 torch "
                              "format); copy it again, or re-save it with a recent PyTorch or Megatron first")
    names = set()
    for data in _torch_zip_pickles(path):
        names.update(_pickle_globals(data))
    classes: list = [argparse.Namespace]
    for module, name in sorted(names):
        if (module, name) == ("argparse", "Namespace") or _allowed_by_torch(module, name):
            continue
        classes.append(_opaque_class(module, name))
    try:
        with _allow(classes):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused to unpickle ({e}); megacoat reads Megatron files with "
                              "torch.load(weights_only=True) only") from e


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler for torch.distributed.checkpoint metadata: data records only."""

    _VALUES = {("torch", "Size"): tuple, ("collections", "OrderedDict"): dict,
               ("builtins", "set"): set, ("builtins", "frozenset"): frozenset}

    def find_class(self, module: str, name: str):
        if (module, name) in self._VALUES:
            return self._VALUES[(module, name)]
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout_by_name
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                        torch.memory_format)):
            return _constant(getattr(torch, name))
        if module.startswith("torch.distributed.checkpoint") or module in ("pathlib", "enum"):
            return _opaque_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata type")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not expected in checkpoint metadata")


def _layout_by_name(name: str):
    """torch layouts pickle as `_get_layout("torch.strided")`: look the name up, only among layouts."""
    value = getattr(torch, str(name).rsplit(".", 1)[-1], None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _constant(value):
    """torch dtypes pickle as a bare GLOBAL (no call): hand the value itself back."""
    return value


def load_dcp_metadata(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable distributed-checkpoint metadata file ({e})") from e


def record_fields(obj: Any) -> Dict[str, Any]:
    """The fields of an `Opaque` record (dataclasses pickle their fields as state; some as a tuple)."""
    if not isinstance(obj, Opaque):
        raise CheckpointError(f"unexpected object {obj!r} in checkpoint metadata")
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
        merged = dict(state[0] or {})
        merged.update(state[1] or {})
        return merged
    return state if isinstance(state, dict) else {"_state": state, "_args": obj.args}


def load_tensor_bytes(data: bytes) -> torch.Tensor:
    """One tensor item of a .distcp file (written with torch.save)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
