"""reshard / convert / export refuse what would publish a wrong or short output (found by a
black-box review): an unreadable item, a checkpoint the reader found damaged, an empty selection,
absurd sizes, a --split-rule over megatron-core's own rules; and leave out what a foreign format
cannot carry (megatron-core's unused output layer)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import FIXTURES, assert_clean, run_cli

MG = FIXTURES / "megatron"


def test_an_unsafe_pickle_is_carried_unread_not_dropped(tmp_path):
    """A DCP bytes item whose pickle refers to a global outside the allowlist (os.system here; a
    custom dataloader class in real runs): reshard used to write the rest, note the item on stderr,
    seal and exit 0, the state gone. A DCP output now carries its record byte for byte, unread (the
    plan says so; verify of the output flags it as it flags the source's); formats that would need
    it re-pickled refuse."""
    src = FIXTURES / "hostile" / "dcp_bytes_item_os_system"
    r = run_cli("reshard", src, "-o", tmp_path / "r", "--dp", "2", cwd=tmp_path)
    assert r.code == 0, r.stderr
    assert "carried as their bytes, unread" in r.stderr + r.stdout and "dataloader.cursor" in r.stderr + r.stdout
    v = run_cli("verify", tmp_path / "r", "--json", cwd=tmp_path)
    found = [
        (f["rule"], f["item"] or f["message"]) for f in json.loads(v.stdout)["findings"] if f["severity"] == "error"
    ]
    assert v.code == 1 and found and all(rule == "unsafe-pickle" for rule, _ in found), found
    # the record itself, unchanged: the source's bytes are in the output (located by ckpttool's
    # restricted reader: nothing here unpickles the fixture)
    from ckpttool import registry

    def record(ck):
        piece = registry.describe(ck)[1].items["dataloader.cursor"].pieces[0]
        with (ck / piece.file).open("rb") as fh:
            fh.seek(piece.locator["offset"])
            return fh.read(piece.locator["length"])

    assert record(src) == record(tmp_path / "r")
    # convert --to dcp carries it the same way, and says so (it used to say nothing), counting it
    # among the items written besides tensors (it counted tensors only)
    r = run_cli("convert", src, "-o", tmp_path / "c", "--to", "dcp", cwd=tmp_path)
    assert r.code == 0, r.stderr
    assert "carried as their bytes, unread" in r.stderr and "dataloader.cursor" in r.stderr
    assert record(src) == record(tmp_path / "c")
    _, m = registry.describe(src)
    tensors = sum(1 for i in m.items.values() if i.is_tensor)
    assert f"wrote {tensors} tensors" in r.stdout and f" and {len(m.items) - tensors} other items in " in r.stdout
    r = run_cli("convert", src, "-o", tmp_path / "j", "--to", "dcp", "--json", cwd=tmp_path)
    report = json.loads(r.stdout)
    assert (report["tensors"], report["objects"]) == (tensors, len(m.items) - tensors)
    assert any("dataloader.cursor" in n for n in report["notes"]), report
    r = run_cli("convert", src, "-o", tmp_path / "t", "--to", "torch", cwd=tmp_path)
    assert_clean(r, 3, "dataloader.cursor cannot be read (unsafe pickle", "nothing was written")
    assert not (tmp_path / "t").exists()
    assert not (tmp_path / "CKPTTOOL_PWNED").exists()


@pytest.mark.parametrize("command", ["reshard", "convert", "export"])
def test_a_checkpoint_with_findings_of_its_reader_is_refused(command, tmp_path):
    """torch_dist without common.pt: verify reports missing-file; convert wrote stacked names and
    exited 0."""
    ck = tmp_path / "ck"
    shutil.copytree(MG / "dist_tp2pp2", ck)
    (ck / "iter_0000003" / "common.pt").unlink()
    out = tmp_path / ("o.safetensors" if command == "export" else "o")
    extra = ["--tp", "1"] if command == "reshard" else []
    assert_clean(run_cli(command, ck, "-o", out, *extra), 3, "common.pt is missing", "nothing was written")
    assert not out.exists()


def test_swapped_rank_files_are_not_resharded(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(MG / "legacy_tp2pp2", ck)
    it = ck / "iter_0000003"
    (it / "mp_rank_00_000").rename(it / "x")
    (it / "mp_rank_01_000").rename(it / "mp_rank_00_000")
    (it / "x").rename(it / "mp_rank_01_000")
    assert_clean(run_cli("reshard", ck, "-o", tmp_path / "o", "--tp", "1", "--pp", "1"), 3, "was saved by rank 1")


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_selection_matching_nothing_is_refused(command, tmp_path):
    out = tmp_path / ("o.safetensors" if command == "export" else "o")
    r = run_cli(command, MG / "legacy_tp2pp2", "-o", out, "-f", "nomatch_zzz")
    assert_clean(r, 2, "no item of the checkpoint's", "ckpttool ls")
    assert not out.exists()
    assert_clean(run_cli(command, MG / "legacy_tp2pp2", "-o", out, "-f", "("), 2, "not a regular expression")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--dp", "100000000", "--dry-run"], "--dp 100,000,000: more ranks than any run has"),
        (["--dp", "99999999999999999999", "--dry-run"], "more ranks than any run has"),
        (["--dp", "2048", "--tp", "1024", "--dry-run"], "ranks: more than any run has"),
    ],
)
def test_absurd_sizes_are_refused_at_once(args, fragment, tmp_path):
    """--dp 100000000 --dry-run ran for minutes and gigabytes before saying anything."""
    assert_clean(run_cli("reshard", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "o", *args, timeout=30), 2, fragment)


def test_convert_world_size_out_of_range(tmp_path):
    for n in ("0", "2000000"):
        r = run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", tmp_path / "o", "--to", "dcp", "--world-size", n)
        assert_clean(r, 2, f"--world-size {int(n):,}")


@pytest.mark.parametrize("rule", ["layernorm=0", r"linear_fc1\.weight=1"])
def test_a_split_rule_over_megatron_cores_own_is_refused(rule, tmp_path):
    """A user rule for a parameter megatron-core splits (or keeps whole) its own way cut the
    output differently from how the source was read: replica mismatches, or fc1 read back as
    [128, 8] instead of [64, 16]."""
    r = run_cli("reshard", MG / "legacy_tp2pp2", "-o", tmp_path / "o", "--split-rule", rule)
    assert_clean(r, 2, "tensor-parallel split megatron-core fixes", "narrow the pattern")


@pytest.mark.parametrize("source", ["legacy_tp2pp2", "dist_tp2pp2"])
def test_a_split_rule_past_a_tensors_last_dimension_is_refused(source, tmp_path):
    """'weight=7' raised an internal IndexError (exit 3) instead of the usage refusal."""
    r = run_cli("reshard", MG / source, "-o", tmp_path / "o", "--split-rule", "weight=7", "--dry-run")
    assert_clean(r, 2, "along a dimension they do not have", "D, dim 7)")


@pytest.mark.parametrize("source", ["legacy_tp2pp2", "dist_tp2pp2"])
def test_a_split_rule_that_matches_nothing_is_refused(source, tmp_path):
    """A mistyped pattern was taken without a word (and the parameter it meant left unsplit)."""
    r = run_cli("reshard", MG / source, "-o", tmp_path / "o", "--tp", "1", "--split-rule", r"adaptor\.weight=0")
    assert_clean(r, 2, r"--split-rule 'adaptor\.weight=0' matches no parameter", "'ckpttool ls' lists the parameters")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content", [b"{bad", b""])
def test_a_damaged_torch_dist_metadata_json_is_named(content, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(MG / "dist_tp2pp2", ck)
    (ck / "iter_0000003" / "metadata.json").write_bytes(content)
    for command in (["inspect", ck], ["reshard", ck, "-o", tmp_path / "o", "--tp", "1"]):
        assert_clean(run_cli(*command), 3, "iter_0000003/metadata.json: expected torch_dist's JSON")


@pytest.mark.parametrize("to", ["dcp", "torch", "safetensors"])
def test_the_unused_output_layer_is_left_out_of_foreign_formats(to, tmp_path):
    """megatron-core's never-used output layer (tied model, MTP in the last chunk) has zero
    moments by design; in a DCP or torch.save output nothing says so, and verify failed the output
    (optimizer-mismatch) though the source verified clean. (safetensors kept it, unlike the other
    two.)"""
    src = MG / "legacy_pp2_mtp_tied"
    out = tmp_path / "o"
    cmd = ["reshard", src, "-o", out, "--to", "dcp"] if to == "dcp" else ["convert", src, "-o", out, "--to", to]
    r = run_cli(*cmd)
    assert r.code == 0, r.stderr
    # the plan says so (convert --to torch left it out in silence)
    assert "left out: output_layer.weight with its optimizer state" in " ".join(r.stderr.split()), r.stderr
    v = run_cli("verify", out, "--json")
    assert v.code == 0, v.stdout
    listed = run_cli("ls", out, "--json")
    names = {i["name"] for i in json.loads(listed.stdout)["items"]}
    assert not any(n.startswith("output_layer.weight") for n in names)
    assert "embedding.word_embeddings.weight" in names


@pytest.mark.parametrize(
    ("src", "args", "fragment"),
    [
        ("deepspeed/zero2", ["--dp", "1", "--vocab-padding", "megatron"], "--vocab-padding applies to Megatron"),
        ("dcp/fsdp2", ["--dp", "2", "--split-rule", "w=0"], "--split-rule applies to Megatron"),
    ],
)
def test_options_that_do_not_apply_are_refused(src, args, fragment, tmp_path):
    """They were ignored: the user believed an option took effect that did nothing."""
    assert_clean(run_cli("reshard", FIXTURES / src, "-o", tmp_path / "o", *args), 2, fragment)


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_selection_of_no_tensors_writes_no_empty_safetensors(command, tmp_path):
    out = tmp_path / ("o.safetensors" if command == "export" else "o")
    r = run_cli(command, FIXTURES / "dcp" / "fsdp2", "-o", out, "--kind", "counter")
    assert_clean(r, 2, "nothing to write", "--to torch or dcp")
    assert not out.exists()


@pytest.mark.parametrize(
    ("sizes", "said"),
    [
        (["--tp", "2", "--ep", "2", "--etp", "4"], "choose --etp at most --tp"),
        (["--tp", "1", "--ep", "2", "--etp", "2"], "choose --etp at most --tp"),
        (["--tp", "2", "--ep", "1", "--etp", "1"], "ETP x EP >= TP"),
    ],
)
def test_an_expert_split_legacy_files_cannot_hold_says_which_rule(sizes, said, tmp_path):
    """The hint said "ETP x EP >= TP" for every layout of experts legacy files cannot hold, also
    where ETP x EP was already >= TP (ETP above TP: two expert splits would share one file)."""
    out = tmp_path / "out"
    r = run_cli("reshard", MG / "legacy_tp2ep2etp1", "-o", out, *sizes)
    assert_clean(r, 2)
    assert said in r.stderr and "--to megatron-dist" in r.stderr, r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_refusals_helpers_found_misleading(tmp_path):
    """Three refusals that read wrong: a BF16_Optimizer checkpoint (ZeRO-1 in its config) was
    'ZeRO stage 0' (it is resharded now; a change of stage from it is refused by name);
    --max-memory 300.01MB was refused as needing 'about 300 MB'; --world-size with --to torch was
    ignored without a word."""
    out = tmp_path / "out"
    r = run_cli("reshard", FIXTURES / "deepspeed" / "bf16_optimizer", "-o", out, "--dp", "1", "--zero-stage", "2")
    assert_clean(r, 2, "BF16_Optimizer", "--zero-stage 2", "--to deepspeed-universal")
    r = run_cli("reshard", MG / "legacy_tp2pp2", "-o", out, "--tp", "1", "--pp", "2", "--max-memory", "300.01MB")
    assert_clean(r, 2, "300,010,000 bytes")
    need = int(r.stderr.split("needs ", 1)[1].split(" bytes", 1)[0].replace(",", ""))
    assert need > 300_010_000
    r = run_cli("convert", FIXTURES / "dcp" / "fsdp2", "-o", out, "--to", "torch", "--world-size", "3")
    assert_clean(r, 2, "--world-size")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_deepspeed_layout_flags_that_would_change_tp_or_pp_are_refused(tmp_path):
    """--pp 1 of a PP=2 DeepSpeed run and --tp 1 of a TP=2 one were taken as "no change" and
    ignored (the output kept PP=2, TP=2); they are refused, naming the source's layout. Flags that
    repeat it are accepted."""
    out = tmp_path / "out"
    r = run_cli("reshard", FIXTURES / "deepspeed" / "pipeline_bf16", "-o", out, "--pp", "1")
    assert_clean(r, 2, "--pp 1 would change the source's PP=2", "--to deepspeed-universal")
    r = run_cli("reshard", FIXTURES / "deepspeed" / "tp2", "-o", out, "--tp", "1", "--dp", "2")
    assert_clean(r, 2, "--tp 1 would change the source's TP=2")
    assert not out.exists()
    r = run_cli("reshard", FIXTURES / "deepspeed" / "pipeline_bf16", "-o", out, "--pp", "2", "--tp", "1", "--dp", "1")
    assert r.code == 0, r.stderr


@pytest.mark.parametrize("command", ["convert", "export"])
def test_kind_param_of_a_zero3_checkpoint_is_refused_not_a_model_of_one_buffer(command, tmp_path):
    """ZeRO-3 saves no module weights: its parameters are the optimizer's fp32 copies. '--kind
    param' (the help's own example) wrote one 8-byte buffer and exited 0."""
    out = tmp_path / ("o.safetensors" if command == "export" else "o")
    r = run_cli(command, FIXTURES / "deepspeed" / "zero3", "-o", out, "--kind", "param")
    assert_clean(r, 2, "--kind param: 17 parameter(s) (emb.weight, blocks.0.fc1.weight", "--kind master writes them")
    assert not out.exists()
    # a filter that keeps none of them, and checkpoints that hold their weights, as before
    assert run_cli(command, FIXTURES / "deepspeed" / "zero3", "-o", out, "--kind", "param", "-f", "seen").code == 0
    r = run_cli(command, FIXTURES / "deepspeed" / "zero2", "-o", tmp_path / "z2.safetensors", "--kind", "param")
    assert r.code == 0, r.stderr


@pytest.mark.parametrize(
    "flags",
    [("--tp", "1", "--pp", "1"), ("--tp", "2", "--pp", "2"), ("--distributed-optimizer",), ("--to", "megatron-dist")],
)
def test_a_rank_file_of_another_run_leaving_moments_uncovered_is_refused(tmp_path, flags):
    """A rank file from a distributed-optimizer run among Float16-optimizer ones (its model reads,
    its moments live in distrib_optim.pt, which is not there) leaves a gap in every moment: the
    legacy writer assembled the moments from a fresh buffer and published them, sealed, with
    whatever memory held (inf, 3e38, different on every run), and verify of the output passed.
    Refused before anything is written, as the DCP and safetensors targets refuse it."""
    src = tmp_path / "mixed"
    shutil.copytree(MG / "legacy_tp2pp2", src)
    rank = "iter_0000003/mp_rank_01_000/model_optim_rng.pt"
    shutil.copy2(MG / "legacy_tp2pp2_distopt" / rank, src / rank)
    out = tmp_path / "out"
    r = run_cli("reshard", src, "-o", out, *flags, cwd=tmp_path)
    assert_clean(r, 3, "elements are in no piece")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["mixed"]


@pytest.mark.parametrize(("option", "said"), [("--max-memory", "expected a size"), ("--pipeline-layout", "expected the layers")])
def test_an_empty_option_is_refused_not_taken_as_unset(option, said, tmp_path):
    """'--max-memory ""' (an unset shell variable) ran with no memory bound, and '--pipeline-layout ""'
    with the default layout, exit 0; '--max-memory 0' was refused."""
    out = tmp_path / "out"
    r = run_cli("reshard", MG / "legacy_tp2pp2", "-o", out, "--tp", "1", "--pp", "1", option, "")
    assert_clean(r, 2, said)
    assert not out.exists()


def test_a_parameter_some_layers_lack_is_refused_for_torch_dist(tmp_path):
    """A parameter only some layers have (each stage's second layer's norm under another name) was written to
    torch_dist stacked over every layer with chunks for the layers that have it, sealed, exit 0:
    ckpttool's own verify then found coverage gaps and a reshard back refused it. Refused before
    anything is written; legacy files take it."""
    from tests.conftest import rewritten_copy

    def rename(tree):
        model = tree["model"]
        items = list(model.items())
        model.clear()
        for k, v in items:
            model[k.replace("layers.1.input_layernorm", "layers.1.custom_norm")] = v

    src = rewritten_copy(tmp_path / "src", FIXTURES / "megatron" / "legacy_tp2pp2", rename)
    r = run_cli("reshard", src, "-o", tmp_path / "dist", "--to", "megatron-dist")
    assert_clean(r, 2, "decoder.layers.custom_norm.weight: only 2 of the 4 layers hold it (not layer 0, 2)")
    assert not (tmp_path / "dist").exists()
    r = run_cli("reshard", src, "-o", tmp_path / "legacy", "--tp", "1", "--pp", "1")
    assert r.code == 0, r.stderr


def test_sub_group_size_reads_as_deepspeed_configs_write_it(tmp_path):
    """--sub-group-size 1e9 (as ds_config files write it, and as its help says) was refused:
    "'1e9' is not a valid int"."""
    from ckpttool.cli import _a_count

    assert _a_count("1e9") == _a_count("1_000_000_000") == _a_count("1000000000") == 10**9  # (the value, exactly)
    assert _a_count("700") == 700 and _a_count("123456789012345678") == 123456789012345678
    src = FIXTURES / "deepspeed" / "zero2"
    for value in ("1e9", "1_000_000_000", "2e3", "0"):  # (0: one parameter per sub-group, as DeepSpeed takes it)
        out = tmp_path / value
        r = run_cli("reshard", src, "-o", out, "--dp", "2", "--zero-stage", "3", "--sub-group-size", value, "--dry-run")
        assert r.code == 0, r.stderr
        # (the value reaches the plan: 1e9 is also DeepSpeed's default, which a value dropped on the way gives)
        assert f"sub-groups of up to {int(float(value.replace('_', ''))):,} elements" in r.stdout + r.stderr
    for value in ("1.5", "-1", "lots", "1e400", "inf", "nan"):  # (1e400 was a traceback: OverflowError)
        r = run_cli("reshard", src, "-o", tmp_path / "x", "--dp", "2", "--zero-stage", "3", "--sub-group-size", value)
        assert r.code == 2 and "--sub-group-size" in r.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("reshard", "megatron/legacy_tp2pp2", "--dp", "2"),
        ("reshard", "megatron/legacy_tp2pp2", "--zero-stage", "2"),
        ("reshard", "deepspeed/zero2", "--dp", "1", "--sub-group-size", "8"),
        ("convert", "deepspeed/zero2", "--to", "deepspeed", "--kind", "param"),
    ],
    ids=["dp-megatron", "zero-stage-megatron", "sub-group-size-zero2", "kind-deepspeed"],
)
def test_an_option_that_does_not_apply_is_refused_with_what_to_do(args, tmp_path):
    """Each of these said what was wrong and left the user to work out the fix (no hint line)."""
    command, src, *rest = args
    r = run_cli(command, FIXTURES / src, "-o", tmp_path / "out", *rest)
    assert r.code == 2 and "hint: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
