"""The package layout holds: imports only go down the layers, no cycles, small modules.

Read from the code's own imports (every `import` / `from ... import`, including those inside
functions), so an import hidden in a function counts. The layers are docs/architecture.md's.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / 'jaxfrontier'
MAX_LINES = 500

# Bottom to top. A module may import its own layer or lower ones (and no cycle: test below).
LAYERS = (
    ('errors', 'flops'),  # flops: the FLOP convention, arithmetic that imports nothing
    ('families',),  # the model families' declarations (fields, shape, tables, HF converter): no JAX, ever
    ('config', 'hardware', 'cli', 'logs', 'files'),  # no JAX at import: read before JAX starts
    ('mesh', 'distributed', 'layout'),
    ('model', 'data'),
    ('checkpoint',),  # Orbax manager, restore, integrity, readers, safetensors, Hugging Face: no training
    ('pipeline',),
    ('training',),  # the step math: state, optimizer, step, loss scaling, reduction, evaluation
    ('inference',),  # sample, eval: runs what training wrote, through checkpoint/
    ('plan',),
    ('run',),  # the training run: the loop, run control (lock, preemption, watchdog), observation (metrics, ...)
    ('sweep',),
    ('main', 'scaling', 'prepare', 'calibrate'),  # entry points
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob('*.py'))}


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The jaxfrontier modules `path` imports (resolving `from pkg import module`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith('jaxfrontier')}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('jaxfrontier'):
            for a in node.names:
                sub = f'{node.module}.{a.name}'
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known}


def unit_of(module: str) -> str:
    """The layer unit of a module: its package under jaxfrontier (or the top-level module)."""
    return module.split('.')[1] if module != 'jaxfrontier' else ''


GRAPH = {m: imports_of(p, set(modules())) - {m} for m, p in modules().items()}


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in GRAPH if m != 'jaxfrontier'}
    assert units <= set(LAYER_OF), f'put {sorted(units - set(LAYER_OF))} in a layer (here and docs/architecture.md)'


@pytest.mark.parametrize('module', sorted(m for m in GRAPH if m != 'jaxfrontier'))
def test_imports_only_go_down(module):
    own = LAYER_OF[unit_of(module)]
    for target in GRAPH[module]:
        if target == 'jaxfrontier':
            continue
        other = LAYER_OF[unit_of(target)]
        assert other <= own, f'{module} (layer {own}) imports {target} (layer {other}): only its own layer or lower'



def reachable(module: str) -> set[str]:
    """Every jaxfrontier module `module` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for n in GRAPH[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


@pytest.mark.parametrize('module', sorted(m for m in GRAPH if m.startswith('jaxfrontier.inference')))
def test_inference_needs_no_training(module):
    """Sampling and evaluation read checkpoints through checkpoint/, never the trainer."""
    training = sorted(m for m in reachable(module) if m.startswith('jaxfrontier.training'))
    assert not training, f'{module} imports {training} (transitively): read checkpoints through jaxfrontier.checkpoint'


# What the planner must never pull in: the training loop and a run's workdir, signal and Ctrl-C handling.
RUN_CONTROL = ('jaxfrontier.run.loop', 'jaxfrontier.run.control.workdir_lock', 'jaxfrontier.run.control.preemption',
               'jaxfrontier.run.control.interrupt')


@pytest.mark.parametrize('module', sorted(m for m in GRAPH if m.startswith('jaxfrontier.plan')))
def test_plan_needs_no_training_loop(module):
    found = sorted(reachable(module) & set(RUN_CONTROL))
    assert not found, f'{module} imports {found} (transitively): the planner needs the step, not the loop'


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m, stack):
        state[m] = 1
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail('import cycle: ' + ' -> '.join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize('module', sorted(GRAPH))
def test_modules_stay_small(module):
    lines = len(modules()[module].read_text().splitlines())
    assert lines <= MAX_LINES, f'{module} has {lines} lines; split it by concern (STYLE.md 13)'


def test_no_prefix_named_modules_at_the_top():
    """Parts with several modules are packages, not `plan_*` / `sweep_*` / `pipeline_*` prefixes."""
    top = [p.stem for p in ROOT.glob('*.py')]
    assert not [s for s in top if s.startswith(('plan_', 'sweep_', 'pipeline_', 'train_'))]


@pytest.mark.parametrize('module', sorted(m for m in GRAPH if m.startswith('jaxfrontier.families')))
def test_family_declarations_import_no_jax(module):
    """The declarations are read before JAX starts (the config's defaults, checks and HF directory checks):
    no jax or flax import anywhere in them, not even inside a function."""
    found = set()
    for node in ast.walk(ast.parse(modules()[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split('.')[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split('.')[0])
    assert not found & {'jax', 'jaxlib', 'flax', 'optax', 'orbax'}, f'{module} imports {sorted(found)}'
