"""Finding the adapter for a path.

First-party adapters come from ``ckpttool.formats``; others register under the entry-point group
``ckpttool.formats`` (each entry point names an object following the adapter protocol). Adapters
are tried in order; when none matches, the error carries every adapter's reason.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import shlex
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

from ckpttool.errors import (
    CkptError,
    CorruptFileError,
    FormatNotRecognizedError,
    NotFoundError,
    PartOfCheckpointError,
    PathEscapeError,
)
from ckpttool.formats.base import Adapter
from ckpttool.io import escapes, followed, list_files, not_found
from ckpttool.manifest import Manifest, is_seal_name
from ckpttool.naming import kinds_by_sibling, plural
from ckpttool.values import gc_paused

_FIRST_PARTY = ("megatron", "deepspeed", "rankshards", "dcp", "safetensors", "torchsave")


def adapters() -> list[Adapter]:
    """Every known adapter, first-party ones first, in detection order (a module may define
    several in ``ADAPTERS``)."""
    found: list[Adapter] = []
    for m in _FIRST_PARTY:
        module = importlib.import_module(f"ckpttool.formats.{m}")
        found += getattr(module, "ADAPTERS", None) or [module.ADAPTER]
    found += _plugins()
    return found


@functools.cache
def _plugins() -> tuple[Adapter, ...]:
    """Adapters registered by other packages, looked up once per process: scanning the installed
    distributions' entry points costs about 10 ms, which every describe paid."""
    return tuple(ep.load() for ep in entry_points(group="ckpttool.formats"))


def detect(path: str | Path) -> Adapter:
    """The adapter that recognises ``path``; FormatNotRecognizedError lists every reason if none."""
    p = Path(path)
    if not p.exists():
        raise not_found(p)
    if not (p.is_dir() or p.is_file()):
        raise NotFoundError(
            f"{p}: neither a regular file nor a directory (a device, a pipe or a socket)",
            hint="point ckpttool at the checkpoint file or directory",
            path=str(p),
        )
    reasons: dict[str, str] = {}
    guess: Adapter | None = None
    for adapter in adapters():
        verdict = adapter.detect(p)
        if verdict.matches and not verdict.weak:
            return adapter
        if verdict.matches:
            guess = guess or adapter  # taken only if no adapter after it claims the path
        reasons[adapter.name] = verdict.reason
    if guess is not None:
        return guess
    raise FormatNotRecognizedError(str(p), reasons)


_SCANNED = 256
"""sub-folders of an unrecognised folder looked at, at most, for checkpoints of their own"""


def _checkpoints_in(folder: Path) -> list[tuple[str, str]]:
    """The sub-folders of ``folder`` that are checkpoints themselves (name, format), by their names
    and small metadata only, in the order of the numbers in their names: a run's output folder
    (``checkpoint-500``, ``step_10``, ``global_step3``) given where one checkpoint was meant. Links
    are not followed."""
    try:
        with os.scandir(folder) as entries:
            subs = sorted(
                (e.name for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")),
                key=_numbered,
            )[:_SCANNED]
    except OSError:
        return []
    found = []
    for name in subs:
        with contextlib.suppress(CkptError, OSError):
            found.append((name, detect(folder / name).name))
    return found


def _numbered(name: str) -> tuple[int, str]:
    """A sort key: the last number in ``name`` (``checkpoint-500`` after ``checkpoint-90``), then
    the name."""
    digits = re.findall(r"\d+", name)
    return (int(digits[-1]) if digits else -1, name)


def _folder_of_checkpoints(folder: Path, held: list[tuple[str, str]]) -> FormatNotRecognizedError:
    """The error for a folder that holds checkpoints rather than being one: it names them (the
    first few) and the one to give."""
    names = [n for n, _ in held]
    # a run's saves: names alike but for their numbers (checkpoint-500, checkpoint-1000), not two
    # checkpoints whose names hold digits (fsdp2, mesh2x2)
    numbered = all(re.search(r"\d", n) for n in names) and len({re.sub(r"\d+", "#", n) for n in names}) == 1
    shown_names = names if numbered else sorted(names)  # (a run's saves in the order of their numbers)
    formats = ", ".join(sorted({f for _, f in held}))
    shown = ", ".join(shown_names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    if len(names) == 1:
        hint = f"give the checkpoint itself: {folder / names[0]}"
    elif numbered:
        hint = f"give one of them; the last by the number in its name is {folder / names[-1]}"
    else:
        hint = f"give one of them, such as {folder / shown_names[0]}"
    count = plural(len(names), "checkpoint")
    return FormatNotRecognizedError(
        str(folder),
        {"folder": f"holds {count}"},
        message=f"{folder}: a folder holding the checkpoint {shown} ({formats}), not a checkpoint itself"
        if len(names) == 1
        else f"{folder}: a folder of {count} ({formats}), not one: {shown}",
        hint=hint,
    )


def describe(path: str | Path) -> tuple[Adapter, Manifest]:
    """Detect the format of ``path`` and build its manifest from metadata. A single file given by a
    link is read where the link leads: the user named it (the links inside a checkpoint directory
    stay confined to it)."""
    path = followed(path)
    try:
        adapter = detect(path)
    except FormatNotRecognizedError:
        # (said here, where the user gave the path, not in detect: the readers' own probes of the
        # folders above a file call detect, and would scan each one's sub-folders for nothing)
        if (whole := next(enclosing(Path(path), 2), None)) is not None:
            part = "folder" if Path(path).is_dir() else "file"
            raise PartOfCheckpointError(
                str(path), whole[1].format, str(whole[0]), "read alone, it is no checkpoint", part=part
            ) from None
        if Path(path).is_dir() and (held := _checkpoints_in(Path(path))):
            raise _folder_of_checkpoints(Path(path), held) from None
        if _is_container(Path(path)):
            raise FormatNotRecognizedError(
                str(path),
                {},
                message=f"{path}: a ckpttool container (written by 'ckpttool compress' or 'ckpttool delta create'), "
                "not a checkpoint",
                hint=f"restore it first: ckpttool decompress {shlex.quote(str(path))} -o DIR (a compressed "
                f"checkpoint), or ckpttool delta apply BASE {shlex.quote(str(path))} -o DIR (a delta); then give DIR",
            ) from None
        raise
    return adapter, _described(adapter, path)


def _is_container(path: Path) -> bool:
    """Whether ``path`` is a file that begins as the containers of compress and delta do (asked
    only of a path no format claims: delta and its codecs are imported for nothing else)."""
    from ckpttool.delta import is_container_head

    try:
        with path.open("rb") as fh:
            return is_container_head(fh.read(16))
    except OSError:
        return False


def _described(adapter: Adapter, path: str | Path) -> Manifest:
    """The manifest ``adapter`` builds of ``path``, its seal files marked as such and the state
    named by its siblings; values its format never writes raised as a damaged checkpoint."""
    # describe builds 10^5..10^6 small records (the unpickled metadata, then the manifest) and frees
    # none of them until it returns: the cycle collector would rescan them all, again and again
    # (about half of inspect's time at 100 000 items). Nothing it builds is cyclic garbage.
    try:
        with gc_paused():
            manifest = adapter.describe(Path(path))
    except PathEscapeError as exc:
        _name_other_links(Path(path), exc)
        raise
    except CkptError:
        raise
    except UNTRUSTED_SHAPE as exc:
        # the adapter met values of a type or size its format never writes (a list where a dict
        # belongs, a negative count, a name used twice): the files are damaged or hostile
        where = _innermost_frame(exc)
        raise CorruptFileError(
            f"{path}: the {adapter.name} checkpoint holds values its format does not write "
            f"({type(exc).__name__}: {str(exc)[:160]}, in {where})",
            hint="the checkpoint is damaged, hostile, or written by a version ckpttool does not know; "
            "rerun with CKPTTOOL_DEBUG=1 and report it if the files are good",
            path=str(path),
        ) from exc
    for f in manifest.files:
        if is_seal_name(f.path.rsplit("/", 1)[-1]):
            f.role = "seal"
    kinds_by_sibling(manifest.items)  # (names alone leave a top-level parameter's state a parameter)
    return manifest


def enclosing(path: Path, levels: int) -> Iterator[tuple[Path, Manifest, str]]:
    """The checkpoints a path is a part of (a DCP ``.metadata`` or ``.distcp`` file, a universal
    checkpoint's ``zero/`` folder, one shard of a set), looked for in the ``levels`` folders above
    it, nearest first: each one's folder, manifest and the path's name in it, where its own files
    (not others kept beside them) include the path. A folder that does not read is passed."""
    here = path.absolute()
    for folder in list(path.parents)[:levels]:
        try:
            manifest = _described(detect(folder), folder)
            rel = here.relative_to(folder.absolute()).as_posix()
        except (CkptError, OSError, ValueError):
            continue
        own = (f.path for f in manifest.files if f.role not in ("aux", "seal"))
        if any(f == rel or f.startswith(rel + "/") for f in own):
            yield folder, manifest, rel


def _name_other_links(root: Path, exc: PathEscapeError) -> None:
    """An adapter stops at the first link out of the checkpoint it meets: the other links out
    beside it (in the same top folder: the save's tag or iteration, or the checkpoint directory
    itself) join it in ``exc.others``, so that one run names them all."""
    if exc.others or not exc.path or escapes(exc.path) or not root.is_dir():
        return  # (a path the metadata spells out of the checkpoint is not a link)
    top = exc.path.split("/", 1)[0] if "/" in exc.path else ""
    scope = root / top if top else root
    if scope.is_symlink() or not scope.is_dir():
        return
    try:
        list_files(scope, relative_to=root)
    except PathEscapeError as found:
        exc.others = [e for e in (found, *found.others) if e.path != exc.path]


UNTRUSTED_SHAPE = (
    AttributeError,
    TypeError,
    KeyError,
    IndexError,
    ValueError,
    ZeroDivisionError,
    OverflowError,
    RecursionError,
    UnicodeError,
)
"""What walking an unexpected object tree raises; turned into a clear error by :func:`describe`."""


def _innermost_frame(exc: BaseException) -> str:
    tb = exc.__traceback__
    where = "?"
    while tb is not None:
        code = tb.tb_frame.f_code
        where = f"{Path(code.co_filename).parent.name}/{Path(code.co_filename).name}:{tb.tb_lineno} {code.co_name}"
        tb = tb.tb_next
    return where
