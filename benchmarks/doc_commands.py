"""The shell commands of the user docs, extracted, classified and (the CPU ones) run as written (issue 39).

  python benchmarks/doc_commands.py                       # the table: doc:line, class, reason, command
  python benchmarks/doc_commands.py --run=DIR --doc=docs/inference.md --grep=llama-1b   # run them in DIR

A command is a line of a fenced block of README.md or docs/{models,data,your_run,training,inference,
checkpoints,long_context,preflight,planner,sweeps,frontier}.md that starts a program (python, pip,
sbatch, ...), its `\\` continuations joined and its trailing `# comment` cut; nothing else is
rewritten. Each gets one class (`classify`, an ordered table with the reason of each row):

  cpu      runs here as written, on the two-core CPU (simulated devices where its mesh needs them);
           commands of one doc run in order in one directory, so a later one finds the files an
           earlier one made (data/, workdirs/, exports/); the files a doc assumes the user has
           (models/llama-1b, mydata/*.jsonl) are made by the caller (tests/test_doc_commands.py)
  long     runs on the CPU as written but takes longer than the test budget (thousands of steps,
           a shrunk 175B checked against one device): the reason says how long
  gpu      as written it needs GPUs (a model or a mesh no CPU runs in useful time)
  cluster  needs Slurm or Frontier (sbatch, srun, module paths)
  network  downloads (lm-evaluation-harness datasets, pip)
  elided   `...` or a <placeholder>: a pattern the prose completes, not a command
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DOCS = ('README.md',) + tuple(f'docs/{name}.md' for name in (
    'models', 'data', 'your_run', 'training', 'inference', 'checkpoints', 'long_context', 'preflight', 'planner',
    'sweeps', 'frontier', 'post_training'))
PROGRAMS = ('python ', 'python3 ', 'pip ', 'sbatch ', 'srun ', 'salloc ', 'export ', 'cd ')
KINDS = ('cpu', 'long', 'gpu', 'cluster', 'network', 'elided')

# (pattern searched in the command, class, reason): the first row that matches classifies it.
RULES = (
    (r'^(sbatch|srun|salloc) ', 'cluster', 'a Slurm allocation'),
    (r'^(export|cd) ', 'cluster', "Frontier's shell setup (its module and lustre paths)"),
    (r'^pip |venv', 'network', 'installs packages (the tests run in an installed environment)'),
    (r'\.\.\.|<[a-z ]+>|\[--', 'elided', 'elided arguments or a placeholder: the prose completes it'),
    (r'--mode=lm_eval', 'network', "lm-evaluation-harness downloads its tasks' datasets"),
    (r'--mode=verify|jaxfrontier\.sweep .*--verify', 'long', 'a shrunk layout against one device: minutes on 2 cores'),
    (r'--plan_check=compile|plan_check\.py|benchmarks/calibrate\.py', 'long', 'compiles paper-size copies: minutes'),
    (r'--mode=plan', 'cpu', 'a plan needs no devices'),
    (r'configs/(gpt\.py:size=(125m|1\.3b)|175b\.py|1t\.py|22b\.py)', 'gpu', 'a 125M-1T model trained for '
     'thousands of steps'),
    (r'configs/llama\.py:size=(?!tiny)', 'gpu', 'an 8B-405B Llama'),
    (r'jaxfrontier\.(sweep|scaling)', 'long', 'trains every trial of a space: minutes to hours on 2 cores'),
    (r'calibrate --results=(workdirs|/tmp)', 'long', "needs a sweep's results (the sweep above: long)"),
    (r'hf\.py:path=models/\S+,seq_len=2048', 'long', '2,000 steps of 8 x 2,048 tokens: hours on 2 cores (the '
     'CPU-sized line beside it runs)'),
    (r'--config=configs/hf.py:path=models/gpt2', 'long', 'GPT-2 124M: its training, hours on 2 cores'),
    (r'configs/(tiny\.py|llama\.py:size=tiny)(?!.*--mode=)(?!.*train\.steps=\d{1,2}\b)', 'long',
     "a tiny model's default 300 steps: minutes on 2 cores"),
    (r'mydata|corpus/|chats/|a\.parquet|data/(mine|mycorpus|web|chats|heldout)|workdirs/|/runs/|/scratch/|/tmp/run|'
     r'exports/|prompts\.txt|space\.json|hw\.json', 'long',
     "needs the files of an earlier command that is itself long (a trained run, the user's corpus)"),
    (r'', 'cpu', 'runs here'),
)
# Commands of the Llama journey (docs/inference.md) that need files an earlier 'cpu' command made,
# so the table classifies them 'cpu' although the rule above would say 'long'.
CPU_JOURNEY = re.compile(r'models/llama-1b|exports/llama-ft')


@dataclasses.dataclass(frozen=True)
class Command:
    doc: str  # relative to the repository
    line: int  # where the command starts (1-based)
    text: str  # as written: continuations joined, the trailing comment cut
    kind: str
    reason: str


def _commands_of(doc: str, text: str) -> list[tuple[int, str]]:
    found, in_block, pending, start = [], False, '', 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith('```'):
            in_block, pending = not in_block, ''
            continue
        if not in_block:
            continue
        stripped = line.strip()
        if not pending and not stripped.startswith(PROGRAMS):
            continue
        if not pending:
            start = number
        body = _cut_comment(stripped)
        if body.endswith('\\'):
            pending += body[:-1].rstrip() + ' '
            continue
        found.append((start, (pending + body).strip()))
        pending = ''
    return found


def _cut_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a # inside quotes stays)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in '"\'':
            quote = ch
        elif ch == '#' and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def classify(doc: str, text: str) -> tuple[str, str]:
    if doc == 'docs/inference.md' and CPU_JOURNEY.search(text) and 'seq_len=2048' not in text:
        return 'cpu', 'the Llama journey on a tiny random Llama (models/llama-1b made by the test)'
    for pattern, kind, reason in RULES:
        if re.search(pattern, text):
            return kind, reason
    raise AssertionError('the last rule matches everything')


def extract(root: str = REPO) -> list[Command]:
    out = []
    for doc in USER_DOCS:
        with open(os.path.join(root, doc), encoding='utf-8') as f:
            for line, text in _commands_of(doc, f.read()):
                out.append(Command(doc, line, text, *classify(doc, text)))
    return out


def prepare_dir(workdir: str) -> None:
    """The repository's configs/, launch/ and benchmarks/ as a user's checkout has them, beside the run's files."""
    for name in ('configs', 'launch', 'benchmarks'):
        link = os.path.join(workdir, name)
        if not os.path.exists(link):
            os.symlink(os.path.join(REPO, name), link)


def run(command: Command, workdir: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """One command as written, by bash in `workdir` (this interpreter first on PATH, the repository importable)."""
    env = dict(os.environ)
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env.get('PATH', '')
    env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
    env.pop('XLA_FLAGS', None)  # the command's own mesh.cpu_devices decides, as for a user
    return subprocess.run(['bash', '-c', command.text], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def table(commands: list[Command]) -> str:
    rows = [f'{c.doc}:{c.line}  {c.kind:8}  {c.reason}\n    {c.text}' for c in commands]
    counts = ', '.join(f'{k} {sum(c.kind == k for c in commands)}' for k in KINDS)
    return '\n'.join(rows + [f'{len(commands)} commands: {counts}'])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--run', default='', help="run the 'cpu' commands in this directory, in doc order")
    parser.add_argument('--doc', default='', help='only this doc')
    parser.add_argument('--grep', default='', help='only commands containing this')
    args = parser.parse_args()
    commands = [c for c in extract() if (not args.doc or c.doc == args.doc) and args.grep in c.text]
    print(table(commands))
    if not args.run:
        return 0
    os.makedirs(args.run, exist_ok=True)
    prepare_dir(args.run)
    failed = 0
    for c in (c for c in commands if c.kind == 'cpu'):
        proc = run(c, args.run)
        failed += proc.returncode != 0
        print(f'{c.doc}:{c.line}  exit {proc.returncode}  {shlex.split(c.text)[:3]}', flush=True)
        if proc.returncode:
            print(proc.stderr[-3000:])
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
