"""Fuzz: results JSONL files, as calibrate reads them (plan/measured.load) and as a sweep resumes from
its own (sweep/trials.ResultStore)."""

import json
import math
import os
import tempfile

from hypothesis import strategies as st

from fuzzing import fuzz, json_values, mutated_bytes, mutated_dict, snapshot, tiers, user_error_or
from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier.plan import measured
from jaxfrontier.sweep import trials

HW = hw_lib.get('mi250x')


def _trial_config():
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=64, num_heads=2, seq_len=32, vocab_size=256)
    return json.loads(json.dumps(c.to_dict()))


TRIAL = {'trial_id': 't1', 'status': 'ok', 'machine': 'm', 'step_time_median_s': 0.5, 'config': _trial_config()}
PUBLISHED = {'source': 'published', 'name': 'p', 'machine': 'm', 'config_file': 'configs/tiny.py',
             'layout': {'tensor': 2, 'pipeline': 1, 'data': 2, 'fsdp': 2, 'micro_batch': 1, 'accum_steps': 1},
             'step_time_s': 0.25}


def config_mutations():
    return st.sampled_from(['model', 'mesh', 'train']).flatmap(lambda s: mutated_dict(TRIAL['config'][s]).map(
        lambda sub, s=s: TRIAL | {'config': TRIAL['config'] | {s: sub}}))


records = st.one_of(mutated_dict(TRIAL), mutated_dict(PUBLISHED), config_mutations(),
                    mutated_dict(PUBLISHED['layout']).map(lambda lay: PUBLISHED | {'layout': lay}), json_values)
lines = st.one_of(records.map(lambda r: json.dumps(r, allow_nan=True).encode()),
                  mutated_bytes(json.dumps(TRIAL).encode()), st.binary(max_size=40))
files = st.lists(lines, min_size=1, max_size=3).map(lambda ls: b'\n'.join(ls) + b'\n')


def check_calibrate(data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'results.jsonl')
        with open(path, 'wb') as f:
            f.write(data)
        before = snapshot(d)
        out = user_error_or(lambda: measured.load([path], HW, across_models=True))
        assert snapshot(d) == before
        if isinstance(out, list):  # accepted: usable measurements
            assert out and all(math.isfinite(m.measured_s) and m.measured_s > 0 for m in out), out


@tiers(fast=100, slow=600)
def test_calibrate_results(budget):
    fuzz('results.jsonl (calibrate)', files, check_calibrate, budget, deadline_ms=5000,
         examples=[json.dumps(TRIAL | {'step_time_median_s': -1.0}).encode(),
                   json.dumps(TRIAL | {'step_time_median_s': 'fast'}).encode(),
                   json.dumps(TRIAL | {'config': TRIAL['config'] | {'model': []}}).encode(),
                   json.dumps(PUBLISHED | {'layout': []}).encode(), b'[' * 100_000,
                   json.dumps(TRIAL | {'config': TRIAL['config'] | {'model': TRIAL['config']['model'] |
                                                                    {'attention': {}}}}).encode()])


def check_sweep(data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'results.jsonl')
        with open(path, 'wb') as f:
            f.write(data)
        store = user_error_or(lambda: trials.ResultStore(path))
        if isinstance(store, trials.ResultStore):
            for tid in list(store.records) + ['t1', 'other']:
                for retry in (False, True):
                    record = store.finished(tid, retry)
                    assert record is None or (isinstance(record, dict) and isinstance(record.get('status'), str))


@tiers(fast=100)
def test_sweep_results(budget):
    fuzz('results.jsonl (sweep resume)', files, check_sweep, budget,
         examples=[b'[1]\n', b'{"trial_id": [1]}\n', b'{"trial_id": "t1"}\n', b'\xff\xfe\n', b'[' * 100_000])
