"""The model-family declaration: the registry matches the config's names, the GPT family's tables
match its module, and an unknown family fails validation with a field / value / fix message."""

import jax
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier.errors import ConfigError
from jaxfrontier import flops as flops_lib
from jaxfrontier.model import params as params_lib

# Distinct sizes so a swapped axis fails: 3 layers, 40 wide, 5 heads, 24 positions, 97 tokens.
SHAPE = dict(num_layers=3, d_model=40, num_heads=5, seq_len=24, vocab_size=97)


def shape_of(**model):
    c = config_lib.base_config()
    c.model.update(**SHAPE, **model)
    return config_lib.model_shape(c)


def test_registry_lists_the_config_families():
    assert families.names() == config_lib.MODEL_FAMILIES
    assert config_lib.base_config().model.family in families.names()


def test_unknown_family_is_a_config_error():
    c = config_lib.base_config()
    c.model.family = 'llama9'
    with pytest.raises(ConfigError, match=r"model.family = 'llama9'.*unknown model family.*gpt"):
        config_lib.validate(c)
    with pytest.raises(ConfigError, match='model.family'):
        families.get('llama9')


# A family's own fields that change its parameters, beyond its defaults: Llama with Qwen3's QK-norm and
# heads 6 wide (q 30 wide over a width of 40: 40 / 5 = 8 is not the head width), and 5 kv heads.
FIELDS = {'llama': dict(qk_norm=True, head_dim=6, num_kv_heads=5)}
# Mixture of experts (families/moe.py): 7 experts of width 11, 2 shared, a dense first layer, the router's bias;
# and every layer MoE, no shared experts, no bias.
MOE = dict(moe_experts=7, moe_top_k=2, moe_mlp_dim=11, moe_shared_experts=2, moe_first_dense=1,
           moe_router='sigmoid', moe_router_bias=True)
MOE_ALL = dict(MOE, moe_first_dense=0, moe_shared_experts=0, moe_router_bias=False)


@pytest.mark.parametrize('family,fields', [(f, {}) for f in config_lib.MODEL_FAMILIES] +
                         [(f, fields) for f, fields in FIELDS.items()] + [('llama', MOE), ('llama', MOE_ALL)],
                         ids=lambda x: str(x) if x else 'defaults')
@pytest.mark.parametrize('tied', [True, False])
def test_param_specs_match_the_module(family, fields, tied):
    """Names, shapes and logical axes of the family's table are those of its module (eval_shape)."""
    shape = shape_of(family=family, tied_embeddings=tied, **fields)
    model_def = params_lib.ModelDef.create(shape)
    flat = lambda tree, **kw: {'/'.join(k.key for k in path): leaf for path, leaf in
                               jax.tree_util.tree_flatten_with_path(tree, **kw)[0]}
    abstract = flat(model_def.abstract_params())
    logical = flat(model_def.logical_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    specs = families.get(family).param_specs(shape)
    assert sorted(p.path for p in specs) == sorted(abstract) and len(specs) == len(abstract)
    for p in specs:
        assert p.shape == abstract[p.path].shape, p.path
        assert p.names == tuple(logical[p.path]), p.path


def test_gpt_hugging_face_names_cover_every_parameter():
    """Every block and final-norm parameter has an HF name; wte, wpe and head are the exporter's."""
    hf = families.get('gpt').hf
    specs = families.get('gpt').param_specs(shape_of(tied_embeddings=False))
    blocks = {p.path.removeprefix('blocks/') for p in specs if p.is_block}
    assert {ours for ours, _ in hf.block_names} == blocks
    assert {ours for ours, _ in hf.top_names} | {'wte', 'wpe', 'head'} == {p.path for p in specs if not p.is_block}
    assert hf.architecture == 'GPT2LMHeadModel' and hf.layer_prefix.format(layer=3) == 'transformer.h.3.'


def test_gpt_flops_are_megatrons_formula():
    c = config_lib.base_config()
    c.model.update(**SHAPE, remat='full')
    c.mesh.tensor, c.train.global_batch = 2, 6
    model, hw = config_lib.flops_per_step(c)
    kw = dict(global_batch=6, seq_len=24, num_layers=3, d_model=40, vocab_size=config_lib.padded_vocab(c))
    assert model == flops_lib.model_flops_per_step(**kw)
    assert hw == flops_lib.megatron_flops_per_step(**kw, recompute=True)
    layer, head = families.get('gpt').forward_flops(config_lib.model_shape(c))
    assert (layer, head) == (2 * 24 * 12 * 40 * 40 + 4 * 24 * 24 * 40, 2 * 24 * 40 * 256)


def test_llama_hugging_face_names_cover_every_parameter():
    """Every Llama parameter (q/k/v biases and Qwen3's q/k norms included) has its HF names; w_kv and b_kv hold
    k then v. (No HF architecture has both biases and norms: the converter's table is the union.)"""
    hf = families.get('llama').hf
    specs = families.get('llama').param_specs(shape_of(family='llama', num_kv_heads=1, qkv_bias=True, qk_norm=True,
                                                       tied_embeddings=False))
    blocks = {p.path.removeprefix('blocks/') for p in specs if p.is_block}
    assert {ours for ours, _ in hf.block_names} == blocks
    assert [theirs for ours, theirs in hf.block_names if ours == 'attn/w_kv'] == ['self_attn.k_proj.weight',
                                                                                  'self_attn.v_proj.weight']
    assert {ours for ours, _ in hf.top_names} | {'wte', 'head'} == {p.path for p in specs if not p.is_block}
    assert hf.architecture == 'LlamaForCausalLM' and hf.layer_prefix.format(layer=3) == 'model.layers.3.'
