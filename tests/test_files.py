"""files.write_atomic: a reader sees the old file or the whole new one, and no temporary file stays."""

import os

import pytest

from jaxfrontier import files


@pytest.mark.parametrize('durable', [False, True])
@pytest.mark.parametrize('data', ['{"step": 3}\n', b'\x00\x01manifest'])
def test_write_atomic_replaces_the_whole_file_and_leaves_no_temporary(tmp_path, data, durable):
    path = tmp_path / 'record'
    path.write_text('old')
    files.write_atomic(str(path), data, durable=durable)
    assert (path.read_bytes() if isinstance(data, bytes) else path.read_text(encoding='utf-8')) == data
    assert os.listdir(tmp_path) == ['record']


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / 'record'
    path.write_text('old')

    def no_space(*_):
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(os, 'replace', no_space)  # the data written, the rename refused
    with pytest.raises(OSError):
        files.write_atomic(str(path), 'new', durable=True)
    assert path.read_text() == 'old' and os.listdir(tmp_path) == ['record']


def test_chunks_are_written_as_they_come_and_a_failing_source_leaves_the_old_file(tmp_path):
    path = tmp_path / 'model.safetensors'
    files.write_atomic(str(path), (bytes([i]) * 3 for i in range(4)))
    assert path.read_bytes() == b'\x00\x00\x00\x01\x01\x01\x02\x02\x02\x03\x03\x03'

    def chunks():
        yield b'new header'
        raise ValueError('a tensor is not finite')  # the export stops half-way

    with pytest.raises(ValueError):
        files.write_atomic(str(path), chunks())
    assert path.read_bytes() == b'\x00\x00\x00\x01\x01\x01\x02\x02\x02\x03\x03\x03'
    assert os.listdir(tmp_path) == ['model.safetensors']
