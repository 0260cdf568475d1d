"""benchmarks/grouped_gemm.py (gpu_check's `grouped_gemm` row): its routings, FLOP count and table, at the
--smoke shape on the CPU (the moe_1t shape needs a GPU)."""

import os
import sys

import pytest

import processes

sys.path.insert(0, os.path.join(processes.REPO, 'benchmarks'))
import grouped_gemm  # noqa: E402  (benchmarks/grouped_gemm.py)


@pytest.mark.parametrize('rows, groups', [(32768, 12), (128, 8), (131, 7)])
def test_routings_cover_every_row(rows, groups):
    even = grouped_gemm.group_sizes(rows, groups, 'even')
    skewed = grouped_gemm.group_sizes(rows, groups, 'skewed')
    assert sum(even) == sum(skewed) == rows and len(even) == len(skewed) == groups
    assert max(even) - min(even) <= 1
    assert skewed[0] == round(grouped_gemm.HOT * rows / groups) and max(skewed[1:]) - min(skewed[1:]) <= 1


def test_the_full_shape_is_one_moe_1t_device_at_ep_32():
    """configs/moe.py's moe_1t: d 7168, experts of 2048, 384 experts, top 8; EP 32 holds 12 of them."""
    s = grouped_gemm.FULL
    assert (s['d'], s['f'], s['experts'], s['top_k']) == (7168, 2048, 384, 8)
    assert s['experts'] // s['ep'] == 12 and s['top_k'] * s['tokens'] == 32768


def test_smoke_rows_match_a_dense_product_and_count_useful_flops():
    record = grouped_gemm.measure(smoke=True, reps=1, trials=1)
    s, m = grouped_gemm.SMOKE, record['assignments']
    rows = record['rows']
    assert [(r['projection'], r['case']) for r in rows] == [
        (p, c) for p in ('gate/up', 'down') for c in ('dense', 'even', 'skewed', 'padded')]
    for r in rows:
        assert r['flops'] == 2 * m * s['d'] * s['f'] and r['ms'] > 0 and r['tflops'] > 0, r
        assert r['rows'] == (2 * m if r['case'] == 'padded' else m), r
        if r['case'] != 'dense':
            assert sum(r['group_sizes']) == m and r['rel_err'] < 1e-2, r  # bf16 output rounding
    table = grouped_gemm.markdown(record)
    assert '| projection | case | shape |' in table and table.count('\n| gate/up |') == 4
    assert 'Grouped GEMM' in grouped_gemm.markdown({'error': 'x'})
