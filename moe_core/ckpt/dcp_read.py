"""Reading ``torch.distributed.checkpoint`` (DCP) checkpoints without running code from them.

DCP's own reader unpickles a checkpoint's ``.metadata`` and its load planner unpickles stored
objects with ``weights_only=False``: loading a checkpoint from someone else with plain
``dcp.load`` can execute whatever code its author put there. Every read of moe_core goes
through ``load`` and ``read_metadata`` here instead: ``.metadata`` passes an allow-list (DCP's
metadata classes, torch sizes and dtypes, paths) and stored objects load with
``weights_only=True``; a checkpoint that asks for anything else is refused in one sentence.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from moe_core.errors import CheckpointError
from moe_core.files import inside

# What a DCP .metadata pickle refers to (besides torch dtypes): nothing here runs code.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}
REFUSAL = "refused, since unpickling it could run code; load only checkpoints you trust"
# What an allow-listed constructor or the unpickler raises on a pickle fed junk (a bad layout
# name, wrong arguments, a cut-off file): refused as unreadable, never a traceback.
_UNPICKLE_ERRORS = (
    pickle.PickleError,
    EOFError,
    LookupError,
    ValueError,
    TypeError,
    AttributeError,
    OverflowError,
)


def inner_error(err: BaseException, kind: type[BaseException]) -> BaseException | None:
    """``err`` itself when it is a ``kind``, else the first failure of that kind that DCP
    wrapped inside it (its ``CheckpointException`` collects each rank's exception)."""
    if isinstance(err, kind):
        return err
    for failure in (getattr(err, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, kind):
            return inner
    return None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Single-process runs save and load without a process group on purpose: no warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (its name is the message)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and name not in _ALLOWED.get(module, ()):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` is unpickled through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        folder = Path(str(self.path))
        inside(folder, Path(path).name, folder, CheckpointError)  # not a symlink leading out
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except _UNPICKLE_ERRORS as err:
            what = err if isinstance(err, _Refused) else f"something unreadable ({err!r})"
            raise CheckpointError(
                f"{path} asks to load {what}, which checkpoint metadata never needs: {REFUSAL}."
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata.")
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(storage, dict):
            raise CheckpointError(
                f"{path} holds no storage map of tensors to files, so it is not DCP metadata."
            )
        for info in storage.values():  # the files the load opens: each inside the checkpoint
            inside(folder, getattr(info, "relative_path", None), path, CheckpointError)
            piece = (getattr(info, "offset", None), getattr(info, "length", None))
            if not all(type(n) is int and n >= 0 for n in piece):
                raise CheckpointError(
                    f"{path} stores a tensor at offset and length {piece}, which is not allowed: "
                    "two whole numbers from 0 (where its bytes lie in its file)."
                )
        if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
            raise CheckpointError(
                f"{path} holds no map of the checkpoint's entries, so it is not DCP metadata."
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Stored objects (our trainer state: a string, a number) load as plain data only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # our state dicts are flat: the key read is the caller's own key
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def read_metadata(path: str | Path) -> Metadata:
    """A checkpoint's DCP metadata, read safely."""
    return SafeReader(str(path)).read_metadata()


def load(state: dict[str, Any], path: str | Path, **kwargs: Any) -> None:
    """``dcp.load`` of ``state`` from ``path`` through the safe reader and planner
    (``kwargs``: ``process_group``, ``no_dist``)."""
    read_metadata(path)  # a refusal here is the one sentence (dcp.load would reword it)
    try:
        with quiet():
            dcp.load(
                state,
                checkpoint_id=str(path),
                storage_reader=SafeReader(str(path)),
                planner=_SafeLoadPlanner(),
                **kwargs,
            )
    except BaseException as err:
        refused = inner_error(err, CheckpointError)
        if refused is not None:
            raise refused from None
        unsafe = inner_error(err, pickle.UnpicklingError)
        if unsafe is None:
            raise
        raise CheckpointError(
            f"checkpoint {path} stores an object that is not plain data ({unsafe}): {REFUSAL}."
        ) from None
