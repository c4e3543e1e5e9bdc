"""A DCP checkpoint written from a DCP source keeps the source's ``planner_data``: each key's path
in the nested state dict it was saved from. torch's own ``dcp_to_torch_save`` (the oracle) then
rebuilds the same nested ``{'model': ..., 'optim': ..., ...}`` from the output as from the source;
keys with no recorded path stay flat, and paths torch could not build a tree from are written flat."""

from __future__ import annotations

import pickle
import shutil
from collections import ChainMap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpttool import registry
from ckpttool.convert import convert
from ckpttool.formats import dcp_write
from ckpttool.formats.dcp_write import DcpWriter, planner_paths
from ckpttool.geometry import Box
from ckpttool.manifest import Item
from ckpttool.reshard import Target, reshard
from tests.conftest import FIXTURES, run_cli

DCP = FIXTURES / "dcp"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning")


def planner_data(path: Path) -> dict[str, Any] | None:
    """The ``planner_data`` a DCP checkpoint records (torch's own classes unpickle it): the global
    ``.metadata``'s, or the rank-local files' merged as DCP's global plan merges them; None without."""
    if (path / ".metadata").is_file():
        return pickle.loads((path / ".metadata").read_bytes()).planner_data
    ranks = sorted(path.glob("__*.metadata"), key=lambda p: int(p.name[2:].split(".")[0]))
    maps = [pickle.loads(p.read_bytes()).planner_data for p in ranks]
    return dict(ChainMap(*maps)) if maps and all(isinstance(m, dict) for m in maps) else None


def nested_fixtures() -> list[str]:
    """The DCP fixtures whose planner_data nests (the others' outputs are flat as their sources)."""
    out = []
    for d in sorted(p for p in DCP.iterdir() if p.is_dir()):
        pd = planner_data(d)
        if pd and any(path != (key,) for key, path in pd.items()):
            out.append(d.name)
    return out


def torch_save_of(dcp_dir: Path, tmp: Path, name: str) -> Any:
    """What torch's ``dcp_to_torch_save`` makes of ``dcp_dir``, loaded back."""
    (tmp / name).mkdir()
    dcp_to_torch_save(dcp_dir, tmp / name / "model.pt")
    return torch.load(tmp / name / "model.pt", weights_only=False)


def assert_same_tree(a: Any, b: Any, *, ordered: bool = True, at: str = "") -> None:
    """Same nested keys (in the same order, ``ordered``), list lengths, and equal values (tensors:
    torch.equal and the same dtype)."""
    if isinstance(a, dict):
        assert isinstance(b, dict), at
        assert (list(a) == list(b)) if ordered else (set(a) == set(b)), (at, list(a), list(b))
        for k in a:
            assert_same_tree(a[k], b[k], ordered=ordered, at=f"{at}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), at
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, ordered=ordered, at=f"{at}.{i}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), at
    else:
        assert type(a) is type(b) and a == b, at


def test_the_fixtures_nest():
    assert {"fsdp2", "fsdp2_per_item", "fsdp2_threads2", "fsdp2_zstd", "mesh2x2", "fsdp2_ranklocal"} <= set(
        nested_fixtures()
    )


@pytest.mark.parametrize("name", nested_fixtures())
def test_reshard_keeps_the_source_planner_data(name, tmp_path):
    """The reported bug: reshard of a DCP checkpoint to another --dp wrote planner_data of one flat
    level (``'model.pos' -> ('model.pos',)``), so dcp_to_torch_save gave dotted top-level keys.
    Now the output's planner_data equals the source's, and dcp_to_torch_save of the output equals
    dcp_to_torch_save of the source: the same nested keys in the same order, equal tensors. (The
    rank-local fixture has no global .metadata for torch to read: its oracle is fsdp2, the same
    state saved collectively, whose planner_data its ranks' merged maps equal.)"""
    src = DCP / name
    world = registry.describe(src)[1].layout.world_size
    out = tmp_path / "out"
    r = run_cli("reshard", src, "-o", out, "--dp", 3 if world != 3 else 2)
    assert r.code == 0, r.stderr
    assert planner_data(out) == planner_data(src)
    peer = src if (src / ".metadata").is_file() else DCP / "fsdp2"
    ours, theirs = torch_save_of(out, tmp_path, "ours"), torch_save_of(peer, tmp_path, "theirs")
    assert {"model", "optim"} <= set(ours) and "model.pos" not in ours
    assert_same_tree(theirs, ours, ordered=peer == src)


def test_round_trip_4_2_4_keeps_planner_data(tmp_path):
    """DCP -> DCP -> DCP (dp 4 -> 2 -> 4): the map, and the state-dict key order, survive both
    hops; torch rebuilds the source's nested state dict from the last one."""
    src = DCP / "fsdp2"
    assert registry.describe(src)[1].layout.world_size == 4
    reshard(src, tmp_path / "dp2", Target(dp=2))
    reshard(tmp_path / "dp2", tmp_path / "dp4", Target(dp=4))
    want = pickle.loads((src / ".metadata").read_bytes())
    for hop in ("dp2", "dp4"):
        got = pickle.loads((tmp_path / hop / ".metadata").read_bytes())
        assert got.planner_data == want.planner_data, hop
        assert list(got.state_dict_metadata) == list(want.state_dict_metadata), hop
    assert_same_tree(torch_save_of(src, tmp_path, "src"), torch_save_of(tmp_path / "dp4", tmp_path, "dp4pt"))


def test_torch_subset_load_and_convert_to_torch_nest_the_output(tmp_path):
    """torch's ``_load_state_dict_from_keys({'model'})`` of the output gives the source's nested
    ``{'model': {...}}``; ckpttool's own convert --to torch of the output is byte for byte
    dcp_to_torch_save's of it (so nested too), as it is for the source."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    src, out = DCP / "mesh2x2", tmp_path / "out"
    reshard(src, out, Target(dp=3))
    ours = _load_state_dict_from_keys({"model"}, checkpoint_id=str(out))
    theirs = _load_state_dict_from_keys({"model"}, checkpoint_id=str(src))
    assert list(ours) == ["model"] and isinstance(ours["model"], dict)
    assert_same_tree(theirs, ours)
    convert(out, tmp_path / "conv", to="torch")
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    dcp_to_torch_save(out, oracle / "model.pt")
    assert (tmp_path / "conv" / "model.pt").read_bytes() == (oracle / "model.pt").read_bytes()


def test_other_sources_stay_flat(tmp_path):
    """A source that records no nesting (safetensors here) is written with one flat level, as before."""
    out = tmp_path / "out"
    convert(FIXTURES / "safetensors" / "model.safetensors", out, to="dcp", world_size=2)
    pd = planner_data(out)
    assert pd and all(path == (key,) for key, path in pd.items())


def _items(paths: dict[str, tuple[Any, ...] | None]) -> list[Item]:
    return [Item(name=k, kind="object", nesting=p) for k, p in paths.items()]


def _torch_builds(paths: dict[str, tuple[Any, ...]]) -> None:
    """torch's own set_element puts every key at its path, in order, and each is found there after."""
    from torch.distributed.checkpoint._traverse import get_element, set_element

    root: dict[str, Any] = {}
    for key, path in paths.items():
        set_element(root, path, key)
    assert all(get_element(root, path) == key for key, path in paths.items())


@pytest.mark.parametrize(
    ("recorded", "flat"),
    [
        # a value that is also a container: both written flat
        ({"a.b": ("a", "b"), "a.b.c": ("a", "b", "c"), "a.d": ("a", "d")}, {"a.b", "a.b.c"}),
        ({"a.b.c": ("a", "b", "c"), "a.b": ("a", "b")}, {"a.b", "a.b.c"}),
        # a flat key (no recorded path, another format's) where a nested key needs a container
        ({"model": None, "model.pos": ("model", "pos"), "optim.x": ("optim", "x")}, {"model.pos"}),
        # one container a list (an index first) and a dict (a name) at once
        ({"x.0.w": ("x", 0, "w"), "x.0.v": ("x", "0", "v"), "y.0": ("y", 0)}, {"x.0.w", "x.0.v"}),
        ({"x.y": ("x", "y"), "x.0": ("x", 0)}, {"x.y", "x.0"}),
        # a path that is not the key's own: an item renamed since it was read
        ({"decoder.w": ("model", "w"), "model.v": ("model", "v")}, {"decoder.w"}),
        # list indices past what a checkpoint of these keys may ask for; a path that is not a path
        ({"l.65536": ("l", 65536), "m": ("m",)}, {"l.65536"}),
        ({**{f"l{k}.40000": (f"l{k}", 40000) for k in range(2)}, "m": ("m",)}, {"l0.40000", "l1.40000"}),
        ({"k": (0,), "j": ("j",)}, {"k"}),
        # a list with holes (a subset of a source's keys): torch's set_element pads it with None,
        # and its load then fails ("Missing key in checkpoint state_dict: g.0"): written flat
        ({"g.1.lr": ("g", 1, "lr"), "g.0.lr": ("g", 0, "lr"), "step": None}, set()),
        ({"g.3.lr": ("g", 3, "lr")}, {"g.3.lr"}),
    ],
)
def test_paths_torch_cannot_build_are_written_flat(recorded, flat):
    """planner_paths keeps each recorded path unless torch's set_element could not build the tree
    (or the path is not the key's): those keys, and every key under the clash, are written flat
    and said why; torch's own set_element then places every key."""
    paths, why = planner_paths(_items(recorded))
    assert set(why) == flat
    assert {k for k, p in paths.items() if p == (k,) and recorded[k] not in (None, (k,))} == flat
    assert all(paths[k] == p for k, p in recorded.items() if p is not None and k not in flat)
    _torch_builds(paths)


def test_a_source_map_torch_cannot_build_is_resolved_and_noted(tmp_path):
    """A source whose planner_data makes ``model.blocks`` a list (index 0) and a dict ('0') at once:
    dcp_to_torch_save fails on it. Resharded, those keys are written flat (the writer's notes say
    so) and the rest keep their nesting: torch builds the output's tree, every value as the source's."""
    src = tmp_path / "src"
    shutil.copytree(DCP / "fsdp2", src)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data["model.blocks.0.qkv.weight"] = ("model", "blocks", "0", "qkv", "weight")
    md.planner_data["model.blocks.0.ln1.weight"] = ("model", "blocks", 0, "ln1", "weight")
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointException, match="not supported between instances of 'int' and 'str'"):
        dcp_to_torch_save(src, tmp_path / "fails.pt")

    _, manifest = registry.describe(src)
    notes = DcpWriter(2, list(manifest.items.values()), cut=lambda item: False).notes()
    assert len(notes) == 1 and notes[0].startswith("2 state-dict key(s) written flat"), notes
    assert "'model.blocks.0." in notes[0] and "clashes" in notes[0], notes
    reshard(src, tmp_path / "out", Target(dp=2))
    got = planner_data(tmp_path / "out")
    assert got is not None
    under = {"model.blocks.0.ln1.weight", "model.blocks.0.qkv.weight"}  # the keys under model.blocks
    assert all(got[k] == (k,) for k in under)
    assert all(got[k] == p for k, p in md.planner_data.items() if k not in under)
    ours = torch_save_of(tmp_path / "out", tmp_path, "ours")
    theirs = torch_save_of(DCP / "fsdp2", tmp_path, "theirs")
    for k in under:  # the flat keys at the top, each value the source's
        assert_same_tree(theirs["model"][k.removeprefix("model.")], ours.pop(k), at=k)
    for k in [k.removeprefix("model.") for k in under]:
        del theirs["model"][k]
    assert_same_tree(theirs, ours)


def test_a_hostile_source_path_is_written_flat(tmp_path):
    """A source path asking for a list of 10**9 entries (convert --to torch refuses it) is not
    carried: that key is written flat, the rest nest, and dcp_to_torch_save reads the output."""
    src = tmp_path / "src"
    shutil.copytree(DCP / "fsdp2", src)
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data["model.pos"] = ("model", 10**9)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    reshard(src, tmp_path / "out", Target(dp=2))
    got = planner_data(tmp_path / "out")
    assert got is not None and got["model.pos"] == ("model.pos",)
    assert all(got[k] == p for k, p in md.planner_data.items() if k != "model.pos")
    ours = torch_save_of(tmp_path / "out", tmp_path, "ours")
    assert "model.pos" in ours and "pos" not in ours["model"]


def test_nested_metadata_equals_torch_pickle(tmp_path, monkeypatch):
    """With nested paths (strings shared between them, list indices), the torch-free .metadata is
    byte for byte what pickling torch's own classes gives."""
    keys: dict[str, Any] = {}
    pd: dict[str, tuple[Any, ...]] = {}
    model, layers, w, step = "model", "layers", "w", "step"  # one object each, as torch's paths share them
    for i in range(1200):
        keys[f"model.layers.{i}.w"] = ("float32", (8, 4), [Box((0, 0), (4, 4)), Box((4, 0), (4, 4))])
        pd[f"model.layers.{i}.w"] = (model, layers, i, w)
    keys["step"], pd["step"] = None, (step,)
    records = {
        f"__{r}_0.distcp": [(k, (4 * r, 0), i * 100, 100) for i, k in enumerate(keys) if keys[k] is not None]
        for r in range(2)
    }
    records["__0_0.distcp"].append(("step", None, 5, 6))
    inputs = dict(keys=keys, records=records, planner_data=pd, checkpoint_id=".")
    with monkeypatch.context() as m:
        m.setattr(dcp_write, "_torch_metadata", lambda *a: pytest.fail("fell back to torch's classes"))
        dcp_write.write_metadata(tmp_path / "mine", **inputs)
    monkeypatch.setattr(dcp_write, "TORCH_PICKLE_FROM", 0)
    dcp_write.write_metadata(tmp_path / "torch", **inputs)
    assert (tmp_path / "mine").read_bytes() == (tmp_path / "torch").read_bytes()
    assert pickle.loads((tmp_path / "mine").read_bytes()).planner_data == pd


def test_nesting_is_not_serialised():
    """Item.nesting lives in memory only: not in the manifest's JSON (seals) nor its schema."""
    from ckpttool.manifest import Manifest, json_schema

    _, m = registry.describe(DCP / "fsdp2")
    assert m.items["model.pos"].nesting == ("model", "pos")
    data = m.to_json_dict()
    assert "nesting" not in data["items"]["model.pos"]
    assert "nesting" not in json_schema()["$defs"]["Item"]["properties"]
    assert Manifest.from_json_dict(data) == m  # nesting is left out of comparisons too


def test_a_filter_that_keeps_some_entries_of_a_list_writes_them_flat(tmp_path):
    """convert --filter keeping layers.0 and layers.2 of a list of four wrote them at their list
    indices: a DCP checkpoint torch's dcp_to_torch_save could not load ("Missing key layers.1") and
    ckpttool called damaged or hostile; --to torch was refused the same way. Such keys are written
    flat; a list kept whole stays nested."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"layers": [torch.ones(2) * i for i in range(4)], "keep": [torch.zeros(1), torch.ones(1)]},
                 checkpoint_id=src, no_dist=True)  # fmt: skip
    flt = tmp_path / "f"
    assert run_cli("convert", src, "-o", flt, "--to", "dcp", "-f", r"layers\.[02]|keep").code == 0
    dcp_to_torch_save(flt, tmp_path / "x.pt")
    loaded = torch.load(tmp_path / "x.pt")
    assert sorted(loaded) == ["keep", "layers.0", "layers.2"] and len(loaded["keep"]) == 2, loaded
    for source in (flt, src):
        out = tmp_path / f"t-{source.name}"
        r = run_cli("convert", source, "-o", out, "--to", "torch", "-f", r"layers\.[02]|keep")
        assert r.code == 0, r.stderr
        assert sorted(torch.load(out / "model.pt")) == ["keep", "layers.0", "layers.2"]
