"""The bill of bytes and the memory plan, on header-only checkpoints of the seed's geometries.

Figures pinned against the seed (REFERENCE.md section 6): the 27B INT4 checkpoint reads 12.596 GB
of decoder weights, a 0.656 GB int4 lm_head and 0.302 GB of DeltaNet state a pass (13.554 GB);
MTP drafting three times adds about 1.17 GB; 262,144 tokens fit a 24 GB card with q4 KV and host
tables and not with bf16 KV.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest

import headeronly as ho
from duet.engine.checkpoint.headers import read_headers
from duet.engine.checkpoint.safetensors import SafetensorsFile
from duet.engine.placement import (
    ATTENTION, DELTANET, EXPERTS, GB, HEAD, HYPER, METADATA, MLP, MTP, NGRAM, NORMS, PLE, RTX_3090, SHARED, VISION,
    EMBEDDING, assess, bill_of_bytes, ceiling_tok_s, detect_card, kv_exact_rows, kv_read_bytes, kv_row_bytes, memory_plan,
    tensor_kind, weights_of,
)


def near(value: float, expected: float, tolerance: float) -> bool:
    return abs(value / expected - 1) <= tolerance


@pytest.fixture(scope="module")
def int4_27b(tmp_path_factory):
    return read_headers(str(ho.write_27b_int4(tmp_path_factory.mktemp("int4_27b"), shards=4)))


@pytest.fixture(scope="module")
def weights_27b(int4_27b):
    return weights_of(int4_27b, w4=True)


def test_27b_int4_pass_reads_what_the_seed_counted(int4_27b, weights_27b):
    bill = bill_of_bytes(weights_27b, int4_27b.config)
    assert near(bill.decoder_weights / GB, 12.596, 0.002)
    assert near(bill.lm_head / GB, 0.656, 0.002)  # 248,320 x 5,120 at 4 bits + a bf16 scale per 128
    assert near(bill.deltanet_state / GB, 0.302, 0.002)  # 48 layers x 48 heads x 128 x 128 x fp32, read + written
    # The seed's 13.554 leaves out the conv history (48 x 3 x 10,240 fp32, read + written: 0.012 GB) and
    # the embedding and rescoring rows (0.0007 GB); we count both, 0.09% over.
    assert near(bill.verify_pass / GB, 13.554, 0.002)
    assert near(bill.not_read["vision tower"] / GB, 0.92, 0.01)
    assert near(bill.not_read["embedding (a row a token is read)"] / GB, 2.54, 0.002)
    assert near(int4_27b.file_bytes / GB, 19.45, 0.002)  # the seed's 19.45 GB on disk: MTP head stored bf16


def test_mtp_drafting_three_times_adds_about_1_17_gb(int4_27b, weights_27b):
    bill = bill_of_bytes(weights_27b, int4_27b.config, depth=3)
    # 3 x (MTP decoder layer 0.192 + mtp.fc 0.027, both repacked to W4, + 65,536 x 5,120 int4 shortlist 0.173)
    assert near(bill.drafting / GB, 1.17, 0.01)
    assert bill.drafting == 3 * (weights_27b.mtp + weights_27b.shortlist)
    assert near(weights_27b.shortlist / GB, 0.173, 0.002)
    # a rollback's record: the 48 layers' state before the verify (0.151 GB) and each of its 4 rows' k | v | beta | e^g
    assert bill.rollback == bill.deltanet_state // 2 + 4 * 48 * 48 * (128 + 128 + 2) * 4


def test_262144_tokens_fit_24_gb_with_q4_kv_and_host_tables_not_with_bf16(int4_27b, weights_27b):
    c = int4_27b.config
    fits = memory_plan(weights_27b, c, RTX_3090, 262_144, "q4", host_tables=True, depth=3)
    assert fits.fits and set(fits.on_host) == {"embedding", "bf16 rescoring head"}
    assert near(sum(fits.on_host.values()) / 2**30, 4.74, 0.01)  # the seed's 4.7 GiB of host tables
    for host_tables in (False, True):
        assert not memory_plan(weights_27b, c, RTX_3090, 262_144, "bf16", host_tables, depth=3).fits
    report = assess(int4_27b, RTX_3090, kv="bf16")
    assert report.max_context["q4"][True] == 262_144 > report.max_context["bf16"][True]
    assert any(a.settings.kv == "q4" for a in report.alternatives)


def test_a_plan_reads_no_weight_data(tmp_path, monkeypatch):
    folder = ho.write_27b_int4(tmp_path, shards=2)
    monkeypatch.setattr(SafetensorsFile, "_mapped", lambda self: pytest.fail("a weight file was mapped"))
    tracemalloc.start()
    report = assess(read_headers(str(folder)), RTX_3090, kv="q4", host_tables=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert report.plan.fits and peak < 64 * 2**20
    assert all(p.stat().st_blocks * 512 < 2**20 for p in folder.glob("*.safetensors"))  # holes, no data


def test_kv_bytes_per_type():
    c = ho_config()
    assert kv_row_bytes(c, "bf16") == 2 * 4 * 256 * 2
    assert kv_row_bytes(c, "q8") == 2 * 4 * 256 * (1 + 2 / 32)
    assert kv_row_bytes(c, "q4") == 2 * 4 * 256 * (0.5 + 2 / 32)  # nibbles + an fp16 scale per 32
    exact_row = 2 * 4 * 256 * 2
    assert kv_read_bytes(c, "q4", 100, 1) == 100 * exact_row  # all within the sink and recent rows
    assert kv_read_bytes(c, "q4", 1000, 1) == 132 * exact_row + 868 * kv_row_bytes(c, "q4")
    assert kv_exact_rows("bf16") == 0 < kv_exact_rows("q4")


def ho_config():
    from duet.engine.config import ModelConfig

    return ModelConfig.from_dict(ho.config_27b())


def test_ceiling_is_eta_bandwidth_over_bytes_times_tau(int4_27b, weights_27b):
    bill = bill_of_bytes(weights_27b, int4_27b.config)
    assert near(ceiling_tok_s(bill, RTX_3090), 0.84 * 936 / 13.566, 1e-3)  # the seed measured 57.8 tok/s
    assert ceiling_tok_s(bill, RTX_3090, tau=5.9) == pytest.approx(5.9 * ceiling_tok_s(bill, RTX_3090))


def test_a_bf16_checkpoint_repacked_to_w4_reads_what_the_int4_one_stores(tmp_path, weights_27b):
    def as_bf16(tensors):
        out = {}
        for name, (dtype, shape) in tensors.items():
            if name.endswith(".weight_packed"):
                out[name.removesuffix("_packed")] = ("BF16", (shape[0], shape[1] * 8))
            elif not name.endswith((".weight_scale", ".weight_shape")):
                out[name] = (dtype, shape)
        return out

    ho.write_safetensors(tmp_path, as_bf16(ho.tensors_27b_int4()))
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in ho.config_27b().items() if k != "quantization_config"}))
    headers = read_headers(str(tmp_path))
    report = assess(headers, RTX_3090, kv="q4", host_tables=True, depth=0)
    assert report.w4_repack.decoder == weights_27b.decoder  # W4 everywhere but in_proj_a/b, norms and conv
    assert near(report.bill.decoder_weights / GB, 48.7, 0.005)  # planned as stored: 16 bits a weight, not 4.125
    assert not report.plan.fits and any(a.settings.w4 for a in report.alternatives)


@pytest.mark.parametrize("name, kind", [
    ("model.language_model.layers.3.self_attn.q_proj.weight_packed", ATTENTION),
    ("model.language_model.layers.3.self_attn.q_proj.weight_shape", METADATA),
    ("model.language_model.layers.0.linear_attn.in_proj_a.weight", DELTANET),
    ("model.language_model.layers.0.linear_attn.conv1d.weight", NORMS),
    ("model.language_model.layers.0.linear_attn.A_log", NORMS),
    ("model.language_model.layers.0.mlp.down_proj.qweight", MLP),
    ("model.layers.1.mlp.experts.7.up_proj.weight", EXPERTS),
    ("model.layers.1.mlp.experts.gate_up_proj", EXPERTS),
    ("model.layers.1.mlp.shared_expert.up_proj.weight", SHARED),
    ("model.layers.1.mlp.gate.weight", SHARED),
    ("model.language_model.norm.weight", NORMS),
    ("model.language_model.embed_tokens.weight", EMBEDDING),
    ("lm_head.weight", HEAD),
    ("mtp.layers.0.mlp.up_proj.weight", MTP),
    ("model.visual.blocks.0.attn.qkv.weight", VISION),
    ("blk.3.attn_q.weight", ATTENTION),
    ("blk.0.attn_qkv.weight", DELTANET),
    ("blk.0.ssm_a", NORMS),
    ("blk.0.ssm_alpha.weight", DELTANET),
    ("blk.0.ffn_up_exps.weight", EXPERTS),
    ("blk.0.ffn_gate_inp.weight", SHARED),
    ("blk.0.ffn_down_shexp.weight", SHARED),
    ("blk.64.attn_q.weight", MTP),
    ("blk.64.nextn.eh_proj.weight", MTP),
    ("output.weight", HEAD),
    ("output_norm.weight", NORMS),
    ("token_embd.weight", EMBEDDING),
    ("model.layers.1.attn_hyper_connection.input_mix_weight_down.weight", HYPER),  # Flash-Next
    ("model.layers.1.mlp_hyper_connection.hc_norm.weight", HYPER),
    ("model.hyper_connection_mixer.input_mix_weight_up.weight", HYPER),
    ("model.layers.1.ple.key_proj.weight", PLE),
    ("model.layers.1.ple.norm_conv.weight", PLE),
    ("model.layers.1.ple.ple_embedding.ngram_embedding.shard_7.weight", NGRAM),
    ("model.layers.1.ple.ple_embedding.layer_multipliers", METADATA),
    ("model.layers.3.self_attn.indexer.index_qk_proj.weight", ATTENTION),
    ("mtp.hyper_connection_mixer.hc_norm.weight", MTP),
    ("blk.1.hc_attn_down.weight", HYPER),
    ("blk.1.ple_key.weight", PLE),
    ("output_hc_up.weight", HYPER),
    ("per_layer_token_embd.weight", NGRAM),
])
def test_tensor_kinds(name, kind):
    assert tensor_kind(name, ho_config()) == kind


def test_gguf_27b_plan(tmp_path):
    headers = read_headers(str(ho.write_27b_gguf(tmp_path / "model.gguf")))
    report = assess(headers, RTX_3090, kv="q4", host_tables=True)
    assert report.settings.w4 and not report.weights.int4_head  # the head is stored Q6_K and read as stored
    assert 12 * GB < report.bill.decoder_weights < 13.5 * GB  # IQ4_XS: 4.25 bits a weight
    assert report.bill.drafting and report.weights.mtp  # block 64 is the MTP layer
    assert report.plan.fits


def test_flash_next_like_moe_reads_only_routed_experts(tmp_path):
    headers = read_headers(str(ho.write_flash_next_like_gguf(tmp_path / "flash.gguf")))
    report = assess(headers, RTX_3090, kv="q4", context=100_000)
    w, bill = report.weights, report.bill
    # The seed: 46.18 GB of routed experts, 1.88 MB an expert, 10 of 512 a token read 0.90 GB.
    assert near(w.decoder[EXPERTS] / GB, 46.18, 0.005) and near(w.expert / 1e6, 1.88, 0.005)
    assert near(bill.decoder[EXPERTS] / GB, 0.90, 0.01)
    assert near(bill_of_bytes(w, headers.config, depth=4).decoder[EXPERTS] / GB, 4.5, 0.01)  # five rows
    assert 0 < report.plan.experts_on_card < 1 and report.plan.fits
    print(f"\nFlash-Next-like on an RTX 3090: {report.plan.experts_on_card:.0%} of routed experts on the card; "
          f"a pass reads {bill.total / GB:.2f} GB; non-expert weights {(bill.decoder_weights - bill.decoder[EXPERTS]) / GB:.2f} GB")


def test_flash_next_at_the_seeds_scale(tmp_path):
    """qwen4_exp with transformers' default geometry at 48 layers (headeronly.FN), INT4 experts. Every
    expected figure is counted here from the geometry, not taken from the plan; the seed's own (AI3
    file, llamAmpere) are in the note: routed experts 46.18 GB, 0.90 GB a token, n-gram table 28.80 GB."""
    f = ho.FN
    headers = read_headers(str(ho.write_flash_next_int4(tmp_path / "flash-next")))
    context = 100_000
    report = assess(headers, RTX_3090, kv="q4", context=context)
    w, bill, plan, c = report.weights, report.bill, report.plan, headers.config
    expert = 3 * f["h"] * f["inner"] * (0.5 + 2 / 128)  # three INT4 matrices, a bf16 scale per 128
    assert w.decoder[EXPERTS] == f["layers"] * f["experts"] * expert
    assert bill.decoder[EXPERTS] == f["layers"] * 10 * expert  # 10 routed a token, one row
    table = f["ple_rows"] * (f["h"] // f["ple_heads"]) * 2  # bf16
    assert w.ngram_tables == table and plan.on_host[NGRAM] == table and NGRAM not in plan.on_card
    assert bill.not_read["n-gram tables (a few rows a token, from host memory)"] == table
    assert w.ngram_token == f["ple_heads"] * (f["h"] // f["ple_heads"]) * 2  # 16 rows of 128 bf16 a token
    hyper = (2 * f["layers"] * (2 * f["lowrank"] * f["hc"] * f["h"] + f["hc"] * f["hc"] * f["h"] + f["hc"] * f["h"])
             + 2 * f["lowrank"] * f["hc"] * f["h"] + f["hc"] * f["h"]) * 2  # 48 x 2 mixers with injection, the head's
    assert w.decoder[HYPER] == hyper
    # QSA: every pooled block key (16-bit), but of the q4 KV only a row's selection, 2,048 + 3 rows
    read = f["budget"] + f["ratio"] - 1
    exact = min(read, 132) * 2 * f["kv"] * 256 * 2
    per_layer = (read - min(read, 132)) * kv_row_bytes(c, "q4") + exact + (context // f["ratio"] + f["ratio"]) * f["index_dim"] * 2
    assert bill.kv_cache == round(12 * per_layer + 0.5)
    assert bill.kv_cache < 0.15 * 12 * context * kv_row_bytes(c, "q4")  # against reading the whole q4 cache
    assert 0 < plan.experts_on_card < 1 and plan.fits
    print(f"\nFlash-Next (seed geometry, INT4): experts {w.decoder[EXPERTS] / GB:.2f} GB, {bill.decoder[EXPERTS] / GB:.2f} GB a "
          f"token; n-gram table {table / GB:.2f} GB (bf16, host); the rest {(bill.decoder_weights - bill.decoder[EXPERTS] + bill.lm_head + w.embedding + w.rescoring_head) / GB:.2f} GB; "
          f"{plan.experts_on_card:.0%} of experts on a 3090 at 100K q4; a pass reads {bill.total / GB:.2f} GB")


def test_card_detection_never_imports_cupy_when_it_is_absent(monkeypatch):
    import importlib.util
    import sys

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real_find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert detect_card() is None and "cupy" not in sys.modules


def test_card_detection_reads_memory_and_bandwidth_from_cupy(monkeypatch):
    """A stand-in CuPy answering as an RTX 3090 does: 9,751 MHz memory clock, 384-bit bus."""
    import importlib.machinery
    import sys
    import types

    attributes = {36: 9_751_000, 37: 384}  # cudaDevAttrMemoryClockRate (kHz), cudaDevAttrGlobalMemoryBusWidth
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"name": b"NVIDIA GeForce RTX 3090"},
        memGetInfo=lambda: (23 * 2**30, 24 * 2**30), deviceGetAttribute=lambda attr, i: attributes[attr])
    fake = types.ModuleType("cupy")
    fake.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    fake.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    card = detect_card()
    assert card.name == "NVIDIA GeForce RTX 3090" and card.vram == 24 * 2**30
    assert near(card.bandwidth / 1e9, 936, 0.001)
