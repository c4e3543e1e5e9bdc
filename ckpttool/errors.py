"""Exceptions that reach the user.

Every user-facing failure is a :class:`CkptError`: one line that names the object, says what was
expected and what was found, plus a hint with the next step. The CLI maps them to exit codes once,
in ``ckpttool.cli``; the library never prints.
"""

from __future__ import annotations

import os
from typing import Literal


class CkptError(Exception):
    """A checkpoint could not be evaluated (exit 3).

    ``rule`` names the ``verify`` rule this failure is a finding of, so ``verify`` can report it
    instead of giving up."""

    exit_code = 3
    default_rule: str | None = None

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        path: str | None = None,
        rule: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.path = path
        self.rule = rule or self.default_rule
        self.rank = rank
        """the rank whose file ``path`` is, where the format's naming says (verify's finding names it)"""
        self.others: list[CkptError] = []
        """the same failure found in other files by the same look (each file a rank cut short):
        ``verify`` reports each, the CLI names them after this one"""
        self.severity: Literal["error", "warning"] | None = None
        """``verify``'s severity for its finding, where it is not the rule's (damage that leaves
        the file loadable: a warning, which ``seal`` still refuses)"""

    def __str__(self) -> str:
        return self.message


def raise_together(errors: list[CkptError]) -> None:
    """Raise the first of ``errors`` carrying the rest as its ``others`` (nothing where there are
    none): one look over many files (every rank's) names each damaged one, not the first."""
    if errors:
        first = errors[0]
        first.others = [*first.others, *(e for rest in errors[1:] for e in (rest, *rest.others))]
        raise first


def name_from_above(errors: list[CkptError], folder: str | os.PathLike[str]) -> None:
    """Name the files of ``errors`` (and of their ``others``) from the folder above ``folder``: a
    reader sent into a save's tag or iteration by its tracker names them from there, and the user
    gave the save directory. An error that names ``folder`` by the path it was read by (the folder
    itself, as a reader given it names it) is left as it is."""
    given = os.fspath(folder)
    name = os.path.basename(given.rstrip("/"))
    for e in (e for d in errors for e in (d, *d.others)):
        if e.path and (e.path == given or e.path.startswith(given + "/")):
            continue
        if e.path and not os.path.isabs(e.path):
            if e.message.startswith(e.path):  # (a message that begins with the file's name: that name too)
                e.message = f"{name}/{e.message}"
            e.path = f"{name}/{e.path}"


class NotFoundError(CkptError):
    """The path given does not exist or is not readable."""


class FormatNotRecognizedError(CkptError):
    """No adapter recognised the directory; ``reasons`` holds each adapter's answer."""

    def __init__(
        self, path: str, reasons: dict[str, str], *, message: str | None = None, hint: str | None = None
    ) -> None:
        """``message`` and ``hint``: what to say where more is known than the reasons (the path is a
        part of a checkpoint, or a folder of them)."""
        lines = "; ".join(f"{name}: {why}" for name, why in reasons.items())
        super().__init__(
            message or f"{path}: not a checkpoint format ckpttool reads ({lines})",
            hint=hint or "point ckpttool at the checkpoint directory itself (the one holding the metadata file)",
            path=path,
        )
        self.reasons = reasons


class PartOfCheckpointError(FormatNotRecognizedError):
    """One rank's file of a checkpoint of another format (a Megatron or DeepSpeed rank file, a
    ``torch_dist`` ``common.pt``) given where a checkpoint was expected: the checkpoint is named."""

    def __init__(self, path: str, fmt: str, folder: str, why: str, *, part: str = "file") -> None:
        said = f"one {part} of the {fmt} checkpoint {folder}: give that ({why})"
        super().__init__(
            path, {"torch": said}, message=f"{path}: {said}", hint=f"give the checkpoint it is part of: {folder}"
        )


_TORCH_DTYPES_NOT_READ = frozenset(
    {"float4_e2m1fn_x2", "complex32", "chalf", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
     "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "int1", "int2", "int3", "int4", "int5", "int6", "int7",
     "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7", "QInt8Storage", "QUInt8Storage", "QInt32Storage",
     "QUInt4x2Storage", "QUInt2x4Storage", "ComplexHalfStorage"}
)  # fmt: skip
"""torch's dtypes (and their storage classes) that ckpttool's readers have no table entry for: a
pickle naming one is refused as any global outside the allowlist, but said to be what it is."""

_SHARDED_TENSOR = "a ShardedTensor (FSDP1's SHARDED_STATE_DICT and LOCAL_STATE_DICT values)"
_TORCH_VALUES_NOT_READ = {
    "torch._utils._rebuild_sparse_tensor": "a sparse tensor",
    "torch._utils._rebuild_sparse_csr_tensor": "a sparse tensor",
    "torch._utils._rebuild_meta_tensor_no_storage": "a tensor on the meta device (saved without its values)",
    "torch._utils._rebuild_qtensor": "a quantized tensor",
    "torch._utils._rebuild_nested_tensor": "a nested tensor",
    "torch._utils._rebuild_device_tensor_from_numpy": "a tensor of a device saved through numpy",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": "a tensor of a device saved through the CPU",
    "torch._utils._rebuild_wrapper_subclass": "a tensor subclass",
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor": _SHARDED_TENSOR,
    "torch.distributed._shard.sharded_tensor.ShardedTensor": _SHARDED_TENSOR,
}
"""torch's own pickled values that ckpttool does not read (``torch.load(weights_only=True)`` reads
most): a pickle naming one is refused, but said to be what it is, not taken for a hostile one."""


class UnsafePickleError(CkptError):
    """A pickle referenced a global outside the format's allowlist; nothing was executed."""

    def __init__(self, file: str, global_name: str, *, what: str = "pickle") -> None:
        module, _, name = global_name.rpartition(".")
        if module == "torch" and name in _TORCH_DTYPES_NOT_READ:  # (a dtype: no code, nothing hostile)
            message = f"{file}: {what} holds a tensor of dtype {global_name}, which ckpttool does not read yet"
            hint = (
                "torch.load(weights_only=True) reads it; ckpttool cannot inspect, verify or convert such a "
                "checkpoint yet (a view of the tensor as torch.uint8 can be saved in its place)"
            )
        elif (value := _TORCH_VALUES_NOT_READ.get(global_name)) is not None:  # (torch's own kind of value)
            message = f"{file}: {what} holds {value} ({global_name}), which ckpttool does not read yet"
            hint = (
                "torch writes this for such values (torch.load(weights_only=True) may read it); ckpttool cannot "
                "inspect, verify or convert such a checkpoint yet"
                + (
                    "; saved through torch.distributed.checkpoint (dcp.save), the same state reads"
                    if value == _SHARDED_TENSOR
                    else ""
                )
            )
        else:
            message = (
                f"{file}: {what} refers to {global_name}, which is not allowed in this format; refused without "
                "running it"
            )
            hint = (
                "the file may be hostile or written by a tool ckpttool does not know; "
                "do not load it with torch.load(weights_only=False) or pickle.load"
            )
        super().__init__(message, hint=hint, path=file)
        self.file = file
        self.global_name = global_name
        self.rule = "unsafe-pickle"
        self.hostile: str | None = None
        """of every global the pickle names, the first that runs code (``_unpickle.hostile``): what
        the reader refused first may be a harmless-looking class placed before it"""


class CorruptFileError(CkptError):
    """A file's bytes do not match what the metadata or the container format promises."""

    default_rule = "corrupt-file"


class IncompleteCheckpointError(CkptError):
    """The checkpoint was never finished (interrupted save, missing metadata or rank files)."""

    default_rule = "incomplete-save"


class PathEscapeError(CkptError):
    """A path taken from metadata points outside the checkpoint root."""

    default_rule = "unsafe-path"
    link_out = False
    """a link in the checkpoint directory that leads out of it (the listing's refusal), not a path
    named by metadata"""


class UnsupportedError(CkptError):
    """The checkpoint holds state of a kind ckpttool does not read yet, which every command would leave
    out (DeepSpeed's MoE expert files, a DTensor holding a pending sum): it is not evaluated at all
    (exit 3), never reported as damage nor passed over."""


class UsageError(CkptError):
    """The request itself is wrong (bad option values, output exists, ...): exit 2."""

    exit_code = 2
