"""The fuzz suite (tests/fuzzing.py): prints the inputs tried per reader at the end of a run."""

from fuzzing import COUNTS


def pytest_terminal_summary(terminalreporter):
    if COUNTS:
        terminalreporter.write_sep('-', 'fuzz: inputs tried per reader')
        for reader, n in sorted(COUNTS.items()):
            terminalreporter.write_line(f'{reader:<40s} {n:>7,d}')
