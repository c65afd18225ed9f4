"""sgl_kernel.moe_grouped_gemm_configs: the grouped MoE GEMM's per-GPU tile table, its lookup by
device name, weight and pair bucket, the fallback tiles, and the plan helpers the prefill warm-up
uses without a GPU (a fake device name and table files written here; no kernel launches).
"""
from __future__ import annotations

import pytest
import torch

from kernel_test_utils import needs_triton

pytestmark = needs_triton


@pytest.fixture(scope="module")
def tiles():
    """The kernel's launch configurations (the per-GPU table and its lookup)."""
    import sgl_kernel.moe_grouped_gemm_configs as module

    return module


def test_launch_config_table_lookup(tiles, tmp_path, monkeypatch):
    """Table entries by device name, shape key and the nearest pair bucket; the fallback
    without an entry; the interpreter's own small tiles; the shipped table parses."""
    import json

    assert isinstance(tiles.load_config_table(), dict)  # the packaged file
    key = tiles.config_key(512, 1536, 2560, False)
    assert key == "E=512,N=1536,K=2560,dtype=bf16"
    entry = {"block_m": 32, "block_n": 64, "block_k": 64, "group_m": 4, "num_warps": 4,
             "num_stages": 3}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"_format": "x", "Fake GPU": {key: {
        "1024": entry, "16384": {**entry, "block_m": 128}}}}))
    monkeypatch.setattr(tiles, "INTERPRETED", False)
    monkeypatch.setattr(tiles, "_device_name", lambda index: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device("cuda", 0)

    def pick(pairs, fp8=False, n=1536):
        return tiles.launch_config(512, n, 2560, pairs, fp8, cuda, table_path=str(path))

    assert pick(2048).block_m == 32 and pick(2048).group_m == 4
    assert pick(8192).block_m == 128 and pick(100).block_m == 32
    # No entry: the fallback, its row block sized to the mean group (2048 / 512 = 4 rows).
    assert pick(2048, fp8=True) == tiles.DEFAULT_CONFIG._replace(block_k=128, block_m=16)
    assert pick(65536, n=1024) == tiles.DEFAULT_CONFIG
    assert not pick(2048, fp8=True).fp8_prescale  # the fallback keeps per-block scaling
    fp8_key = tiles.config_key(512, 1536, 2560, True)
    assert tiles.config_fields(pick(2048)) == entry  # bf16 records: no fp8 field
    path.write_text(json.dumps({"Fake GPU": {key: {"1024": entry}, fp8_key: {
        "1024": entry, "8192": {**entry, "fp8_prescale": True}}}}))
    tiles.load_config_table.cache_clear()
    assert not pick(1024, fp8=True).fp8_prescale  # a record without the field: per-block
    assert pick(8192, fp8=True).fp8_prescale
    assert tiles.config_fields(pick(8192, fp8=True), fp8=True) == {**entry, "fp8_prescale": True}
    # The SwiGLU tile layout: read where stored, written for up-projection records only.
    assert not pick(1024, fp8=True).swiglu_interleave
    path.write_text(json.dumps({"Fake GPU": {key: {"1024": {**entry, "swiglu_interleave": True}}}}))
    tiles.load_config_table.cache_clear()
    assert pick(1024).swiglu_interleave
    assert tiles.config_fields(pick(1024)) == entry
    assert tiles.config_fields(pick(1024), swiglu=True) == {**entry, "swiglu_interleave": True}
    # The w8a8 entry is its own key; without one, the fp8 fallback (not the fp8 entry).
    w8a8_key = tiles.config_key(512, 1536, 2560, True, act_fp8=True)
    assert w8a8_key.endswith("dtype=w8a8")
    assert tiles.launch_config(512, 1536, 2560, 8192, True, cuda, table_path=str(path),
                             act_fp8=True) == tiles.fallback_config(512, 8192, True)
    path.write_text(json.dumps({"Fake GPU": {w8a8_key: {"8192": {**entry, "block_m": 128}}}}))
    tiles.load_config_table.cache_clear()
    assert tiles.launch_config(512, 1536, 2560, 8192, True, cuda, table_path=str(path),
                             act_fp8=True).block_m == 128
    tiles.load_config_table.cache_clear()
    assert pick(16384, n=1024).block_m == 32
    monkeypatch.setattr(tiles, "INTERPRETED", True)
    small = tiles.launch_config(6, 96, 64, 40, device=torch.device("cpu"), swiglu=True)
    assert (small.block_m, small.block_n, small.block_k) == (16, 64, 64)


def test_table_device_falls_back_to_the_same_model(tiles, tmp_path, caplog):
    """A GPU missing from the table takes the tiles of its model's entry (the same vendor and
    first word with a digit), one warning per GPU name; another model, or a name without a
    model number, takes none."""
    import json
    import logging

    names = ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    assert tiles.table_device(names, "NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3"
    assert tiles.table_device(names, "NVIDIA H100 PCIe") == "NVIDIA H100 80GB HBM3"
    assert tiles.table_device(names, "NVIDIA H200 NVL") == "NVIDIA H200"
    assert tiles.table_device(names, "NVIDIA GH200 480GB") is None
    assert tiles.table_device(names, "NVIDIA") is None and tiles.table_device([], "NVIDIA H200") is None
    # The model is the first word with a digit, not the second word.
    consumer = ["NVIDIA GeForce RTX 4090"]
    assert tiles.table_device(consumer, "NVIDIA GeForce RTX 3090") is None
    assert tiles.table_device(consumer, "NVIDIA GeForce RTX 4090 D") == "NVIDIA GeForce RTX 4090"
    key = tiles.config_key(512, 1536, 2560, False)
    entry = {"1024": {"block_m": 32, "block_n": 64, "block_k": 64, "group_m": 4,
                      "num_warps": 4, "num_stages": 3}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"NVIDIA H100 80GB HBM3": {key: entry}}))
    tiles.load_config_table.cache_clear()
    tiles._note_table_device.cache_clear()
    with caplog.at_level(logging.WARNING, logger=tiles.__name__):
        for _ in range(3):
            assert tiles.table_entry(512, 1536, 2560, False, "NVIDIA H100 PCIe", str(path)) == entry
            assert tiles.table_entry(512, 1536, 2560, False, "NVIDIA H100 80GB HBM3",
                                   str(path)) == entry
            assert tiles.table_entry(512, 1536, 2560, False, "NVIDIA A100-SXM4-80GB",
                                   str(path)) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # one per GPU name without tiles of its own, none for the H100
    assert "'NVIDIA H100 PCIe'" in said[0] and "'NVIDIA H100 80GB HBM3'" in said[0]
    assert "'NVIDIA A100-SXM4-80GB'" in said[1] and "fallback tiles" in said[1]
    tiles.load_config_table.cache_clear()


def test_plan_helpers_agree_with_launch_config(tiles, tmp_path, monkeypatch):
    """select_config is launch_config's choice without a GPU; config_change_points finds every
    pair count where that choice changes (brute force; two buckets with equal tiles are one
    config), with and without a table entry; launch_int_args is the kernel's max_blocks."""
    import json

    key = tiles.config_key(512, 1536, 2560, False)
    fields = {"block_m": 32, "block_n": 128, "block_k": 128, "group_m": 8, "num_warps": 8,
              "num_stages": 4}
    table = {"1024": fields, "8192": fields, "32768": {**fields, "block_m": 128},
             "65536": {**fields, "block_m": 128, "num_stages": 3}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"Fake GPU": {key: table}}))
    monkeypatch.setattr(tiles, "INTERPRETED", False)
    monkeypatch.setattr(tiles, "_device_name", lambda index: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device("cuda", 0)
    entry = tiles.table_entry(512, 1536, 2560, False, "Fake GPU", str(path))
    assert entry == table and tiles.table_entry(512, 1536, 2560, True, "Fake GPU", str(path)) is None
    hi = 70000
    for fp8, buckets in ((False, entry), (True, None)):
        picks = [tiles.select_config(buckets, 512, p, fp8) for p in range(hi + 1)]
        for p in range(1, hi + 1, 97):
            assert picks[p] == tiles.launch_config(512, 1536, 2560, p, fp8, cuda,
                                                 table_path=str(path))
        brute = [p for p in range(1025, hi + 1) if picks[p] != picks[p - 1]]
        assert tiles.config_change_points(buckets, 512, fp8, 1024, hi) == brute
        # The table: 1024 and 8192 share their tiles, then 32768, then 65536; without an
        # entry the fallback's row block: 16 -> 32 -> 64.
        assert len(brute) == 2
    assert tiles.config_change_points(entry, 512, False, 1024, hi)[0] == 16385  # 8192 | 32768
    from sgl_kernel.moe_align import moe_align

    gen = torch.Generator().manual_seed(0)
    for t, k, e, block_m in ((3, 2, 6, 16), (40, 8, 512, 32), (300, 8, 64, 128)):
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        al = moe_align(ids, e, block_m)
        assert tiles.launch_int_args(t * k, e, block_m) == (t * k, al.block_expert.shape[0])
