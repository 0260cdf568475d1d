"""benchmarks/profile_step.py's categories: an HLO instruction's kind and while-loop depth, a torch op's family.

A hand-written optimized-HLO text (no compile): the breakdown in docs/PERFORMANCE.md depends on these."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))

import profile_step  # noqa: E402  (imports neither JAX nor torch at module level)

_HLO = '''HloModule m

%fused_computation (param_0: f32[8,64]) -> f32[8,64] {
  %param_0 = f32[8,64]{1,0} parameter(0)
  ROOT %tanh.1 = f32[8,64]{1,0} tanh(%param_0)
}

%inner_body (arg: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %arg = (s32[], f32[8,64]{1,0}) parameter(0)
  %gte.2 = f32[8,64]{1,0} get-tuple-element(%arg), index=1
  %dot_general.7 = f32[8,64]{1,0} dot(%gte.2, %gte.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple.3 = (s32[], f32[8,64]{1,0}) tuple(%gte.2, %dot_general.7)
}

%outer_body (arg.1: (s32[], f32[8,64], /*index=2*/f32[8,64])) -> (s32[], f32[8,64]) {
  %arg.1 = (s32[], f32[8,64]{1,0}) parameter(0)
  %gte.1 = f32[8,64]{1,0} get-tuple-element(%arg.1), index=1
  %ynn_fusion.4 = f32[8,64]{1,0} fusion(%gte.1), kind=kCustom, calls=%fused_computation, backend_config={"fusion_backend_config":{"kind":"__ynn_fusion"}}
  %while.9 = (s32[], f32[8,64]{1,0}) while(%arg.1), condition=%cond, body=%inner_body
  ROOT %tuple.2 = (s32[], f32[8,64]{1,0}) tuple(%gte.1, %ynn_fusion.4)
}

ENTRY %main.1 (x.1: f32[8,64]) -> f32[8,64] {
  %x.1 = f32[8,64]{1,0} parameter(0)
  %tanh_fusion = f32[8,64]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_computation
  %wrapped_broadcast.2 = f32[6,8,64]{2,1,0} fusion(%constant.1), kind=kLoop, calls=%wrapped_broadcast_computation
  %copy.3 = f32[8,64]{1,0} copy(%tanh_fusion)
  %while.8 = (s32[], f32[8,64]{1,0}) while(%tuple.1), condition=%cond.1, body=%outer_body
  ROOT %transpose.2 = f32[64,8]{1,0} transpose(%copy.3), dimensions={1,0}
}
'''


def test_hlo_categories_name_kind_and_loop_depth():
    cats = profile_step.hlo_categories(_HLO)
    assert cats['tanh_fusion'] == 'loop fusion @depth 0'
    assert cats['wrapped_broadcast.2'] == 'buffer fill (broadcast) @depth 0'  # a scan's stacked output, zeroed
    assert cats['copy.3'] == 'copy @depth 0'
    assert cats['transpose.2'] == 'transpose @depth 0'
    assert cats['ynn_fusion.4'] == 'dot (YNNPACK) @depth 1'
    assert cats['dot_general.7'] == 'dot (XLA Eigen) @depth 2'
    shares = profile_step.by_category([('ynn_fusion.4', 0.5, 1), ('while.8', 0.9, 1), ('Await', 0.1, 3)], cats)
    assert shares == {'dot (YNNPACK) @depth 1': 0.5, 'unmatched': 0.1}  # a while's span is its body's ops
    assert profile_step._seconds(shares, 2.0) == {'dot (YNNPACK) @depth 1': 1.0, 'unmatched': 0.2}


def test_torch_categories():
    assert profile_step.torch_category('aten::mm') == 'matmul (mm/bmm/addmm/linear)'
    assert profile_step.torch_category('aten::_scaled_dot_product_flash_attention_for_cpu') == 'attention (sdpa)'
    assert profile_step.torch_category('aten::_foreach_lerp_') == 'optimizer (AdamW, clipping)'
    assert profile_step.torch_category('aten::copy_') == 'copies (copy_/clone/contiguous/cat)'
    assert profile_step.torch_category('aten::mul').startswith('other')
