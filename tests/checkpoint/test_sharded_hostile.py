"""Damaged and crafted sharded folders: refused in one line naming the file and the entry.

Each folder is a copy of one real 2-rank save (``fsdp_run``) damaged one way (``_hostile``): paths,
offsets, lengths, holes, overlaps, dtypes, shapes, sizes, names, payloads, bit flips, truncation.
One process (``_hostile_runner``) exports, inspects and loads them all, as a user would; for each,
nothing may be written, nothing read outside the folder, nothing allocated beyond the largest saved
tensor, the model loaded into stays as it was, and no traceback is printed.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from tests.checkpoint._hostile import (
    BIAS,
    INDEX,
    SECRET,
    WEIGHT,
    Variant,
    appended,
    build,
    chunk,
    edit,
    files,
    flip,
    linked_from_outside,
    marker_of,
    outside,
    payload_chunk,
    planner,
    raw_index,
    record,
    replace_index,
    replace_with,
    same_record,
    storage_key,
    tensor,
    transposed,
    truncate,
)
from tests.checkpoint._sharded import Touch
from tests.helpers import REPO, run_command, script_env

Outcome = tuple[dict[str, Any], Path, "str | None"]

_HUGE = (2**62).to_bytes(8, "little")
_SECRET_PATH = f"../../outside/{SECRET}"
M0, M8 = ".metadata", "__1_0.distcp"

VARIANTS = [
    # where the data lies: never outside the folder, never a byte twice
    Variant("path_parent_traversal", record(relative_path=_SECRET_PATH), M0),
    Variant("path_absolute", files(lambda f: record(relative_path=str(outside(f) / SECRET))(f), BIAS), M0),
    Variant("path_etc_passwd", record(relative_path="/etc/passwd"), M0),
    Variant("path_dot_dot", record(relative_path=".."), M0),
    Variant("path_dot", record(relative_path="."), M0),
    Variant("path_empty", record(relative_path=""), M0),
    Variant("path_through_subfolder", record(relative_path="sub/../__1_0.distcp"), M0),
    Variant("path_backslash", record(relative_path="..\\outside\\" + SECRET), M0),
    Variant("path_nul", record(relative_path="__1_0.distcp\0"), M0),
    Variant("path_drive", record(relative_path="C:" + SECRET), M0),
    Variant("path_home", record(relative_path="~/" + SECRET), M0),
    Variant("path_int", record(relative_path=7), M0),
    Variant("path_bytes", record(relative_path=b"__1_0.distcp"), M0),
    Variant("path_missing_file", record(relative_path="__9_0.distcp"), "__9_0.distcp"),
    Variant(
        "path_a_folder", files(lambda f: (f / "sub").mkdir() or record(relative_path="sub")(f), BIAS), "sub"
    ),
    Variant("path_the_index_itself", record(relative_path=".metadata"), M0),
    Variant("path_meta_pt", record(relative_path="meta.pt", offset=0), "meta.pt", inspect_ok=True),
    Variant("offset_negative", record(offset=-1), M0),
    Variant("offset_past_the_end", record(offset=2**62), M8),
    Variant("offset_float", record(offset=1.5), M0),
    Variant("offset_str", record(offset="0"), M0),
    Variant("offset_bool", record(offset=True), M0),
    Variant("length_negative", record(length=-1577), M0),
    Variant("length_zero", record(length=0), M0),
    Variant("length_shorter_than_values", record(length=31), M0),
    Variant("length_past_the_end", record(length=2**40), M0),  # over the records after it
    Variant("length_none", record(length=None), M0),
    Variant("two_chunks_one_record", same_record(BIAS, (8,), (BIAS, (0,))), M0),
    Variant("record_overlaps_next", record(BIAS, (0,), offset=1834), M0),
    Variant("record_of_another_entry", same_record(BIAS, (8,), (WEIGHT, (8, 0))), M0),
    Variant("storage_extension", record(transform_descriptors=["zstd"]), M8, inspect_ok=True),
    # chunks: inside the tensor, once each, every value
    Variant("chunks_overlap_and_leave_a_hole", chunk(WEIGHT, 1, offsets=torch.Size([4, 0])), M0),
    Variant("chunks_at_the_same_place", chunk(WEIGHT, 1, offsets=torch.Size([0, 0])), M0),
    Variant("chunk_outside_the_shape", chunk(WEIGHT, 1, offsets=torch.Size([16, 0])), M0),
    Variant("chunk_larger_than_the_shape", chunk(WEIGHT, 1, sizes=torch.Size([16, 8])), M0),
    Variant("chunk_negative_size", chunk(BIAS, 1, sizes=torch.Size([-8])), M0),
    Variant("chunk_negative_offset", chunk(BIAS, 1, offsets=torch.Size([-8])), M0),
    Variant(
        "chunk_wrong_dimensions", chunk(BIAS, 1, offsets=torch.Size([8, 0]), sizes=torch.Size([8, 1])), M0
    ),
    Variant("chunk_float_offset", chunk(BIAS, 1, offsets=[8.0], rekey=False), M0),
    Variant("chunk_not_a_chunk", tensor(BIAS, chunks=[("0",), ("8",)]), M0),
    Variant("chunk_left_out", edit(lambda m: m.state_dict_metadata[BIAS].chunks.pop()), M0),
    Variant(
        "chunk_repeated",
        edit(lambda m: m.state_dict_metadata[BIAS].chunks.append(m.state_dict_metadata[BIAS].chunks[0])),
        M0,
    ),
    Variant("chunk_without_record", edit(lambda m: m.storage_data.pop(storage_key(m, BIAS, (8,)))), M0),
    Variant("chunks_none", tensor(chunks=None), M0),
    Variant("chunks_empty", tensor(BIAS, chunks=[]), M0),
    # dtypes, shapes and sizes: as the index says, or refused before anything is allocated
    Variant("dtype_float16_for_float32", tensor(dtype=torch.float16), "__0_0.distcp", inspect_ok=True),
    Variant("dtype_int8_for_float32", tensor(dtype=torch.int8), "__0_0.distcp", inspect_ok=True),
    Variant("dtype_float64_for_float32", tensor(dtype=torch.float64), "__0_0.distcp", inspect_ok=True),
    Variant("dtype_int32_for_float32", tensor(dtype=torch.int32), "__0_0.distcp", inspect_ok=True),
    Variant("dtype_bfloat16_for_float32", tensor(dtype=torch.bfloat16), "__0_0.distcp", inspect_ok=True),
    Variant("dtype_quantized", tensor(dtype=torch.qint8), M0),
    Variant("dtype_packed", tensor(dtype=torch.quint4x2), M0),
    Variant("dtype_str", tensor(dtype="float32"), M0),
    Variant("properties_none", tensor(properties=None), M0),
    Variant("shape_wider", tensor(size=torch.Size([16, 9])), M0),
    Variant("shape_negative", tensor(size=torch.Size([-16, 8])), M0),
    Variant("shape_str", tensor(size="16"), M0),
    Variant("shape_1tib_two_small_chunks", tensor(size=torch.Size([2**36, 8])), M0),
    Variant(
        "shape_1tib_one_small_chunk",
        tensor(
            size=torch.Size([2**36, 8]),
            chunks=[ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**36, 8]))],
        ),
        M0,
    ),
    Variant(
        "expand_bomb_1tib",
        appended(
            WEIGHT,
            (0, 0),
            torch.ones(1).expand(2**20, 2**18),
            size=torch.Size([2**20, 2**18]),
            chunks=[ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**20, 2**18]))],
        ),
        M0,
    ),
    Variant(
        "expand_bomb_in_a_chunk",
        appended(WEIGHT, (0, 0), torch.ones(1).expand(8, 8)),
        "__0_0.distcp",
        inspect_ok=True,
    ),
    Variant(
        "chunk_holds_a_view",
        appended(WEIGHT, (0, 0), torch.ones(65)[1:].view(8, 8)),
        "__0_0.distcp",
        inspect_ok=True,
    ),
    Variant(
        "chunk_holds_another_shape",
        appended(WEIGHT, (0, 0), torch.ones(4, 16)),
        "__0_0.distcp",
        inspect_ok=True,
    ),
    Variant(
        "chunk_holds_a_dict",
        appended(WEIGHT, (0, 0), {"w": torch.ones(8, 8)}),
        "__0_0.distcp",
        inspect_ok=True,
    ),
    Variant(
        "chunk_holds_a_sparse_tensor",
        appended(WEIGHT, (0, 0), torch.eye(8).to_sparse()),
        "__0_0.distcp",
        inspect_ok=True,
    ),
    Variant(
        "last_tensor_unreadable",
        appended("state_dict.model.2.bias", (2,), {"w": torch.ones(2)}),
        M8,
        inspect_ok=True,
    ),
    Variant("chunk_holds_a_pickle_payload", payload_chunk, "__0_0.distcp", inspect_ok=True),
    # names: one entry per nested name
    Variant("two_entries_one_name", planner(BIAS, ("state_dict", "model.0.weight")), M0),
    Variant("entry_inside_an_entry", planner(BIAS, ("state_dict", "model.0.weight", "x")), M0),
    Variant("entry_around_entries", planner(BIAS, ("state_dict",)), M0),
    Variant(
        "number_and_string_name",
        planner("optimizer_0.param_groups.0.eps", ("optimizer_0", "param_groups", "0", "lr")),
        M0,
    ),
    Variant("entry_empty_name", planner(BIAS, ()), M0),
    Variant("entry_name_a_str", planner(BIAS, "state_dict"), M0),
    Variant("entry_name_a_bool", planner(BIAS, ("state_dict", True)), M0),
    Variant("planner_a_list", edit(lambda m: setattr(m, "planner_data", [1, 2]), None), M0),
    Variant(
        "entry_keyed_by_a_number",
        edit(lambda m: m.state_dict_metadata.update({7: m.state_dict_metadata.pop(BIAS)}), "7"),
        M0,
    ),
    # what the index holds: torch's records, nothing else
    Variant(
        "entries_a_list",
        edit(lambda m: setattr(m, "state_dict_metadata", list(m.state_dict_metadata)), None),
        M0,
    ),
    Variant("storage_none", edit(lambda m: setattr(m, "storage_data", None), None), M0),
    Variant(
        "storage_record_a_dict",
        edit(lambda m: m.storage_data.update({storage_key(m, BIAS, (8,)): {"relative_path": M8}})),
        M0,
    ),
    Variant(
        "storage_keyed_by_a_str",
        edit(lambda m: m.storage_data.update({BIAS: m.storage_data.pop(storage_key(m, BIAS, (8,)))})),
        M0,
    ),
    Variant("entry_an_int", edit(lambda m: m.state_dict_metadata.update({BIAS: 5})), M0),
    Variant("index_a_dict", replace_index(lambda m: {"state_dict_metadata": {}}), M0),
    Variant("index_a_list", replace_index(lambda m: [m]), M0),
    Variant("index_12_bytes_claiming_a_huge_frame", raw_index(b"\x80\x04\x95" + _HUGE + b"."), M0),
    Variant("index_huge_string", raw_index(b"\x80\x05\x8d" + _HUGE + b"abc"), M0),
    Variant("index_huge_bytes", raw_index(b"\x80\x05\x8e" + _HUGE + b"abc"), M0),
    Variant("index_truncated", files(lambda f: (f / INDEX).write_bytes((f / INDEX).read_bytes()[:3000])), M0),
    Variant("index_empty", raw_index(b""), M0),
    Variant("index_64_gib_sparse", files(lambda f: os.truncate(f / INDEX, 2**36)), M0),
    Variant("index_not_a_pickle", raw_index(b"not a pickle at all"), M0),
    Variant(
        "index_pickle_payload",
        files(lambda f: (f / INDEX).write_bytes(pickle.dumps(Touch(marker_of(f))))),
        M0,
    ),
    Variant("index_a_folder", replace_with(INDEX, lambda p: p.mkdir()), M0),
    Variant("index_a_named_pipe", replace_with(INDEX, os.mkfifo), M0),
    Variant("index_a_link_to_a_device", replace_with(INDEX, lambda p: p.symlink_to("/dev/zero")), M0),
    # the shard files' bytes and the files themselves
    Variant("bit_flip_in_values", flip(BIAS, (8,), "data/0"), M8, inspect_ok=True),
    Variant("bit_flip_in_rank_0_values", flip(WEIGHT, (0, 0), "data/0"), "__0_0.distcp", inspect_ok=True),
    Variant("bit_flip_in_pickle", flip(BIAS, (0,), "data.pkl", at=0.6), "__0_0.distcp", inspect_ok=True),
    Variant("bit_flip_in_directory", flip(BIAS, (0,), "", at=0.97), "__0_0.distcp", inspect_ok=True),
    Variant("shard_cut_in_half", truncate(M8, lambda n: n // 2), M8),
    Variant("shard_one_byte_short", truncate(M8, lambda n: n - 1), M8),
    Variant("shard_empty", truncate("__0_0.distcp", lambda n: 0), "__0_0.distcp"),
    Variant(
        "shard_zeroed",
        files(lambda f: (f / M8).write_bytes(bytes((f / M8).stat().st_size)), None),
        M8,
        inspect_ok=True,
    ),
    Variant("shard_missing", files(lambda f: (f / M8).unlink()), M8),
    Variant("shard_a_folder", replace_with(M8, lambda p: p.mkdir()), M8),
    Variant("shard_a_named_pipe", replace_with(M8, os.mkfifo), M8),
    Variant("shard_a_link_to_a_device", replace_with(M8, lambda p: p.symlink_to("/dev/zero")), M8),
    Variant("shard_a_link_loop", replace_with(M8, lambda p: p.symlink_to(p.name)), M8),
    Variant("shard_a_dangling_link", replace_with(M8, lambda p: p.symlink_to("gone.distcp")), M8),
    Variant("meta_pt_truncated", truncate("meta.pt", lambda n: n // 2), "meta.pt"),
    Variant(
        "meta_pt_pickle_payload",
        files(lambda f: torch.save({"x": Touch(marker_of(f))}, f / "meta.pt")),
        "meta.pt",
    ),
    # controls: what reading the weights never meets, or a layout the reader accepts
    Variant("pristine", files(lambda f: None), "", inspect_ok=True, refused=False),
    Variant(
        "bit_flip_in_optimizer_state",
        flip("optimizer_0.state.model.0.weight.exp_avg", (8, 0), "data/0"),
        "",
        inspect_ok=True,
        refused=False,
    ),
    Variant("chunk_savedtransposed", transposed, "", inspect_ok=True, refused=False),
    # files linked from outside the folder, each a copy of what was there: a folder reads only itself
    Variant("shard_a_link_outside", replace_with(M8, lambda p: p.symlink_to(outside(p.parent) / SECRET)), M8),
    Variant("shard_moved_out_and_linked", linked_from_outside(M8), M8),
    Variant("index_moved_out_and_linked", linked_from_outside(M0), M0),
    Variant("meta_pt_moved_out_and_linked", linked_from_outside("meta.pt"), "meta.pt"),
]


@pytest.fixture(scope="module")
def outcomes(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Outcome]:
    """What reading each damaged folder gave: name -> (result, folder, entry the error must name)."""
    source, reference = fsdp_run
    root = tmp_path_factory.mktemp("hostile")
    built = build(source, root, VARIANTS)
    torch.save(reference, root / "reference.pt")
    plan = {
        "reference": str(root / "reference.pt"),
        "warm": str(source),
        "warm_out": str(root / "warm.safetensors"),
        "variants": [
            {"name": name, "folder": str(folder), "out": str(root / "out" / name)}
            for name, (folder, _) in built.items()
        ],
    }
    (root / "plan.json").write_text(json.dumps(plan))
    command = [sys.executable, "-m", "tests.checkpoint._hostile_runner", str(root / "plan.json")]
    result = run_command([*command, str(root / "results.json")], cwd=REPO, env=script_env(), timeout=600)
    assert result.returncode == 0, result.output[-3000:]
    results = {r["name"]: r for r in json.loads((root / "results.json").read_text())}
    return {name: (results[name], folder, entry) for name, (folder, entry) in built.items()}


def _names(line: str, folder: Path, variant: Variant, entry: str | None) -> None:
    if variant.file:
        named = str(folder / variant.file) in line
        missing = f"{folder} is incomplete" in line and variant.file in line
        assert named or missing, f"{variant.file} not named: {line}"
    if entry is not None:
        assert repr(entry) in line or f"entry {entry} " in line, f"{entry!r} not named: {line}"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_a_damaged_folder(
    variant: Variant, outcomes: dict[str, Outcome], fsdp_run: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    result, folder, entry = outcomes[variant.name]
    export, inspect, load = result["export"], result["inspect"], result["load"]
    for command in (export, inspect):
        assert command["code"] is not None, command["stderr"]
        assert "Traceback" not in command["stderr"], command["stderr"]
    assert load["traceback"] is None, load["traceback"]
    assert result["outside"] == []  # nothing outside the folder is opened, through a link or not
    largest = max(v.numel() * v.element_size() for v in fsdp_run[1].values())
    assert result["largest"] <= largest
    assert not marker_of(folder).exists()  # no payload ran
    assert result["left"] == []  # no temporary file
    if not variant.refused:
        assert (export["code"], result["written"]) == (0, True), export["stderr"]
        assert (inspect["code"], load["error"], load["loaded"]) == (0, None, True)
        return

    lines = export["stderr"].splitlines()
    assert (export["code"], len(lines)) == (1, 1), export["stderr"]
    assert lines[0].startswith("lightning-mgpu export: error: ")
    _names(lines[0], folder, variant, entry)
    assert result["written"] is None
    assert load["error"] is not None
    assert "\n" not in load["error"]
    _names(load["error"], folder, variant, entry)
    assert load["unchanged"]  # all or nothing
    if variant.inspect_ok:
        assert inspect["code"] == 0, inspect["stderr"]
    else:
        assert (inspect["code"], len(inspect["stderr"].splitlines())) == (1, 1), inspect["stderr"]
        _names(inspect["stderr"], folder, variant, entry)
