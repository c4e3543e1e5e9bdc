"""convert --to safetensors: sharded Hugging Face layout, same tensors, atomic."""

from __future__ import annotations

import json

import shutil

import pytest
from safetensors.torch import load_file

from ckpttool.convert import convert, parse_size
from ckpttool.diff import diff
from ckpttool.errors import UsageError
from tests.conftest import FIXTURES, assert_clean, run_cli


@pytest.mark.parametrize("rel", ["dcp/mesh2x2", "megatron/legacy_tp2pp2", "deepspeed/zero3"])
def test_sharded_safetensors_holds_the_same_tensors(rel, tmp_path):
    out = tmp_path / "hf"
    result = convert(FIXTURES / rel, out, max_shard_size="8KB")
    assert len(result.files) > 2 and "model.safetensors.index.json" in result.files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result.nbytes
    loaded = {}
    for shard in set(index["weight_map"].values()):
        loaded.update(load_file(out / shard))  # the safetensors library reads every shard
    assert set(loaded) == set(index["weight_map"])
    report = diff(FIXTURES / rel, out)
    assert report.compared == result.tensors and not report.values and not report.changed_meta


def test_single_file_when_it_fits_and_cli(tmp_path):
    r = run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "hf", "--kind", "param")
    assert r.code == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["ckpttool.manifest.json", "model.safetensors"]
    assert run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "hf").code == 2  # exists
    assert run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "x", "--to", "megatron").code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing half-written


def test_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    with pytest.raises(UsageError):
        parse_size("lots")
    assert parse_size("0.5KB") == 500
    # a lowercase b: Hugging Face's max_shard_size reads 5Gb as 5 gigabits (625 MB), so it is
    # refused rather than read as bytes; a memory budget has no such reading
    for bits in ("5Gb", "5mb", "2kb"):
        with pytest.raises(UsageError, match="a lowercase b is bits"):
            parse_size(bits)
    assert parse_size("5GiB") == parse_size("5gib") == 5 * 2**30 and parse_size("5gB") == 5 * 10**9
    assert parse_size("500mb", "--max-memory", lowercase_b_is_bits=False) == 500 * 10**6
    from ckpttool.reshard import Target, plan

    # (reshard's --max-memory reads it so: 500mb is 500 MB of memory)
    with pytest.raises(UsageError, match=r"--max-memory 1kb \(1,000 bytes\)"):
        plan(FIXTURES / "megatron" / "legacy_tp2pp2", Target(tp=1, pp=1), max_memory="1kb")


@pytest.mark.parametrize(("option", "value"), [("--max-shard-size", "0"), ("--max-shard-size", "0.1B"),
                                               ("--max-memory", "0GB")])  # fmt: skip
def test_a_size_of_nothing_is_refused(option, value, tmp_path):
    with pytest.raises(UsageError, match="at least one byte"):
        parse_size(value, option)
    argv = ["--to", "safetensors"] if option == "--max-shard-size" else ["--tp", "1", "--pp", "1"]
    src = FIXTURES / ("dcp/fsdp2" if option == "--max-shard-size" else "megatron/legacy_tp2pp2")
    r = run_cli("convert" if option == "--max-shard-size" else "reshard", src, "-o", tmp_path / "o", *argv, option, value)
    assert r.code == 2 and f"{option} {value!r}: a size of at least one byte" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("to", "extra"), [("dcp", []), ("torch", []), ("megatron", []), ("safetensors", ["--world-size", "2"])])
def test_an_option_the_target_has_no_use_for_is_refused(to, extra, tmp_path):
    """--max-shard-size with --to dcp or torch was ignored without a word (the files came out at
    their own sizes), as --world-size would be with --to safetensors: each is refused, nothing written."""
    src = FIXTURES / ("megatron/legacy_tp2pp2" if to == "megatron" else "dcp/fsdp2")
    argv = extra or ["--max-shard-size", "1GB"]
    r = run_cli("convert", src, "-o", tmp_path / "o", "--to", to, *argv)
    assert r.code == 2 and f"does not apply to --to {to}" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_per_item", "fsdp2_zstd", "fsdp2_threads2", "mesh2x2"])
def test_to_torch_is_dcp_to_torch_save_byte_for_byte(name, tmp_path):
    """--to torch nests the flat keys back as the state dict was saved and pickles it as torch
    does: the file equals torch's own dcp_to_torch_save output, byte for byte."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    result = convert(FIXTURES / "dcp" / name, tmp_path / "out", to="torch")
    assert result.files == ["model.pt"] and result.tensors > 0
    (tmp_path / "ref").mkdir()
    dcp_to_torch_save(FIXTURES / "dcp" / name, tmp_path / "ref" / "model.pt")
    assert (tmp_path / "out" / "model.pt").read_bytes() == (tmp_path / "ref" / "model.pt").read_bytes()


def test_to_torch_from_megatron_holds_the_same_tensors(tmp_path):
    """A flat {name: tensor} file from a TP2xPP2 Megatron checkpoint: torch.load (weights only)
    reads it, and every parameter equals megatron-core's own gathered copy (the fixture's
    reference, written by Megatron's loader)."""
    import torch

    from tests._compare import same_bits

    src = FIXTURES / "megatron" / "legacy_tp2pp2"
    r = run_cli("convert", src, "-o", tmp_path / "out", "--to", "torch", "--kind", "param")
    assert r.code == 0, r.stderr
    assert "in 1 file to" in r.stdout
    loaded = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    ref = torch.load(FIXTURES / "megatron" / "legacy_tp2pp2.reference.pt", weights_only=False)
    want = {k.removeprefix("param."): v for k, v in ref.items() if k.startswith("param.")}
    assert set(loaded) == set(want) and want
    assert [k for k in want if not same_bits(loaded[k], want[k])] == []


@pytest.mark.parametrize(
    ("attack", "why"),
    [
        ("huge index", "list indices below"),
        ("long lists", "more list entries than the checkpoint has items"),
        ("deep path", "at most 64"),
    ],
)
def test_to_torch_refuses_a_hostile_nesting_map(attack, why, tmp_path):
    """planner_data asking for a list of 10**9 entries, for one list per entry each as long as
    the item count allows (together far more slots than items), or for a path 3000 levels deep:
    refused with that reason, nothing written."""
    import pickle
    import shutil

    import torch  # noqa: F401  (unpickles DCP's classes)

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", src)
    md = pickle.loads((src / ".metadata").read_bytes())
    names = list(md.planner_data)
    if attack == "huge index":
        md.planner_data[names[0]] = ("model", 10**9)
    elif attack == "long lists":
        for k, name in enumerate(names):
            md.planner_data[name] = (f"l{k}", len(names) - 1)  # each entry its own long list
    else:
        md.planner_data[names[0]] = ("a",) * 3000
    (src / ".metadata").write_bytes(pickle.dumps(md))
    r = run_cli("convert", src, "-o", tmp_path / "out", "--to", "torch")
    assert r.code == 3 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_one_process_targets_are_refused_under_torchrun(tmp_path, monkeypatch):
    """--to safetensors, dcp and torch are written by one process: under torchrun every rank would
    write the same files and race to publish them, so they are refused before anything is written."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for to in ("safetensors", "dcp", "torch"):
        with pytest.raises(UsageError, match="run it without torchrun"):
            convert(FIXTURES / "dcp" / "fsdp2", tmp_path / to, to=to)
        assert not (tmp_path / to).exists()


@pytest.mark.parametrize("to", ["dcp", "torch"])
def test_megatron_rng_records_carried_to_dcp_and_torch_verify_clean(to, tmp_path):
    """Megatron's RNG records hold numpy's MT19937 state (a uint32 ndarray). --to dcp and --to
    torch carry them; ckpttool's own verify of the output then finds no unsafe pickle (plain
    numeric numpy arrays are allowed in DCP bytes items and torch.save files, as in Megatron's
    files), and the records read back equal the source rank's. The optimizer state written under
    ckpttool's names (<param>.exp_avg, <param>.fp32) reads back as optimizer state and masters."""
    from ckpttool import registry
    from ckpttool.formats import _pt, megatron

    src = FIXTURES / "megatron" / "legacy_tp2pp2"
    out = tmp_path / "out"
    r = run_cli("convert", src, "-o", out, "--to", to)
    assert r.code == 0, r.stderr
    target = out if to == "dcp" else out / "model.pt"
    v = run_cli("verify", target, "--json")
    report = json.loads(v.stdout)
    assert [f["rule"] for f in report["findings"] if f["severity"] == "error"] == [] and v.code == 0, v.stdout
    # the moments and fp32 copies, written as <param>.exp_avg / .fp32, read back as optimizer state
    assert not [f for f in report["findings"] if f["rule"] == "missing-state" and "optimizer" in f["message"]]
    adapter, m = registry.describe(target)
    kinds = {name.rsplit(".", 1)[-1]: item.kind for name, item in m.items.items() if item.is_tensor}
    assert kinds["exp_avg"] == kinds["exp_avg_sq"] == "optim" and kinds["fp32"] == "master" and kinds["weight"] == "param"
    rng = [name for name in m.items if "np_rng_state" in name]
    assert rng, sorted(m.items)[:20]
    src_rank = _pt.load(src, "iter_0000003/mp_rank_00_000/model_optim_rng.pt", megatron.ALLOWLIST)[1]
    want = src_rank["rng_state"][0]["np_rng_state"]
    with adapter.reader(m) as reader:
        name = next(n for n in rng if n.endswith("[tp=0,pp=0]"))
        got = reader.read_object(m.items[name])
    assert got[0] == want[0] == "MT19937" and got[2:] == want[2:]
    assert got[1].dtype == want[1].dtype and got[1].tobytes() == want[1].tobytes()


def test_a_plugin_format_claims_a_directory_before_the_torch_guess(tmp_path, monkeypatch):
    """A directory holding one .pt file is torch's only as a guess: a plugin adapter (entry-point
    group ckpttool.formats) that recognises the directory takes it, although plugins are tried after
    the first-party adapters; without the plugin the guess stands."""
    import torch

    from ckpttool import registry
    from ckpttool.formats.base import Detection

    class Plugin:
        name = "myformat"

        def detect(self, path):
            ok = path.is_dir() and (path / "model.pt").is_file() and path.name.endswith(".myformat")
            return Detection(ok, "a .myformat directory" if ok else "not a .myformat directory")

    for name in ("run.myformat", "plain"):
        (tmp_path / name).mkdir()
        torch.save({"w": torch.ones(2)}, tmp_path / name / "model.pt")
    monkeypatch.setattr(registry, "_plugins", lambda: (Plugin(),))
    assert registry.detect(tmp_path / "run.myformat").name == "myformat"
    assert registry.detect(tmp_path / "plain").name == "torch"
    assert registry.detect(tmp_path / "plain" / "model.pt").name == "torch"


@pytest.mark.parametrize("to", ["safetensors", "dcp", "torch"])
def test_convert_seals_every_output_unless_told_not_to(to, tmp_path):
    """convert --to megatron|deepspeed (and every reshard) sealed its output; --to safetensors, dcp
    and torch did not, and had no --no-seal. Each is sealed before it is published: verify checks it
    against that seal, and a flipped byte is caught by it."""
    out = tmp_path / "out"
    r = run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", out, "--to", to, "--json")
    assert r.code == 0 and json.loads(r.stdout)["sealed"] is True, r.stderr
    sealed = json.loads((out / "ckpttool.manifest.json").read_text())
    assert sealed["manifest"]["root"] == str(out), sealed["manifest"]["root"]  # (not its staging directory's)
    r = run_cli("verify", out, "--json")
    assert r.code == 0 and json.loads(r.stdout)["inputs"]["seal"], r.stdout
    data = next(p for p in sorted(out.iterdir()) if p.suffix in (".safetensors", ".distcp", ".pt"))
    raw = bytearray(data.read_bytes())
    raw[-len(raw) // 3] ^= 1
    data.write_bytes(bytes(raw))
    assert run_cli("verify", out).code == 1
    r = run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "bare", "--to", to, "--no-seal", "--json")
    assert r.code == 0 and json.loads(r.stdout)["sealed"] is False
    assert not (tmp_path / "bare" / "ckpttool.manifest.json").exists()


def test_the_torch_output_directory_is_read_as_its_file(tmp_path):
    """convert --to torch writes DIR/model.pt; ckpttool reads DIR as that file: inspect, seal and
    verify of the directory work, and a flipped byte is caught against the seal. A directory with
    a second file is not taken for one torch.save file."""
    out = tmp_path / "out"
    assert run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", out, "--to", "torch", "--no-seal").code == 0
    r = run_cli("inspect", out, "--json")
    assert r.code == 0 and json.loads(r.stdout)["format"] == "torch", r.stderr
    assert run_cli("seal", out).code == 0 and (out / "ckpttool.manifest.json").exists()
    assert run_cli("verify", out).code == 0
    data = bytearray((out / "model.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (out / "model.pt").write_bytes(data)
    r = run_cli("verify", out, "--json")
    assert r.code == 1 and "checksum-mismatch" in {f["rule"] for f in json.loads(r.stdout)["findings"]}
    (out / "notes.txt").write_text("x")
    r = run_cli("inspect", out)
    assert r.code == 3 and "not a checkpoint format" in r.stderr


@pytest.mark.parametrize("to", ["dcp", "torch"])
def test_kinds_survive_the_conversion(to, tmp_path):
    """A top-level parameter's state (``head_bias.exp_avg``, ``head_bias.fp32``: two name segments)
    read back as parameters, and DeepSpeed's sample counters as objects: ``export --kind param``
    then took the moments too, and verify saw moments without their parameters."""
    from ckpttool import registry
    from ckpttool.naming import canonical

    src = FIXTURES / "deepspeed" / "zero2"
    out = tmp_path / "out"
    convert(src, out, to=to)
    kinds = {canonical(n): i.kind for n, i in registry.describe(src)[1].items.items()}
    back = {canonical(n): i.kind for n, i in registry.describe(out)[1].items.items()}
    assert back["head_bias.exp_avg"] == "optim" and back["head_bias.fp32"] == "master"
    changed = {n: (kinds[n], k) for n, k in back.items() if n in kinds and kinds[n] != k}
    assert not changed, changed
    r = run_cli("export", out, "-o", tmp_path / "p.safetensors", "--kind", "param")
    assert r.code == 0 and "head_bias" in load_file(tmp_path / "p.safetensors")
    assert not [n for n in load_file(tmp_path / "p.safetensors") if n.endswith(("exp_avg", "exp_avg_sq", "fp32"))]


@pytest.mark.parametrize(
    ("rel", "command"),
    [
        ("deepspeed/zero2/global_step3/mp_rank_00_model_states.pt", ["reshard", "--dp", "1"]),
        ("deepspeed/zero2/global_step3/mp_rank_00_model_states.pt", ["export"]),
        ("megatron/legacy_tp2pp2_distopt/iter_0000003/mp_rank_00_000/distrib_optim.pt", ["convert", "--to", "safetensors"]),
    ],
    ids=["ds-model-states-reshard", "ds-model-states-export", "distrib-optim-convert"],
)
def test_one_rank_file_of_a_checkpoint_is_refused_as_a_source(rel, command, tmp_path):
    """A DeepSpeed model-states file or a Megatron distrib_optim.pt reads as a plain torch.save
    file (no framework class in its pickle): reshard wrote it as a DCP checkpoint with no
    optimizer state, sealed, exit 0. Writing from it is refused, naming the checkpoint to give;
    inspect still reads it."""
    out = tmp_path / ("o.safetensors" if command == ["export"] else "o")
    r = run_cli(command[0], FIXTURES / rel, "-o", out, *command[1:])
    assert r.code == 3 and "one file of the" in r.stderr and "give that" in r.stderr, r.stderr
    # the file given is named (it was its folder), and the checkpoint to give in the hint
    assert f"error: {FIXTURES / rel}: one file of the" in r.stderr and "hint: give the checkpoint it is part of: " in r.stderr
    assert "not a checkpoint format" not in r.stderr, r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert run_cli("inspect", FIXTURES / rel).code == 0


def test_a_torch_file_beside_a_deepspeed_checkpoint_is_a_checkpoint_of_its_own(tmp_path):
    """zero_to_fp32 (or a trainer) writes pytorch_model.bin into the DeepSpeed checkpoint's folder:
    that file is no rank file, and is exported, converted and resharded as any torch.save file."""
    ds = tmp_path / "ds"
    shutil.copytree(FIXTURES / "deepspeed" / "zero1", ds)
    shutil.copy(FIXTURES / "torch" / "train_state.pt", ds / "pytorch_model.bin")
    r = run_cli("export", ds / "pytorch_model.bin", "-o", tmp_path / "out.safetensors")
    assert r.code == 0, r.stderr
    r = run_cli("convert", ds / "pytorch_model.bin", "-o", tmp_path / "c", "--to", "dcp")
    assert r.code == 0, r.stderr


@pytest.mark.parametrize("to", ["dcp", "torch", "safetensors"])
def test_kind_master_is_the_fp32_model_under_the_parameters_names_in_every_target(to, tmp_path):
    """--kind master gives the fp32 model the optimizer holds, under the parameters' own names (as
    zero_to_fp32 does), whatever the target. Before: the DCP output kept the masters' names
    (emb.weight.fp32 …), so dcp.load into the model's state dict found none of them."""
    from ckpttool import registry

    out = tmp_path / to
    convert(FIXTURES / "deepspeed" / "zero3", out, to=to, kind="master")
    _, m = registry.describe(out)
    assert "emb.weight" in m.items and not any(n.endswith(".fp32") for n in m.items), sorted(m.items)
    assert m.items["emb.weight"].dtype == "float32"
    ref = tmp_path / "ref.safetensors"
    run_cli("export", str(FIXTURES / "deepspeed" / "zero3"), "-o", str(ref), "--kind", "master")
    assert not diff(ref, out).different


def test_convert_to_safetensors_lists_what_it_left_out(tmp_path):
    """convert --json said nothing of the items it did not write (export's JSON lists them), and
    its note named one of them and called every one non-tensor, whatever the reason."""
    from tests.conftest import FIXTURES, run_cli

    r = run_cli("convert", FIXTURES / "deepspeed" / "zero2", "-o", tmp_path / "o", "--to", "safetensors", "--json")
    assert r.code == 0, r.stderr
    data = json.loads(r.stdout)
    skipped = {s["name"]: s["reason"] for s in data["skipped"]}
    assert len(skipped) == 26 and skipped["optimizer.param_groups.0.lr"] == "not a tensor", skipped
    assert data["tensors"] + len(skipped) == len(json.loads(run_cli("inspect", FIXTURES / "deepspeed" / "zero2",
                                                                    "--json").stdout)["items"])  # fmt: skip
    said = " ".join(r.stderr.split())
    assert "not written: 26 (not a tensor): optimizer.param_groups.0.weight_decay," in said and "23 more" in said


@pytest.mark.parametrize("command", [["convert", "--to", "safetensors"], ["convert", "--to", "dcp"], ["reshard", "--to", "dcp"]])
def test_training_state_beside_the_model_is_not_dropped_unasked(command, tmp_path):
    """A Hugging Face Trainer checkpoint converted or resharded: the output held the model alone,
    and nothing said that the optimizer, scheduler, RNG and step in the files beside it were left
    behind; then a note on stderr said so, with exit 0 (hidden by -q). Writing the whole state is
    refused before anything is written; --kind param writes the model alone, and says what stays."""
    src, out = FIXTURES / "hf" / "trainer" / "checkpoint-3", tmp_path / "out"
    r = run_cli(command[0], src, "-o", out, *command[1:], "--json")
    assert_clean(r, 2, "writes the whole training state, but this checkpoint keeps its", "optimizer.pt", "--kind param")
    assert not out.exists()
    if command[0] == "convert":
        r = run_cli(command[0], src, "-o", out, *command[1:], "--kind", "param", "--json")
        assert r.code == 0, r.stderr
        notes = json.loads(r.stdout)["notes"]
        assert [n for n in notes if n.startswith("not carried: the training state in optimizer.pt, rng_state.pth, ")]
        assert not any(p.name == "optimizer.pt" for p in out.iterdir())
    # a save_only_model save: trainer_state.json alone beside the model (its step is the output's too)
    only = tmp_path / "only" / "checkpoint-3"
    only.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "trainer_state.json", "training_args.bin"):
        shutil.copy2(src / name, only)
    assert run_cli(command[0], only, "-o", tmp_path / "only_out", *command[1:]).code == 0
    plain = run_cli("convert", FIXTURES / "safetensors" / "sharded", "-o", tmp_path / "plain", "--json")
    assert plain.code == 0 and not json.loads(plain.stdout).get("notes"), plain.stdout


@pytest.mark.parametrize("command", [["reshard", "--dp", "2"], ["convert", "--to", "dcp"], ["export"]])
def test_a_sealed_source_changed_since_its_seal_is_refused(command, tmp_path):
    """A safetensors source carries no checksums of its own, but a sealed one carries its seal: a
    byte flipped since sealing was read, resharded and sealed into the output, which verified
    clean. The source's files without checksums of their own are checked against its seal first."""
    src = tmp_path / "st"
    shutil.copytree(FIXTURES / "safetensors" / "sharded", src)
    assert run_cli("seal", src).code == 0
    out = tmp_path / ("out.safetensors" if command[0] == "export" else "out")
    assert run_cli(command[0], src, "-o", out, *command[1:]).code == 0  # (sealed and unchanged: written)
    shard = src / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) * 4 // 5] ^= 0x10
    shard.write_bytes(bytes(data))
    again = tmp_path / ("again.safetensors" if command[0] == "export" else "again")
    r = run_cli(command[0], src, "-o", again, *command[1:])
    assert_clean(r, 3, "model-00002-of-00002.safetensors: differs from the seal the source carries")
    assert not again.exists()


@pytest.mark.parametrize(
    ("fixture", "command", "said"),
    [
        ("megatron/legacy_tp2pp2", ("reshard", "--to", "dcp"), "Adam's step; the param groups"),
        ("megatron/legacy_tp2pp2", ("convert", "--to", "torch"), "Adam's step; the param groups"),
        ("megatron/legacy_dp2_fp16_distopt", ("reshard", "--to", "dcp"), "the fp16 loss scaler"),
        ("megatron/dist_tp2pp2", ("reshard", "--to", "dcp"), "Adam's step; the param groups"),
        # (the data position Megatron-LM resumes from, in the args: was dropped with no word)
        ("megatron/legacy_tp2pp2", ("convert", "--to", "dcp"), "the dataloader position, args.consumed_train_samples (12)"),
        ("megatron/dist_tp2pp2", ("convert", "--to", "torch"), "reads the data from its first sample again"),
    ],
)
def test_megatron_optimizer_state_other_formats_lack_is_said(fixture, command, said, tmp_path):
    """Megatron's per-parameter Adam steps, param groups and fp16 loss scaler live in its rank
    files' pickles, which only Megatron's writers carry: written to DCP or torch they were dropped
    with no word, and exit 0. The output is written, and says what it lacks."""
    verb, *flags = command
    r = run_cli(verb, FIXTURES / fixture, "-o", tmp_path / "out", *flags)
    assert r.code == 0 and "not carried:" in r.stderr and said in " ".join(r.stderr.split()), r.stderr
    again = run_cli("reshard", FIXTURES / fixture, "-o", tmp_path / "back", "--tp", "1", "--pp", "1")
    assert again.code == 0 and "not carried:" not in again.stderr  # (Megatron's writers carry them)
    model = run_cli("convert", FIXTURES / fixture, "-o", tmp_path / "m", "--to", "safetensors", "--kind", "param")
    assert model.code == 0 and "not carried:" not in model.stderr


def test_convert_to_a_framework_format_names_convert_in_its_refusals(tmp_path):
    """convert --to megatron of a Trainer checkpoint was refused as 'reshard writes the whole
    training state', with a hint to write --to dcp --kind param: the command run is named, and the
    hint is one convert takes."""
    r = run_cli("convert", FIXTURES / "hf" / "trainer" / "checkpoint-3", "-o", tmp_path / "o", "--to", "megatron")
    assert_clean(r, 2, "convert --to megatron writes the whole training state", "--to safetensors --kind param")
    assert "reshard" not in r.stderr


@pytest.mark.parametrize(
    ("part", "up"),
    [
        ("rankshards/pipeline/checkpoint_step3_stage0.pt", 1),  # a pipeline stage's file
        ("safetensors/sharded/model-00001-of-00002.safetensors", 1),  # shard 1 of 2
        ("dcp/fsdp2_hf/sharded/shard-00002-model-00001-of-00001.safetensors", 1),  # one rank's slices
        ("deepspeed/universal/global_step3_universal/zero/blocks.0.fc1.bias/exp_avg.pt", 3),  # one state file
    ],
)
def test_one_file_of_a_checkpoint_of_several_is_refused_as_a_part(part, up, tmp_path):
    """One file of a checkpoint of several, given alone, was written out as a complete checkpoint,
    sealed, exit 0: a stage's layers without the others', shard 1 of 2's tensors, one DCP rank's
    slices published as whole tensors of their slice's shape. Refused, naming the checkpoint, by
    convert, reshard and export; a DDP rank's file, which holds the whole model, still converts."""
    src = FIXTURES / part
    for args in (
        ("convert", src, "-o", tmp_path / "o", "--to", "dcp"),
        ("reshard", src, "-o", tmp_path / "o", "--to", "dcp"),
        ("export", src, "-o", tmp_path / "o.safetensors"),
    ):
        r = run_cli(*args)
        assert_clean(r, 3, "one file of the", f"give the checkpoint it is part of: {src.parents[up - 1]}")
        assert not (tmp_path / "o").exists() and not (tmp_path / "o.safetensors").exists()
    r = run_cli("convert", FIXTURES / "rankshards/ddp/shard_00000_of_00002.pt", "-o", tmp_path / "ddp", "--to", "dcp")
    assert r.code == 0, r.stderr
    # a safetensors file beside another of other tensors, with no index nor shard numbers: a model of its own
    (tmp_path / "two").mkdir()
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", tmp_path / "two")
    shutil.copy2(FIXTURES / "safetensors" / "sharded" / "model-00002-of-00002.safetensors", tmp_path / "two" / "vae.safetensors")
    r = run_cli("export", tmp_path / "two" / "model.safetensors", "-o", tmp_path / "two.safetensors")
    assert r.code == 0, r.stderr


@pytest.mark.parametrize("fixture", ["legacy_pp2_mtp_decoupled", "legacy_pp2_mtpfirst"])
def test_two_trained_embeddings_are_refused_for_every_target(fixture, tmp_path):
    """A Megatron save whose MTP stage trained its own copy of the word embeddings (--decoupled-lr at
    PP > 1; MTP layers on the first pipeline rank) was refused for Megatron targets ("ckpttool does
    not choose between them") but written to DCP, torch and safetensors with one copy kept, sealed,
    exit 0, and verify of the output clean. Refused for every target, nothing written."""
    src = FIXTURES / "megatron" / fixture
    for args in (
        ("convert", src, "-o", tmp_path / "o", "--to", "dcp"),
        ("convert", src, "-o", tmp_path / "o", "--to", "torch"),
        ("reshard", src, "-o", tmp_path / "o", "--to", "dcp"),
        ("reshard", src, "-o", tmp_path / "o", "--pp", "1"),
        ("export", src, "-o", tmp_path / "o.safetensors"),
    ):
        r = run_cli(*args)
        assert_clean(r, 2, "two word embeddings", "does not choose between them")
        assert not (tmp_path / "o").exists() and not (tmp_path / "o.safetensors").exists()
    # (a selection that leaves the word embeddings out writes no copy of them: it was refused all the
    # same, by export and then by convert)
    r = run_cli("export", src, "-o", tmp_path / "o.safetensors", "--filter", "decoder")
    assert r.code == 0 and (tmp_path / "o.safetensors").exists(), r.stderr
    for to in ("safetensors", "torch", "dcp"):
        r = run_cli("convert", src, "-o", tmp_path / to, "--to", to, "--filter", "decoder")
        assert r.code == 0 and (tmp_path / to).is_dir(), r.stderr
    r = run_cli("convert", src, "-o", tmp_path / "emb", "--to", "torch", "--filter", "embedding")
    assert_clean(r, 2, "two word embeddings")


def test_a_deepspeed_fp16_runs_loss_scaler_other_formats_lack_is_said(tmp_path):
    """A DeepSpeed fp16 run keeps its dynamic loss scale in the optimizer files, which only
    DeepSpeed's writer carries: to DCP it was dropped with no word (a Megatron source's was named).
    Said for other formats; not for --to deepspeed, which keeps it."""
    from ckpttool.formats.deepspeed import ALLOWLIST
    from tests.conftest import rewritten_copy

    def fp16(tree):
        tree["optimizer_state_dict"]["dynamic_loss_scale"] = True

    src = rewritten_copy(
        tmp_path / "src", FIXTURES / "deepspeed" / "zero2", fp16, files="global_step3/*optim_states.pt", allow=ALLOWLIST
    )
    r = run_cli("reshard", src, "-o", tmp_path / "dcp", "--to", "dcp")
    said = " ".join(r.stderr.split())
    assert r.code == 0 and "not carried: the fp16 loss scaler" in said and "only --to deepspeed carries" in said, said
    r = run_cli("reshard", src, "-o", tmp_path / "ds", "--dp", "1")
    assert r.code == 0 and "not carried" not in r.stderr, r.stderr
    r = run_cli("reshard", FIXTURES / "deepspeed" / "zero2", "-o", tmp_path / "plain", "--to", "dcp")
    assert r.code == 0 and "loss scaler" not in r.stderr, r.stderr  # (a bf16/fp32 run: nothing to carry)

    def fp16_zero0(tree):  # ZeRO-0: FP16_Optimizer's state dict in the model states
        tree["optimizer"]["dynamic_loss_scale"] = True

    src = rewritten_copy(
        tmp_path / "z0", FIXTURES / "deepspeed" / "bf16_zero0", fp16_zero0, "global_step3/mp_rank_*_model_states.pt",
        ALLOWLIST,
    )  # fmt: skip
    r = run_cli("convert", src, "-o", tmp_path / "z0.torch", "--to", "torch")
    assert r.code == 0 and "not carried: the fp16 loss scaler" in " ".join(r.stderr.split()), r.stderr

    def dynamic_object(tree):  # the scaler object DeepSpeed pickles, of the dynamic class; the flag left False
        from ckpttool._unpickle import record

        scaler = record("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")()
        scaler.__dict__.update(tree["optimizer_state_dict"]["loss_scaler"].__dict__, dynamic=True)
        tree["optimizer_state_dict"]["loss_scaler"] = scaler

    src = rewritten_copy(
        tmp_path / "obj", FIXTURES / "deepspeed" / "zero2", dynamic_object, "global_step3/*optim_states.pt", ALLOWLIST
    )
    r = run_cli("convert", src, "-o", tmp_path / "obj.dcp", "--to", "dcp")
    assert r.code == 0 and "not carried: the fp16 loss scaler" in " ".join(r.stderr.split()), r.stderr


@pytest.mark.parametrize("fixture", ["deepspeed/zero3", "deepspeed/universal"])
@pytest.mark.parametrize("to", ["dcp", "safetensors", "torch"])
def test_outputs_read_back_with_the_sources_kinds(fixture, to, tmp_path):
    """ZeRO-3 and universal checkpoints keep no module weights, so a top-level parameter's state
    (head_bias.fp32, .exp_avg, .exp_avg_sq) stood alone in ckpttool's outputs and read back as
    parameters, and every .step as a parameter or a counter: --kind master of the output left out
    head_bias and took three optimizer tensors in its place. The output reads with the source's
    kinds, item for item."""
    from ckpttool import registry

    r = run_cli("convert", FIXTURES / fixture, "-o", tmp_path / "o", "--to", to)
    assert r.code == 0, r.stderr
    _, src = registry.describe(FIXTURES / fixture)
    _, out = registry.describe(tmp_path / "o")
    want = {n: i.kind for n, i in src.items.items() if i.is_tensor}
    got = {n: out.items[n].kind for n in want if n in out.items}
    assert got == want, {
        n: (want[n], got.get(n)) for n in want if got.get(n) != want[n]
    }


def test_a_safetensors_source_keeps_its_metadata(tmp_path):
    """convert --to safetensors and export of a safetensors file dropped its __metadata__ (a model
    card's modelspec.*, a trainer's notes) without a word: only format and ckpttool's own key remained."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(2, np.float32)}, src, metadata={"format": "pt", "modelspec.architecture": "x", "custom": "y"})
    assert run_cli("convert", src, "-o", tmp_path / "o", "--to", "safetensors").code == 0
    assert run_cli("export", src, "-o", tmp_path / "e.safetensors").code == 0
    for out in (tmp_path / "o" / "model.safetensors", tmp_path / "e.safetensors"):
        with safe_open(out, "np") as f:
            meta = f.metadata()
        assert meta == {"format": "pt", "modelspec.architecture": "x", "custom": "y", "ckpttool.source_format": "safetensors"}


@pytest.mark.parametrize(("source", "to"), [("megatron/legacy_tp2pp2", "megatron-dist"), ("deepspeed/zero2", "deepspeed")])
def test_an_unsealed_framework_output_counts_what_it_holds(source, to, tmp_path):
    """--no-seal into a framework format said "wrote 0 tensors" (0 in the JSON): the counts came
    from the seal, which was not written."""
    sealed = run_cli("convert", FIXTURES / source, "-o", tmp_path / "a", "--to", to, "--json")
    bare = run_cli("convert", FIXTURES / source, "-o", tmp_path / "b", "--to", to, "--no-seal", "--json")
    assert sealed.code == bare.code == 0, bare.stderr
    a, b = json.loads(sealed.stdout), json.loads(bare.stdout)
    assert (b["tensors"], b["objects"]) == (a["tensors"], a["objects"]) and b["tensors"] > 0, (a, b)


@pytest.mark.parametrize(
    ("fixture", "files"),
    [("legacy_tp2pp2", "iter_*/mp_rank_*/model_optim_rng.pt"), ("dist_tp2pp2", "iter_*/common.pt")],
)
def test_top_level_keys_megatron_does_not_always_write_are_carried_and_compared(tmp_path, fixture, files):
    """A Megatron checkpoint's top-level keys the reader had no rule for (``rerun_state_machine``,
    a fork's counters and data position, a tensor among them) were dropped by ``convert --to dcp``
    and ``--to torch``, and ``diff`` called the output equal. Now each leaf is an item: the DCP
    output holds it (read back by torch's own dcp_to_torch_save), the torch.save output too, a
    reshard keeps it, and diff tells a changed one."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.conftest import rewritten_copy

    def edit(consumed: int):
        def apply(tree):
            rng = tree["rng_state"][0]["torch_rng_state"] if "rng_state" in tree else None
            from ckpttool._unpickle import EnumValue

            # (megatron-core's own enum: carried by Megatron's writers, left out of the others, said)
            mode = EnumValue("megatron.core.rerun_state_machine.RerunMode", "disabled")
            tree["rerun_state_machine"] = {"mode": mode, "current_iteration": 3}
            tree["train_state"] = {"consumed_train_samples": consumed, "skipped": [1, 2], "note": "fork"}
            if rng is not None:
                tree["train_state"]["probe"] = rng

        return apply

    src = rewritten_copy(tmp_path / "src", FIXTURES / "megatron" / fixture, edit(96), files=files)
    other = rewritten_copy(tmp_path / "other", FIXTURES / "megatron" / fixture, edit(97), files=files)
    expected = {"rerun_state_machine.current_iteration": 3, "train_state.consumed_train_samples": 96,
                "train_state.skipped": [1, 2], "train_state.note": "fork"}  # fmt: skip
    for to in ("dcp", "torch"):
        r = run_cli("convert", src, "-o", tmp_path / to, "--to", to)
        assert_clean(r, 0)
        assert "rerun_state_machine.mode (megatron.core.rerun_state_machine.RerunMode)" in r.stdout + r.stderr
        r = run_cli("diff", src, tmp_path / to)
        assert r.code == 0 and "equal" in r.stdout, (r.stdout, r.stderr)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    # (weights_only=False: numpy's RNG state among the values; the files are this test's own)
    loaded = [torch.load(tmp_path / "dcp.pt", weights_only=False), torch.load(tmp_path / "torch" / "model.pt", weights_only=False)]
    for got in loaded:
        assert {k: got.get(k, "absent") for k in expected} == expected and "rerun_state_machine.mode" not in got
        if fixture.startswith("legacy"):
            assert got["train_state.probe"].dtype == torch.uint8 and got["train_state.probe"].numel() > 0
    r = run_cli("diff", src, other)
    assert r.code == 1 and "train_state.consumed_train_samples" in r.stdout, (r.stdout, r.stderr)
    assert_clean(run_cli("reshard", src, "-o", tmp_path / "tp1", "--tp", "1", "--pp", "1"), 0)
    r = run_cli("inspect", tmp_path / "tp1", "--json")
    names = {i["name"] if isinstance(i, dict) else i for i in json.loads(r.stdout)["items"]}
    assert {"rerun_state_machine.current_iteration", "train_state.consumed_train_samples", "train_state.note"} <= names
    # (the enum stays in the Megatron output's files, as read back: not an item, said as not carried elsewhere)
    from ckpttool import registry

    _, resharded = registry.describe(tmp_path / "tp1")
    assert any("rerun_state_machine.mode" in n for n in resharded.extras["not_carried"])


def test_a_tensor_under_a_torch_dist_common_key_is_said_not_carried_not_an_internal_error(tmp_path):
    """A torch_dist save whose common.pt holds a fork's key with a tensor made every command an
    internal error (KeyError 'offset': the save's reader reads DCP pieces, not common.pt's
    tensors). The tensor is left out and said; the key's plain values are carried."""
    import torch

    from tests.conftest import megatron_enums

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "megatron" / "dist_tp2", src)
    common = next(src.glob("iter_*/common.pt"))
    with megatron_enums():
        tree = torch.load(common, weights_only=False)
        tree["my_fork"] = {"tokens_seen": torch.tensor(12345), "samples": 7}
        torch.save(tree, common)
    assert_clean(run_cli("verify", src), 0)
    r = run_cli("convert", src, "-o", tmp_path / "out", "--to", "dcp")
    assert_clean(r, 0)
    assert "not carried: common.pt: my_fork.tokens_seen (a tensor)" in r.stdout + r.stderr
    assert run_cli("diff", src, tmp_path / "out").code == 0


@pytest.mark.parametrize(("fixture", "cut"), [("tp2", True), ("tp2_glu", True), ("zero2", False)])
def test_a_universal_output_that_drops_vocabulary_padding_says_so(fixture, cut, tmp_path):
    """ds_to_universal cuts the vocabulary parameters' fp32 copies and moments to
    original_vocab_size rows, and ours does the same; the output was written without a word, and
    'ckpttool diff' of source and output then said "different" for six tensors."""
    out = tmp_path / "u"
    r = run_cli("convert", FIXTURES / "deepspeed" / fixture, "-o", out, "--to", "deepspeed-universal")
    assert r.code == 0, r.stderr
    said = "the fp32 copies and moments of emb.weight, head.weight are cut to the 31 rows of the vocabulary"
    assert (said in r.stderr) == cut, r.stderr
    assert diff(FIXTURES / "deepspeed" / fixture, out).different == cut  # (what the note is for)
