"""Item names: what kind of state a name holds, the one canonical spelling used to match names
across checkpoints (diff, verify and reshard all go through :func:`canonical`), and how a name
is shown (:func:`printable`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ckpttool.manifest import Item, Kind

_OPTIM_ROOTS = {"optim", "optimizer", "optimizers", "optim_state", "optimizer_state", "optimizer_states", "opt"}
_MODEL_ROOTS = {"model", "models", "module", "state_dict", "model_state_dict", "params", "weights", "ema"}
_RNG = re.compile(r"(^|_)(rng|rngs|random|generator|rng_state|rng_states|cuda_rng|np_rng|py_rng)($|_)", re.I)
_DATA = re.compile(
    r"(^|_)(dataloader|data_loader|dataloaders|sampler|train_loader|data_state|dataset_state)($|_)", re.I
)
_SCHED = re.compile(r"(^|_)(scheduler|lr_scheduler|schedulers|sched|opt_param_scheduler)($|_)", re.I)
COUNTER_NAMES = (
    "step",
    "global_step",
    "global_steps",
    "iteration",
    "iter_num",
    "epoch",
    "train_state.step",
    "global_samples",
    "skipped_steps",
)
STEP_NAMES = ("step", "iteration", "global_step", "global_steps", "train_state.step", "iter_num")
"""Top-level entries whose value is the training step, most specific first."""

_CHAIN = re.compile(r"chained_\d+")
_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def classify(name: str, *, is_tensor: bool) -> Kind:
    """The kind of state an item name holds, from its path segments."""
    segments = name.split(".")
    root = segments[0].lower()
    if _CHAIN.fullmatch(root) and len(segments) > 1:  # megatron-core's ChainedOptimizer prefix
        root = segments[1].lower()
    if root in _OPTIM_ROOTS:
        return "optim"
    if root not in _MODEL_ROOTS:
        for seg in segments:
            if _RNG.search(seg):
                return "rng"
            if _DATA.search(seg):
                return "dataloader"
            if _SCHED.search(seg):
                return "scheduler"
        if name in COUNTER_NAMES or (len(segments) <= 2 and segments[-1] in COUNTER_NAMES):
            return "counter"
    if is_tensor and len(segments) > 2 and (kind := _state_kind(segments[-1])):
        return kind  # ckpttool's own names for per-parameter state (export, convert)
    return "param" if is_tensor else "object"


def _state_kind(last: str) -> Kind | None:
    """The kind of ``<param>.<last>`` where it is per-parameter state: a moment or the fp32 master."""
    if last in MOMENTS:
        return "optim"
    return "master" if last == "fp32" else None


def kinds_by_sibling(items: Mapping[str, Item]) -> None:
    """Per-parameter state whose name alone does not tell (``head_bias.exp_avg``, a top-level
    parameter's: :func:`classify` takes two segments for a parameter's own name) is that state where
    the parameter ``head_bias`` lies beside it with the same shape, or, with no such parameter, where
    both of Adam's moments lie beside it with its shape; ``<param>.step`` is Adam's step where a moment
    lies beside it. (A torch module's name is never both a parameter and a module holding one.)"""
    for name, item in items.items():
        if item.kind != "param" or not item.is_tensor:
            continue
        stem, _, last = name.rpartition(".")
        kind = _state_kind(last)
        if kind is None:
            continue
        owner = items.get(stem)
        if owner is not None and owner.kind == "param" and owner.is_tensor and owner.shape == item.shape:
            item.kind = kind
    # without the parameter beside them (ZeRO-3 and universal checkpoints keep no module weights, so
    # ckpttool's outputs of them hold a top-level parameter's state alone): Adam's two moments of one
    # shape tell; and a parameter's step, wherever a moment lies beside it
    for name, item in items.items():
        if not item.is_tensor or item.kind not in ("param", "counter"):
            continue
        stem, _, last = name.rpartition(".")
        if not stem or last not in ("exp_avg", "exp_avg_sq", "fp32", "step"):
            continue
        moments = [m for k in ("exp_avg", "exp_avg_sq") if (m := items.get(f"{stem}.{k}")) is not None and m.is_tensor]
        if last == "step":
            if moments and item.shape in ((), (1,)):
                item.kind = "optim"
        elif stem not in items and len(moments) == 2 and moments[0].shape == moments[1].shape == item.shape:
            item.kind = "master" if last == "fp32" else "optim"


MOMENTS = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "sum",
        "square_avg",
        "acc_delta",
        "prev",
        "step_size",
    }
)
"""Last name segments of optimizer state kept per parameter with the parameter's own shape, as
torch's optimizers name it (Adam, SGD, Adagrad, RMSprop, Adadelta, Rprop, AMSGrad; not Adafactor's
factored ``row_var``/``col_var``, nor scalars such as ``step`` or ASGD's ``eta``): ``<param>.exp_avg``,
as export and convert write Megatron's and DeepSpeed's, and by which a ZeRO-0 state's ids are
matched to parameters (``formats._pt.match_param_ids``); ``<param>.fp32`` is the fp32 master copy."""


def param_state(name: str, states: Iterable[str], wrappers: Iterable[str] = ()) -> tuple[str, str] | None:
    """(parameter, state) for a name ending in ``.<state>`` of ``states`` (``fc1.weight.exp_avg``:
    ``fc1.weight``, ``exp_avg``), or in ``.<state>.<wrapper>``, a dict holding the tensor under a key
    of ``wrappers`` (a per-rank shard's ``{"local": t, ...}`` read as a plain torch.save file: the
    parameter is then ``<param>.<wrapper>``); None otherwise."""
    head, _, last = name.rpartition(".")
    wrapped = last in wrappers
    if wrapped:
        head, _, state = head.rpartition(".")
    else:
        state = last
    if not head or state not in states:
        return None
    return (f"{head}.{last}" if wrapped else head), state


RANK_LABEL = re.compile(r"\[tp=(\d+),pp=(\d+)(?:,ep=(\d+))?\]")
"""A rank label, as Megatron's per-rank state (RNG) is named: ``[tp=T,pp=P]``, ``[tp=T,pp=P,ep=E]``"""


_OPTIM_STATE = re.compile(r"^(?:optim|optimizer)\.state\.(.+)\.(exp_avg|exp_avg_sq|step|momentum_buffer)$")


def canonical(name: str) -> str:
    """The spelling of an item name that wrappers and formats do not change, so items of two
    checkpoints can be matched (see docs/formats/naming.md):

    - wrapper segments go wherever they occur: ``module.``, ``_orig_mod.`` (torch.compile),
      ``_checkpoint_wrapped_module.``, FSDP1's ``_fsdp_wrapped_module.``;
    - a top-level model container goes: ``model.fc1.weight`` -> ``fc1.weight``;
    - optimizer state keyed by parameter becomes ``<param>.<state>``:
      ``optim.state.fc1.weight.exp_avg`` -> ``fc1.weight.exp_avg``.
    """
    out = name
    for prefix in _PREFIXES:
        out = out.replace(prefix, "")
    m = _OPTIM_STATE.match(out)
    if m:
        return f"{canonical(m.group(1))}.{m.group(2)}"
    head, _, rest = out.partition(".")
    if rest and head in _MODEL_ROOTS:
        return rest
    return out


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` on one line: newlines, tabs and other control or invisible characters spelled as
    escapes (``\\n``, ``\\x1b``, ``\\u200b``), so a hostile tensor or file name can neither start a
    new line (a forged row or verdict) nor send a terminal escape sequence. Nor can it pass for a
    CI runner's command in a log (:func:`no_commands`)."""
    if text.isprintable():
        return no_commands(text)
    out = []
    for c in text:
        if c.isprintable():
            out.append(c)
        elif c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif "\udc80" <= c <= "\udcff":  # a byte of a file name that is not UTF-8: the byte itself
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            n = ord(c)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
    return no_commands("".join(out))


RUNNER_HASH = r"#(?=#(?:vso)?\[)"
"""the ``#`` that starts a CI runner's command anywhere in a line (``##[name]``, ``##vso[name]``)"""
_RUNNER_COMMAND = re.compile(rf"{RUNNER_HASH}|^( *):(?=:)")


def no_commands(text: str) -> str:
    """``text`` (one line) with what a CI runner reads as a command in its log spelled as an
    escape: GitHub Actions runs ``##[name]`` anywhere in a line and ``::name::`` at its start
    (after blanks), Azure Pipelines ``##vso[name]``; their first ``#`` or ``:`` becomes ``\\x23``
    or ``\\x3a``. A tensor named ``##[add-mask]…`` or ``::stop-commands::…`` in a report (a row of
    a table starts with its name) would otherwise hide ckpttool's own annotations, or forge some."""
    if "#" not in text and ":" not in text:
        return text
    return _RUNNER_COMMAND.sub(lambda m: "\\x23" if m[0] == "#" else f"{m[1]}\\x3a", text)


_NAME_BYTES = re.compile("[\ud800-\udfff]")


def utf8(text: str, *, bytes_as_x: bool = True) -> str:
    """``text`` as it can be written in UTF-8 (JSON, XML): each byte of a file name that was not
    UTF-8, which Python holds as a lone surrogate (U+DC80 to U+DCFF, its ``surrogateescape``), is
    spelled ``\\xNN``, as :func:`printable` shows it (strict JSON readers turn the surrogate into
    U+FFFD, and the name is lost); any other lone surrogate ``\\uNNNN``; the rest is left as it is.
    ``bytes_as_x=False`` spells every lone surrogate ``\\uNNNN`` (for a name whose first spelling is
    another name)."""
    if text.isascii():
        return text
    return _NAME_BYTES.sub(_spelled if bytes_as_x else _spelled_u, text)


def _spelled(m: re.Match[str]) -> str:
    """A lone surrogate as text: a file name's byte (U+DC80 to U+DCFF) as ``\\xNN``, another (from
    a ``\\ud800`` escape in some JSON or pickle) as ``\\uNNNN``."""
    n = ord(m[0])
    return f"\\x{n - 0xDC00:02x}" if 0xDC80 <= n <= 0xDCFF else f"\\u{n:04x}"


def _spelled_u(m: re.Match[str]) -> str:
    return f"\\u{ord(m[0]):04x}"


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is one: "1 file", "2 files", "1,024 bytes"."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
