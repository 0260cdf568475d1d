"""The planner's traced residual signatures, kept beside JAX's compilation cache for the next run."""

import os

import pytest

from jaxfrontier.plan import activations


# The Llama family's proxy choice (`Family.proxy_choice`): grouped k/v heads, no QK-norm, heads d / h wide.
GQA = (True, False, False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(activations, '_cache_root', lambda: str(tmp_path))
    activations.signature.cache_clear()
    yield tmp_path
    activations.signature.cache_clear()


def test_a_traced_signature_is_read_back_without_tracing(cache_dir, monkeypatch):
    traced = activations.signature('save_dots', 'bfloat16', False, False, 'xla', 'llama', GQA)
    kept = os.listdir(cache_dir / 'jaxfrontier-residuals')
    assert len(kept) == 1 and kept[0].endswith('.json')
    activations.signature.cache_clear()  # a new process: only the file remains

    def no_trace(*args):
        raise AssertionError('traced again although the signature was on disk')

    monkeypatch.setattr(activations, '_trace', no_trace)
    assert activations.signature('save_dots', 'bfloat16', False, False, 'xla', 'llama', GQA) == traced
    with pytest.raises(AssertionError, match='traced again'):  # another policy is another entry
        activations.signature('full', 'bfloat16', False, False, 'xla', 'llama', GQA)


def test_an_unreadable_entry_is_traced_again_and_replaced(cache_dir):
    traced = activations.signature('none', 'float32')
    (path,) = (cache_dir / 'jaxfrontier-residuals').iterdir()
    path.write_text('{"block": [{"dims": ')  # a truncated file
    activations.signature.cache_clear()
    assert activations.signature('none', 'float32') == traced
    assert activations._load(str(path)) == traced


def test_the_key_follows_the_model_code(cache_dir, monkeypatch):
    args = ('none', 'float32', False, True, 'xla', 'gpt', False)
    before = activations._disk_path(args)
    monkeypatch.setattr(activations, '_code_digest', lambda: 'other model code')
    assert activations._disk_path(args) != before


def test_no_compilation_cache_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(activations, '_cache_root', lambda: None)
    activations.signature.cache_clear()
    assert activations._disk_path(('none', 'float32')) is None
    activations.signature('none', 'float32')
    activations.signature.cache_clear()
