"""The spread HF export (issue 61 item 4: every rank writes its own file, rank 0 the index and the
non-weight files) against the one-rank export it replaces under several ranks
(``save_model_dir``, ``model.save_pretrained``: the reference), on the real tiny Qwen3-VL: the
same tensors bitwise, the same config, and transformers loads both to the same model. The
ranks' writes run here in one process, as three ranks would each run theirs; the two-rank
``Checkpointer.save`` that drives them is tests/test_checkpoint_sharded.py's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

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
