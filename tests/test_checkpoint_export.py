"""The spread HF export (issue 61 item 4: every rank writes its own file, rank 0 the index and the
non-weight files) against the one-rank export it replaces under several ranks
(``save_model_dir``, ``model.save_pretrained``: the reference), on the real tiny Qwen3-VL: the
same tensors bitwise, the same config, and transformers loads both to the same model. The
ranks' writes run here in one process, as three ranks would each run theirs; the two-rank
``Checkpointer.save`` that drives them is tests/test_checkpoint_sharded.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from namespaces import namespaced, run_in

from paravt.checkpoint import EXPORT_INDEX, load_model_state, save_model_dir
from paravt.checkpoint.export import part_files, write_export_meta, write_export_part
from paravt.distributed import ExportSplit, export_owners


def test_the_spread_export_is_the_one_file_export_in_hf_s_sharded_layout(
    tmp_path: Path, assets: dict[str, str]
) -> None:
    import transformers

    src = assets["model"]
    model = transformers.AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}  # the compute cast

    ref = save_model_dir(tmp_path / "one", model, sd, tokenizer=tok, source_dir=src)

    nbytes = {k: v.numel() * v.element_size() for k, v in sd.items()}
    owners = dict(zip(sd, export_owners(list(nbytes.values()), 3), strict=True))
    split = ExportSplit(owners, nbytes, frozenset({torch.bfloat16}))
    out = tmp_path / "spread"
    written = [write_export_part(out, {k: v for k, v in sd.items() if owners[k] == r}, split, r)
               for r in range(3)]  # fmt: skip
    write_export_meta(out, model, split, tokenizer=tok, source_dir=src)

    parts = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [list(w) for w in written] == [[p] for p in parts] and list(
        part_files(split).values()
    ) == parts
    index = json.loads((out / EXPORT_INDEX).read_text())
    assert index["weight_map"] == {k: parts[owners[k]] for k in sd}
    assert index["metadata"]["total_size"] == sum(nbytes.values())

    # Every file of the one-file export is there (its weights split in three), with the same
    # config (the bf16 dtype included) and the same non-weight files byte for byte.
    names = {f.name for f in ref.iterdir()}
    assert {f.name for f in out.iterdir()} == (names - {"model.safetensors"}) | {
        *parts,
        EXPORT_INDEX,
    }
    for name in sorted(names - {"model.safetensors"}):
        if name.endswith(".json"):
            assert json.loads((out / name).read_text()) == json.loads((ref / name).read_text())
        else:
            assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text())["text_config"]["dtype"] == "bfloat16"

    # The same tensors, read as files and as transformers loads the folder.
    a, b = load_model_state(ref), load_model_state(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    auto = transformers.AutoModelForImageTextToText.from_pretrained
    m1, m2 = auto(str(ref)), auto(str(out))
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert {v.dtype for v in s2.values() if v.is_floating_point()} == {torch.bfloat16}


def test_a_rank_that_owns_no_entry_writes_no_file(tmp_path: Path) -> None:
    """More ranks than the entries fill: the files are numbered over the ranks that write."""
    split = ExportSplit({"a": 1, "b": 3}, {"a": 4, "b": 4}, frozenset({torch.float32}))
    assert part_files(split) == {1: "model-00001-of-00002.safetensors",
                                 3: "model-00002-of-00002.safetensors"}  # fmt: skip
    assert write_export_part(tmp_path, {}, split, 0) == {} and not list(tmp_path.iterdir())
    got = write_export_part(tmp_path, {"b": torch.ones(1)}, split, 3)
    assert list(got) == ["model-00002-of-00002.safetensors"]


def test_a_full_disk_under_a_part_is_an_oserror_naming_the_file(tmp_path: Path) -> None:
    """safetensors' writer reports a full disk as its own ``SafetensorError``; the part's write
    turns it into the ``OSError`` a save's error path reports (``CheckpointSaveError``,
    ``train.on_save_error``) instead of a bug. A real full file system: a 64 KiB tmpfs."""
    if why := namespaced():
        pytest.skip(why)
    d = tmp_path / "full"
    d.mkdir()
    code = f"""
        from pathlib import Path
        import torch
        from paravt.checkpoint.export import write_export_part
        from paravt.distributed import ExportSplit
        split = ExportSplit({{"a": 0}}, {{"a": 400_000}}, frozenset({{torch.float32}}))
        try:
            write_export_part(Path({str(d)!r}), {{"a": torch.ones(100_000)}}, split, 0)
        except OSError as e:
            print("ERR", e.errno, e.filename)
        """
    r = run_in(f"mount -t tmpfs -o size=64k tmpfs {d}", code)
    assert r.returncode == 0, r.stderr
    assert f"ERR 28 {d / 'model-00001-of-00001.safetensors'}" in r.stdout, r.stdout + r.stderr


def test_a_failed_export_part_is_every_rank_s_outcome(tmp_path: Path) -> None:
    """``write_shards``' ``then`` (a rank's export part): its ``OSError`` is the save's failed
    write, a bug raises after the gather (on every rank: none is left waiting in it)."""
    from paravt.checkpoint.sharded import write_shards
    from paravt.distributed import DistContext

    state = {"w": torch.ones(4)}

    def full() -> dict:
        raise OSError(28, "No space left on device", str(tmp_path / "part"))

    bad, _ = write_shards(tmp_path / "a", state, DistContext(), then=full)
    assert bad == (28, "No space left on device", str(tmp_path / "part"))
    bad, got = write_shards(tmp_path / "b", state, DistContext(), then=lambda: {"x": [1, "d"]})
    assert bad is None and got["x"] == [1, "d"]

    def bug() -> dict:
        raise ValueError("a bug")

    with pytest.raises(RuntimeError, match=r"rank 0 failed: ValueError: a bug"):
        write_shards(tmp_path / "c", state, DistContext(), then=bug)
