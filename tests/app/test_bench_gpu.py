"""The GPU benchmark's geometry and table (the measurement itself runs in scripts/gpu_check.sh)."""

from duet.app.bench import gpu as bench_gpu


def test_shapes_are_the_27b_geometry():
    shapes = bench_gpu.SHAPES
    assert shapes["attn q_proj (query|gate)"] == (12288, 5120)
    assert shapes["deltanet in_proj_qkv"] == (10240, 5120)
    assert shapes["mlp gate_up"] == (34816, 5120) and shapes["mlp down"] == (5120, 17408)
    assert shapes["lm_head (int4 ranking)"] == (248320, 5120)
    assert all(n % 16 == 0 and k % 128 == 0 for n, k in shapes.values())  # what the W4 GEMV kernel takes


def test_table_has_one_line_per_weight_and_route():
    copy = 4.0e12
    results = [{"name": name, "N": 1024, "K": 5120, "weight_bytes": 2_703_360, "route": route, "rows": t,
                "bytes_per_s": copy * share, "of_copy": share}
               for name, share in (("a", 0.5), ("b", 0.9)) for route in bench_gpu.ROUTES for t in bench_gpu.ROWS]
    table = bench_gpu.format_table({"device": "GPU", "copy_bytes_per_s": copy, "rows": list(bench_gpu.ROWS),
                                    "results": results})
    lines = table.splitlines()
    assert lines[0].startswith("GPU: device-to-device copy 4000 GB/s")
    assert len(lines) == 2 + 2 * len(bench_gpu.ROUTES)
    assert lines[-1].split()[:2] == ["b", "1024"] and "3600 ( 90%)" in lines[-1]


def test_cycle_bill_is_the_seeds_27b_pass_plus_context_and_rollback_record():
    from duet.engine.heads import RESCORE_CANDIDATES
    from duet.engine.placement import conv_state_bytes

    c = bench_gpu.geometry_27b(64)
    assert c.layer_types.count("full_attention") == 16 and c.rotary_dim == 64
    kv = 16 * bench_gpu.CONTEXT * 2 * 4 * 256 * 2  # bf16 keys and values of 16 attention layers
    # REFERENCE.md section 6: 12.596 GB decoder + 0.656 GB int4 head + 0.302 GB DeltaNet state = 13.554 GB
    assert abs(bench_gpu.cycle_bill(c, 1) - kv - 2 * conv_state_bytes(c) - 13.554e9) < 0.01e9
    lookups = (1 + RESCORE_CANDIDATES) * 5120 * 2  # a row's embedding row and its rescored candidates' bf16 rows
    record = 48 * 48 * 128 * 128 * 4 + 4 * 48 * 48 * (128 + 128 + 2) * 4  # S before the pass, each row's k | v | beta | e^g
    assert bench_gpu.cycle_bill(c, 4) - bench_gpu.cycle_bill(c, 1) == 3 * lookups + record


def test_cycle_table_says_how_much_of_the_model_ran():
    result = {"route": "w4a16", "rows": 4, "bill_bytes": 3.4e9, "limit_s": 1e-3, "uncaptured_s": 5e-3,
              "graph_s": 1.25e-3, "of_limit": 0.8}
    report = {"device": "GPU", "copy_bytes_per_s": 3.4e12, "layers": 16, "context": 512, "results": [result]}
    lines = bench_gpu.format_cycle_table(report).splitlines()
    assert "16 of its 64 layers" in lines[0] and "copy 3400 GB/s" in lines[0]
    assert lines[2].split() == ["w4a16", "4", "3400.0", "1.000", "5.000", "1.250", "80%"]
    assert "all 64 layers" in bench_gpu.format_cycle_table({**report, "layers": 64}).splitlines()[0]
