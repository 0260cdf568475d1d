"""`python -m jaxfrontier.prepare` throughput against `tokenizers`' own encode_batch, and its peak memory.

  PYTHONPATH=$PWD python benchmarks/prepare.py [--mb=2] [--workers=1,2] [--dir=/tmp/jf_prepare_bench]

Corpus: the running Python's stdlib sources (`*.py`, sorted), cut into JSONL documents of at
most 16 KiB (so both corpora have the same document sizes: peak memory follows the largest
document and the batch), repeated until it holds `--mb` MB; a second corpus 10x larger. Tokenizer: a byte-level BPE of
32,768 tokens trained once on the first 4 MB (setup, not timed). Both sides use every core
of this machine:

  baseline   in a child process, on each corpus right before prepare runs on it: all documents
             in a list, then one `Tokenizer.encode_batch(docs)` (the library's own thread pool;
             the read and JSON parse not timed); `encode_batch_fast` (no offsets) too.
  prepare    `python -m jaxfrontier.prepare --input=corpus.jsonl --tokenizer=... --workers=W` as a
             child process: `phase` is the streaming encode it reports (read, encode, write,
             fsync), `wall` the whole command (interpreter start and imports included).
  memory     the child's peak RSS: `ru_maxrss` from os.wait4 (the largest single process), and
             the largest sum over the process tree, sampled every 20 ms with psutil (workers > 1).

Writes benchmarks/results/prepare.json and prints a table.
"""

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time

try:
    import psutil
except ImportError:  # only the sampled tree RSS needs it
    psutil = None

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB = 32768
DOC_CHARS = 16384  # sources are cut into documents of at most this size


def write_corpus(path: str, target_bytes: int) -> int:
    """Stdlib sources as JSONL documents, repeated until target_bytes; returns the bytes written."""
    stdlib = sysconfig.get_paths()['stdlib']
    sources = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ('site-packages', 'dist-packages', 'test', 'tests'))
        for name in sorted(files):
            if name.endswith('.py'):
                with open(os.path.join(root, name), encoding='utf-8', errors='replace') as f:
                    text = f.read()
                for start in range(0, len(text), DOC_CHARS):  # web-page-sized documents
                    sources.append(json.dumps({'text': text[start:start + DOC_CHARS]}) + '\n')
    written = 0
    with open(path, 'w', encoding='utf-8') as f:
        while written < target_bytes:
            for line in sources:
                f.write(line)
                written += len(line.encode())
                if written >= target_bytes:
                    break
    return written


def read_documents(path: str) -> list[str]:
    with open(path, encoding='utf-8') as f:
        return [json.loads(line)['text'] for line in f]


def baseline(tokenizer_file: str, corpus_path: str) -> dict:
    """tokenizers' encode_batch (and encode_batch_fast) over the whole corpus in one call, all cores."""
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    tokenizer = Tokenizer.from_file(tokenizer_file)
    docs = read_documents(corpus_path)
    size_mb, result = os.path.getsize(corpus_path) / 1e6, {}
    for method in ('encode_batch', 'encode_batch_fast'):
        encode = getattr(tokenizer, method)
        encode(docs[:64])  # warm up the thread pool
        start = time.perf_counter()
        encodings = encode(docs)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(e.ids) for e in encodings)
        del encodings
        result[method] = {'seconds': seconds, 'tokens': num_tokens, 'MB_per_s': size_mb / seconds,
                          'M_tokens_per_s': num_tokens / 1e6 / seconds}
    return result


def _child_json(args: list[str]) -> dict:
    """Runs this script in a child (so this process stays small: ru_maxrss survives fork + exec)."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                          env={**os.environ, 'PYTHONPATH': REPO}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sample_tree_rss(pid: int, peak: list, stop: threading.Event) -> None:
    while psutil is not None and not stop.is_set():
        try:
            parent = psutil.Process(pid)
            procs = [parent] + parent.children(recursive=True)
            peak[0] = max(peak[0], sum(p.memory_info().rss for p in procs))
        except psutil.Error:
            pass
        time.sleep(0.02)


def run_prepare(corpus_path: str, tokenizer_file: str, out: str, workers: int) -> dict:
    """One prepare child: phase and wall throughput, peak RSS (wait4) and peak tree RSS (sampled)."""
    args = [sys.executable, '-m', 'jaxfrontier.prepare', f'--input={corpus_path}', f'--output={out}',
            f'--tokenizer={tokenizer_file}', f'--workers={workers}', '--noprogress']
    start = time.perf_counter()
    child = subprocess.Popen(args, cwd=REPO, env={**os.environ, 'PYTHONPATH': REPO}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    peak, stop = [0], threading.Event()
    sampler = threading.Thread(target=_sample_tree_rss, args=(child.pid, peak, stop), daemon=True)
    sampler.start()
    _, status, rusage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    stdout, stderr = child.stdout.read(), child.stderr.read()
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4
    if child.returncode:
        raise SystemExit(f'prepare failed: {stderr}')
    header = json.load(open(out + '.json'))
    size = os.path.getsize(corpus_path)
    phase_mb_s = float(stdout.split('; ')[1].split(' MB/s')[0])
    return {'workers': workers, 'input_MB': size / 1e6, 'tokens': header['num_tokens'],
            'phase_MB_per_s': phase_mb_s, 'wall_s': wall, 'wall_MB_per_s': size / 1e6 / wall,
            'peak_rss_MB': rusage.ru_maxrss / 1024, 'peak_tree_rss_MB': peak[0] / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--mb', type=float, default=2.0, help='size of the small corpus (the large is 10x)')
    parser.add_argument('--workers', default='1,2', help='comma-separated --workers values to measure')
    parser.add_argument('--dir', default='/tmp/jf_prepare_bench')
    parser.add_argument('--baseline_child', nargs=2, help=argparse.SUPPRESS)  # TOKENIZER CORPUS
    a = parser.parse_args()
    if a.baseline_child:
        print(json.dumps(baseline(*a.baseline_child)))
        return
    os.makedirs(a.dir, exist_ok=True)
    small, large = os.path.join(a.dir, 'small.jsonl'), os.path.join(a.dir, 'large.jsonl')
    write_corpus(small, int(a.mb * 1e6))
    write_corpus(large, int(10 * a.mb * 1e6))
    seed = os.path.join(a.dir, 'seed.jsonl')  # the tokenizer's training text: the first 4 MB
    write_corpus(seed, 4_000_000)
    subprocess.run([sys.executable, '-m', 'jaxfrontier.prepare', f'--input={seed}', f'--output={a.dir}/seed',
                    f'--train_tokenizer={VOCAB}', '--noprogress'], cwd=REPO, env={**os.environ, 'PYTHONPATH': REPO},
                   check=True, capture_output=True)
    tokenizer_file = os.path.join(a.dir, 'seed.tokenizer.json')

    baselines, rows = {}, []
    for name, path in (('small', small), ('large', large)):  # the baseline right before, on the same text
        baselines[name] = _child_json(['--baseline_child', tokenizer_file, path])
        base = baselines[name]['encode_batch']
        for workers in (int(w) for w in a.workers.split(',')):
            row = run_prepare(path, tokenizer_file, os.path.join(a.dir, f'out_{name}_{workers}'), workers)
            row.update(corpus=name, vs_encode_batch_phase=row['phase_MB_per_s'] / base['MB_per_s'],
                       vs_encode_batch_wall=row['wall_MB_per_s'] / base['MB_per_s'],
                       vs_encode_batch_fast_phase=row['phase_MB_per_s'] / baselines[name]['encode_batch_fast']['MB_per_s'])
            rows.append(row)
            print(json.dumps(row), flush=True)

    def growth(workers, key):
        by_corpus = {r['corpus']: r[key] for r in rows if r['workers'] == workers}
        return by_corpus['large'] / by_corpus['small'] - 1

    memory_growth = {f'workers={w} {key}': growth(w, key) for w in sorted({r['workers'] for r in rows})
                     for key in ('peak_rss_MB', 'peak_tree_rss_MB')}
    result = {'benchmark': 'prepare', 'cpus': os.cpu_count(), 'vocab': VOCAB, 'baseline': baselines,
              'runs': rows, 'large_vs_small_peak_memory_growth': memory_growth,
              'command': 'PYTHONPATH=$PWD python benchmarks/prepare.py ' + ' '.join(sys.argv[1:])}
    os.makedirs(os.path.join(REPO, 'benchmarks', 'results'), exist_ok=True)
    with open(os.path.join(REPO, 'benchmarks', 'results', 'prepare.json'), 'w') as f:
        json.dump(result, f, indent=1)
    for name, by_method in baselines.items():
        for method, b in by_method.items():
            print(f'{name} corpus, {method} baseline: {b["MB_per_s"]:.2f} MB/s, {b["M_tokens_per_s"]:.2f} M tokens/s '
                  f'({os.cpu_count()} cpus)')
    print(f'{"corpus":>6} {"workers":>7} {"MB":>6} {"phase MB/s":>10} {"vs base":>7} {"wall MB/s":>9} '
          f'{"vs base":>7} {"rss MB":>7} {"tree MB":>7}')
    for r in rows:
        print(f'{r["corpus"]:>6} {r["workers"]:>7} {r["input_MB"]:6.1f} {r["phase_MB_per_s"]:10.2f} '
              f'{r["vs_encode_batch_phase"]:7.0%} {r["wall_MB_per_s"]:9.2f} {r["vs_encode_batch_wall"]:7.0%} '
              f'{r["peak_rss_MB"]:7.0f} {r["peak_tree_rss_MB"]:7.0f}')
    print('peak memory, large vs small:', {k: f'{g:+.0%}' for k, g in memory_growth.items()})


if __name__ == '__main__':
    main()
