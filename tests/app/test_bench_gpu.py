"""The GPU benchmark's geometry and table (the measurement itself runs in scripts/gpu_check.sh)."""

from app import bench_gpu


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
