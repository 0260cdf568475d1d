"""Command-line mistakes a user meets before training: one line, exit 2 (issue 12, items 9, 11, 12).

A config file with a syntax error, without get_config() or raising inside it names the file,
the line and the problem; a JAX platform that is not present names the one asked for and those
present; every entry point prints its --help without other flags.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxfrontier import errors
import processes


def run(*args, env=None, module='jaxfrontier.main'):
    return processes.run_main(*args, tiny=False, module=module, env=env, timeout=300)


@pytest.mark.parametrize('source, expected', [
    ('def get_config(:\n    pass\n', ['line 1: SyntaxError: invalid syntax']),
    ('x = 1\n', ['defines no get_config() function']),
    ('import ml_collections\n\n\ndef get_config(arg=None):\n    c = ml_collections.ConfigDict()\n'
     '    return c.modle\n', ["line 6: AttributeError: \"'modle'\"", 'the line reads: return c.modle']),
    ('raise ValueError("boom")\n', ['line 1: ValueError: boom']),
])
def test_broken_config_file(tmp_path, source, expected):
    path = tmp_path / 'broken.py'
    path.write_text(source)
    line = processes.error_line(run(f'--config={path}', '--mode=plan', f'--workdir={tmp_path / "wd"}'))
    assert line.startswith(f'error: {path}'), line
    assert 'the config has no field' not in line, line
    for text in expected:
        assert text in line, (text, line)


def test_platform_not_present(tmp_path):
    env = processes.subprocess_env(JAX_PLATFORMS='cuda', CUDA_VISIBLE_DEVICES='')
    line = processes.error_line(run('--config.train.steps=1', f'--workdir={tmp_path / "wd"}', env=env))
    assert 'JAX_PLATFORMS=cuda' in line and 'installed JAX backends: cpu' in line, line
    assert 'GPUs visible on this host' in line, line


@pytest.mark.parametrize('module, flag', [('jaxfrontier.main', '--workdir'), ('jaxfrontier.sweep', '--space'),
                                          ('jaxfrontier.scaling', '--device_counts')])
def test_help_without_other_flags(module, flag):
    proc = run('--help', module=module)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert flag in proc.stdout + proc.stderr and 'error:' not in proc.stderr, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize('module', ['jaxfrontier.main', 'jaxfrontier.sweep', 'jaxfrontier.calibrate',
                                    'jaxfrontier.prepare'])
def test_help_into_a_closed_pipe_is_quiet(module):
    """`--help | head -1`: the reader is gone before the help is written; no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, deterministically
    try:
        proc = subprocess.run([sys.executable, '-m', module, '--help'], cwd=processes.REPO,
                              env=processes.subprocess_env(), stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode in (0, 1), (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr == '', proc.stderr[-3000:]


def test_ctrl_c_outside_the_training_loop_is_one_line():
    """Ctrl-C before the loop's own handler (flags, imports, preflight): one line and 130, no traceback."""
    # A shell's background job starts with SIGINT ignored (and Python then keeps it ignored): install the
    # handler a terminal's Python has, so that the test means the same from any shell.
    script = ('import os, signal\n'
              'signal.signal(signal.SIGINT, signal.default_int_handler)\n'
              'from jaxfrontier import cli\n'
              'def main(argv):\n'
              '    os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt here\n'
              '    return 0\n'
              'cli.run_app(main)\n')
    proc = subprocess.run([sys.executable, '-c', script], cwd=processes.REPO, env=processes.subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
    assert 'Traceback' not in proc.stderr and proc.stderr.strip().startswith('interrupted (Ctrl-C)'), proc.stderr


@pytest.mark.parametrize('override, field', [('--config.mesh.cpu_devices=-3', 'mesh.cpu_devices'),
                                             ('--config.optim.lr=inf', 'optim.lr'),
                                             ('--config.optim.lr=nan', 'optim.lr'),
                                             ('--config.optim.name=sgd', 'optim.name')])
def test_values_that_must_fail_validation(tmp_path, override, field):
    line = processes.error_line(run(override, '--config.train.steps=1', f'--workdir={tmp_path / "wd"}'))
    assert f'config.{field} = ' in line and 'Fix:' in line, line


def test_an_unwritable_corpus_cache_is_one_line_before_anything_is_written(tmp_path):
    (tmp_path / 'file').write_text('')
    proc = run(f'--config.data.cache_dir={tmp_path / "file" / "cache"}', f'--workdir={tmp_path / "wd"}')
    line = processes.error_line(proc)
    assert 'config.data.cache_dir = ' in line and 'Not a directory' in line and 'Fix:' in line, line
    assert not (tmp_path / 'wd').exists()


@pytest.mark.slow  # a training subprocess: ~15 s
def test_an_unwritable_user_cache_puts_the_corpus_in_the_workdir(tmp_path):
    """data.cache_dir=auto where the home cannot be written (read-only on some centres' compute nodes): the
    corpus goes to <workdir>/data_cache, as before the user cache existed, and the run trains."""
    (tmp_path / 'file').write_text('')
    env = processes.subprocess_env(XDG_CACHE_HOME=str(tmp_path / 'file'))
    proc = processes.run_main('--config.train.steps=1', '--config.checkpoint.enabled=False',
                              f'--workdir={tmp_path / "wd"}', env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / 'wd' / 'data_cache').glob('stdlib-*.bin')), os.listdir(tmp_path / 'wd')


def test_an_abandoned_thread_error_is_the_last_line_on_stderr():
    """A full disk under Orbax's writer threads (`abandon_threads`): threads that keep printing
    tracebacks, from Python and straight to descriptor 2, neither split nor follow the one line."""
    script = r'''
import os, sys, threading, time
from jaxfrontier import cli
from jaxfrontier.errors import DiskFullError

def noise():
    while True:
        print('Traceback (most recent call last):\nRuntimeError: Event loop is closed', file=sys.stderr)
        os.write(2, b'E0000 tensorstore noise\n')

for _ in range(3):
    threading.Thread(target=noise, daemon=True).start()
time.sleep(0.05)
cli.exit_code(DiskFullError('no space left on the device holding /x (0.0 MiB free of 4.0 MiB)'))
'''
    proc = subprocess.run([sys.executable, '-c', script], cwd=processes.REPO, env=processes.subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.splitlines()[-1]
    assert last == 'error: no space left on the device holding /x (0.0 MiB free of 4.0 MiB)', proc.stderr[-2000:]


def test_the_errors_table_gives_every_class_its_exit_code():
    """errors.py's docstring table has a row per error class, with the exit code the class carries."""
    classes = {name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, Exception)}
    rows = {m.group(1): int(m.group(2))
            for m in re.finditer(r'^\| (\w+Error) +\|[^|]*\| +(\d+) \|', errors.__doc__, re.M)}
    assert set(classes) <= set(rows), f'add rows for {sorted(set(classes) - set(rows))} to errors.py\'s table'
    assert {name: cls.exit_code for name, cls in classes.items()} == {name: rows[name] for name in classes}


def test_error_classes_with_an_exit_code_live_in_errors_py():
    """No module but errors.py defines a UserError kind or a class with its own `exit_code`."""
    allowed = set()
    names = {name for name, cls in vars(errors).items() if isinstance(cls, type)}
    root = pathlib.Path(errors.__file__).parent
    found = set()
    for path in sorted(root.rglob('*.py')):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or path.name == 'errors.py':
                continue
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, 'id', '') for b in node.bases}
            sets_exit_code = any(isinstance(s, ast.Assign) and any(getattr(t, 'id', '') == 'exit_code' for t in s.targets)
                                 for s in node.body)
            if bases & names or sets_exit_code:
                found.add((path.relative_to(root).as_posix(), node.name))
    assert found <= allowed, f'move {sorted(found - allowed)} into jaxfrontier/errors.py'
