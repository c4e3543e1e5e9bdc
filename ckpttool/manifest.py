"""The common manifest: what a checkpoint holds and where every byte of it lives.

Adapters (``ckpttool.formats.*``) build a :class:`Manifest` from a directory; every command works
on manifests only. The records are plain slotted dataclasses (cheap to build by the hundred
thousand); pydantic is used only at the JSON boundary, to dump, to validate what is read back and
to generate ``docs/manifest.schema.json``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from ckpttool.geometry import Box

SCHEMA_VERSION = 1
SEAL_NAME = "ckpttool.manifest.json"
"""The file ``seal`` writes beside a checkpoint; adapters list it with role ``seal``."""


def is_seal_name(name: str) -> bool:
    """Whether a file name is a seal's: ``ckpttool.manifest.json``, or ``<anything>.ckpttool.manifest.json``
    (a single file's seal, or one written with ``seal --out``)."""
    return name == SEAL_NAME or name.endswith("." + SEAL_NAME)


_SCHEMA_CONFIG: Any = {"use_attribute_docstrings": True}  # read by pydantic at the JSON boundary
_IN_MEMORY: Any = {"exclude": True}
"""Field metadata of a field that is not serialised: pydantic takes it as ``Field(exclude=True)``
(left out of dumps and of the serialization schema), :func:`_plain` skips it."""

Kind = Literal["param", "master", "optim", "rng", "dataloader", "scheduler", "counter", "object"]
KINDS: tuple[Kind, ...] = ("param", "master", "optim", "rng", "dataloader", "scheduler", "counter", "object")

StateName = Literal["optimizer", "rng", "dataloader", "scheduler", "step"]

STATE_KINDS: dict[StateName, Kind] = {
    "optimizer": "optim",
    "rng": "rng",
    "dataloader": "dataloader",
    "scheduler": "scheduler",
}
"""the kind of item each piece of training state is held as (the step: the manifest's ``step``)"""

KEPT_BESIDE: tuple[StateName, ...] = ("optimizer", "scheduler", "rng")
"""training state a checkpoint may keep in files beside its format's (``extras["state_files"]``: a
Hugging Face Trainer's ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``), which ckpttool reads
but carries into no other layout or format; the step and dataloader place they may give too
(``trainer_state.json``) are the manifest's own"""
FileRole = Literal["metadata", "data", "tracker", "aux", "seal"]


@dataclass(slots=True, kw_only=True)
class Piece:
    __pydantic_config__ = _SCHEMA_CONFIG
    """One stored part of an item."""

    file: str
    """path of the file holding the bytes, relative to the checkpoint root"""
    locator: dict[str, Any]
    """where inside ``file``: format specific (byte range, zip member, tensor name, key path)"""
    box: Box
    """the region of the logical tensor this piece holds (``((), ())`` for 0-d and objects)"""
    flat: tuple[int, int] | None = None
    """``(start, length)``: the piece holds only these elements of ``box`` flattened in C order"""
    replica: int = 0
    """0 for the first copy of a box, 1.. for further copies written by other ranks"""
    rank: int | None = None
    """the rank that wrote the piece, where the format says"""
    nbytes: int = 0
    """bytes of the piece's values (uncompressed)"""
    checksum: str | None = None
    """xxh3-128 of the piece's value bytes in C order, when known"""

    @property
    def numel(self) -> int:
        return self.flat[1] if self.flat is not None else self.box.volume


UNSAFE_PICKLE = "unsafe pickle"
"""how :attr:`Item.error` starts where the reader refused the item's pickle"""


@dataclass(slots=True, kw_only=True)
class Item:
    __pydantic_config__ = _SCHEMA_CONFIG
    """A named logical value: a whole tensor, or a non-tensor object."""

    name: str
    """the checkpoint's own fully-qualified name, e.g. ``model.fc1.weight``"""
    kind: Kind
    dtype: str | None = None
    """torch dtype name of the logical tensor; None for objects"""
    shape: tuple[int, ...] | None = None
    """global shape of the logical tensor; None for objects"""
    pieces: list[Piece] = field(default_factory=list)
    value: Any = None
    """a small plain value (int, float, str, bool, short list) read from metadata, for display"""
    summary: str | None = None
    """for a value too large to keep in ``value``: its type and length, e.g. ``tuple of 3``"""
    error: str | None = None
    """why the item cannot be loaded (e.g. an unsafe pickle), when it cannot; where its pickle was
    refused it starts with "unsafe pickle", where it is damaged or unreadable it does not"""
    nesting: tuple[str | int, ...] | None = field(default=None, compare=False, repr=False, metadata=_IN_MEMORY)
    """where the value sits in the nested state dict the checkpoint was saved from, where the format
    records it (DCP's ``planner_data``: dict keys and list indices); kept in memory for writers of
    the same format, never serialised (not in the JSON or the schema)"""
    saved_in: str | None = field(default=None, compare=False, repr=False, metadata=_IN_MEMORY)
    """the name of the tensor the format saves this item's values in, where that is another than the
    item (megatron-core's ``torch_dist`` stacks a layer's tensors over the layers, and the experts,
    which ckpttool reads one item each); in memory only, never serialised"""
    nonfinite: str | None = field(default=None, compare=False, repr=False, metadata=_IN_MEMORY)
    """``"NaN"`` or ``"Inf"`` for a non-tensor value holding such a float (``value`` shows it as the
    text ``'nan'``), for ``verify --deep``; in memory only, never serialised"""

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    @property
    def refused(self) -> bool:
        """Whether the item's pickle was refused (it names a global outside the allowlist), as
        opposed to unreadable (damage, permissions) or readable."""
        return (self.error or "").startswith(UNSAFE_PICKLE)

    @property
    def refused_global(self) -> str | None:
        """The global a refused pickle names (the readers write ``unsafe pickle: ... refers to
        <global>``); None where the pickle was not refused."""
        return (self.error or "").rsplit("refers to ", 1)[-1] if self.refused else None

    @property
    def nbytes(self) -> int:
        """Bytes of the logical value: one copy, replicas excluded."""
        return sum(p.nbytes for p in self.pieces if p.replica == 0)


@dataclass(slots=True, kw_only=True)
class Layout:
    __pydantic_config__ = _SCHEMA_CONFIG
    """The parallel layout the writer used, as far as the format records it."""

    world_size: int | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    ep: int | None = None
    vpp: int | None = None
    zero_stage: int | None = None


@dataclass(slots=True, kw_only=True)
class FileRecord:
    __pydantic_config__ = _SCHEMA_CONFIG
    path: str
    """relative to the checkpoint root, '/'-separated"""
    size: int
    role: FileRole
    ranks: list[int] = field(default_factory=list)
    checksum: str | None = None


@dataclass(slots=True, kw_only=True)
class Manifest:
    __pydantic_config__ = _SCHEMA_CONFIG
    root: str
    format: str
    format_version: str | None = None
    step: int | None = None
    layout: Layout = field(default_factory=Layout)
    files: list[FileRecord] = field(default_factory=list)
    items: dict[str, Item] = field(default_factory=dict)
    """in checkpoint order"""
    extras: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def add(self, item: Item) -> Item:
        if item.name in self.items:
            from ckpttool.errors import CorruptFileError

            file = item.pieces[0].file if item.pieces else None  # (named: verify's report gave null)
            raise CorruptFileError(
                f"{file + ': ' if file else ''}two entries of the checkpoint are both named {item.name!r} (a dotted "
                "key and a nested one, or two files holding the same state)",
                hint="ckpttool names a nested value by its keys joined with dots, so a key 'a.b' and a key 'b' "
                "inside 'a' are one name to it: rename one and save again (else the checkpoint is damaged, or "
                "written by a tool ckpttool does not know)",
                path=file,
            )
        self.items[item.name] = item
        return item

    def missing_state(self) -> list[StateName]:
        """Training state a resume would need and this checkpoint does not hold."""
        kinds = {item.kind for item in self.items.values()}
        present: dict[StateName, bool] = {state: kind in kinds for state, kind in STATE_KINDS.items()}
        present["step"] = self.step is not None
        # (state in files beside the model that the format itself does not read, such as a Hugging
        # Face Trainer's optimizer.pt: the adapter names them, state -> file; and state its metadata
        # holds, such as Megatron's args.consumed_train_samples: state -> where)
        held = {**(self.extras.get("state_files") or {}), **(self.extras.get("state_in_metadata") or {})}
        return [state for state, ok in present.items() if not ok and state not in held]

    def file(self, path: str) -> FileRecord:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    # -- JSON boundary -------------------------------------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON form (``docs/manifest.schema.json``); plain code, as it runs for every seal."""
        data: dict[str, Any] = _plain(self)
        return data

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Manifest:
        manifest: Manifest = _adapter().validate_python(data)
        return manifest


class ReplicaCounter:
    """Numbers copies of the same region of an item as adapters add pieces (0 for the first)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, Any], int] = {}

    def next(self, item: str, region: Any) -> int:
        n = self._seen.get((item, region), 0)
        self._seen[(item, region)] = n + 1
        return n


def _plain(obj: Any) -> Any:
    if isinstance(obj, Box):
        return {"offsets": list(obj.offsets), "sizes": list(obj.sizes)}
    if hasattr(obj, "__dataclass_fields__"):
        fields = obj.__dataclass_fields__
        return {name: _plain(getattr(obj, name)) for name in fields if not fields[name].metadata.get("exclude")}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


@functools.cache
def _adapter() -> Any:
    """pydantic's validator for Manifest (built once: building it costs about 0.1 s)."""
    from pydantic import TypeAdapter

    return TypeAdapter(Manifest)


def json_schema() -> dict[str, Any]:
    """The JSON schema of a serialised manifest (written to ``docs/manifest.schema.json``)."""
    schema: dict[str, Any] = _adapter().json_schema(mode="serialization")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ckpttool manifest"
    return schema
