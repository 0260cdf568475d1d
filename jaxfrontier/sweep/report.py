"""Reports of sweeps and scaling studies: a Markdown and a CSV table, and matplotlib PNGs.

Sweep figures (the paper's, for our runs): throughput against each swept parameter (every
trial that ran, and the best per value), and the best layout per model size. Scaling: tokens/s
against devices beside the ideal, and the efficiency against devices. Every PNG records its
axes' labels in a text chunk (`jaxfrontier:axes`), so a test or a script can check a figure
without looking at it.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxfrontier.config import axes as axes_lib  # pylint: disable=wrong-import-position
from jaxfrontier.sweep import trials as sweep_trials  # pylint: disable=wrong-import-position

# (record field, Markdown header, format)
COLUMNS = (
    ('trial_id', 'trial', '{}'), ('status', 'status', '{}'), ('model', 'model', '{}'), ('devices', 'dev', '{}'),
    ('tensor', 'TP', '{}'), ('pipeline', 'PP', '{}'), ('data', 'data', '{}'), ('fsdp', 'fsdp', '{}'),
    ('context', 'CP', '{}'), ('sequence_parallel', 'SP', '{}'), ('zero1', 'ZeRO-1', '{}'), ('micro_batch', 'mb', '{}'), ('accum_steps', 'accum', '{}'),
    ('global_batch', 'GB', '{}'), ('remat', 'remat', '{}'), ('schedule', 'schedule', '{}'),
    ('attention', 'attention', '{}'), ('tokens_per_s', 'tokens/s', '{:,.0f}'),
    ('tokens_per_s_per_device', 'tokens/s/device', '{:,.0f}'), ('tflops_per_device', 'TFLOP/s/device', '{:.4g}'),
    ('mfu', 'MFU', '{:.1%}'), ('hw_tflops_per_device', 'HW TFLOP/s/device', '{:.4g}'),
    ('peak_memory_gib', 'peak GiB/device', '{:.4f}'), ('compile_time_s', 'compile s', '{:.1f}'),
    ('plan_memory_gib', 'plan GiB', '{:.4f}'), ('plan_tokens_per_s', 'plan tokens/s', '{:,.0f}'),
)
LABELS = {
    'tokens_per_s': 'tokens/s', 'tokens_per_s_per_device': 'tokens/s per device',
    'tflops_per_device': 'model TFLOP/s per device (f = 3)', 'mfu': 'MFU (model FLOPs / peak)',
    'hw_tflops_per_device': 'Megatron hardware TFLOP/s per device (the paper\'s counter)',
}


def _fmt(record: dict[str, Any], field: str, fmt: str) -> str:
    value = record.get(field)
    if value is None or value == '' or (isinstance(value, float) and not math.isfinite(value)):
        return '-'
    if isinstance(value, bool):
        return 'yes' if value else 'no'
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def ranked(records: Sequence[dict[str, Any]], objective: str) -> list[dict[str, Any]]:
    """Records that ran, best first, then the others by status."""
    ok = sorted((r for r in records if sweep_trials.objective(r, objective) is not None),
                key=lambda r: -sweep_trials.objective(r, objective))
    rest = [r for r in records if r not in ok]
    return ok + sorted(rest, key=lambda r: sweep_trials.STATUSES.index(r['status']))


def counts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    return {s: n for s in sweep_trials.STATUSES if (n := sum(r['status'] == s for r in records))}


def markdown_table(records: Sequence[dict[str, Any]], objective: str, columns=COLUMNS) -> str:
    """The records as a Markdown table, best first; failures with their reason below."""
    rows = ranked(records, objective)
    lines = ['| ' + ' | '.join(h for _, h, _ in columns) + ' |', '|' + '---|' * len(columns)]
    lines += ['| ' + ' | '.join(_fmt(r, f, fmt) for f, _, fmt in columns) + ' |' for r in rows]
    failed = [r for r in rows if r['status'] != 'ok']
    if failed:
        lines += ['', 'Trials that did not run or failed:', '']
        for r in failed:
            error = (r.get('error') or '').replace('\n', ' / ')
            lines.append(f'- `{r["trial_id"]}` {r["status"]}: {error[:400]}')
    return '\n'.join(lines)


def write_csv(records: Sequence[dict[str, Any]], path: str, objective: str) -> None:
    fields = [f for f, _, _ in COLUMNS] + ['step_time_s', 'step_time_min_s', 'step_time_max_s',
                                           'measured_peak_memory_gib', 'loss', 'wall_s', 'error', 'point']
    with open(path, 'w', newline='', encoding='utf-8') as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction='ignore')
        writer.writeheader()
        for r in ranked(records, objective):
            writer.writerow({**r, 'point': json.dumps(r.get('point', {}))})


def save(fig, path: str) -> str:
    """Saves a figure as PNG with its axes' labels in the `jaxfrontier:axes` text chunk."""
    axes = [{'title': ax.get_title(), 'x': ax.get_xlabel(), 'y': ax.get_ylabel()} for ax in fig.axes]
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={'jaxfrontier:axes': json.dumps(axes)})
    plt.close(fig)
    return path


def plot_parameter(records: Sequence[dict[str, Any]], name: str, values: Sequence[Any], objective: str,
                   path: str) -> str:
    """Throughput against one swept parameter: every trial that ran, and the best per value."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    xs = list(range(len(values)))
    best = []
    for x, value in zip(xs, values):
        ys = [sweep_trials.objective(r, objective) for r in records if r.get('point', {}).get(name) == value]
        ran = [y for y in ys if y is not None]
        ax.scatter([x] * len(ran), ran, color='tab:blue', alpha=0.5, s=18, label='trial' if x == 0 else None)
        best.append(max(ran) if ran else math.nan)
        if len(ys) > len(ran):
            ax.annotate(f'{len(ys) - len(ran)} not run', (x, 0), textcoords='offset points', xytext=(0, 4),
                        ha='center', fontsize=7, color='tab:red', xycoords=('data', 'axes fraction'))
    ax.plot(xs, best, color='tab:orange', marker='o', label='best')
    ax.set_xticks(xs, [str(v) for v in values])
    ax.set(xlabel=name, ylabel=LABELS.get(objective, objective), title=f'{LABELS.get(objective, objective)} vs {name}')
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_best_per_model(records: Sequence[dict[str, Any]], objective: str, path: str) -> str:
    """The best layout of each model: its throughput per device, labelled with the layout."""
    best: dict[str, dict[str, Any]] = {}
    for r in ranked(records, objective):
        if sweep_trials.objective(r, objective) is not None:
            best.setdefault(r['model'], r)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(best) + 2), 3.8))
    models = list(best)
    heights = [best[m]['tflops_per_device'] or 0.0 for m in models]
    bars = ax.bar(range(len(models)), heights, color='tab:green')
    for bar, m in zip(bars, models):
        r = best[m]
        text = f'TP{r["tensor"]} PP{r["pipeline"]} DP{axes_lib.data_parallel(r)}\nmb{r["micro_batch"]} x{r["accum_steps"]}'
        if r.get('mfu') is not None:
            text += f'\nMFU {r["mfu"]:.1%}'
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha='center', va='bottom',
                    fontsize=7, textcoords='offset points', xytext=(0, 2))
    ax.set_xticks(range(len(models)), models)
    ax.set(xlabel='model', ylabel=LABELS['tflops_per_device'],
           title=f'best layout per model (by {LABELS.get(objective, objective)})')
    ax.set_ylim(0, max(heights + [0.0]) * 1.35 or 1.0)
    return save(fig, path)


def write_sweep_report(workdir: str, records: Sequence[dict[str, Any]], space: Sequence[tuple[str, Sequence[Any]]],
                       objective: str, header: str = '') -> dict[str, Any]:
    """`report.md`, `results.csv` and `plots/*.png` of a sweep; returns their paths."""
    plots_dir = os.path.join(workdir, 'plots')
    os.makedirs(plots_dir, exist_ok=True)
    plots = [plot_parameter(records, name, values, objective, os.path.join(plots_dir, f'{objective}_vs_{name}.png'))
             for name, values in space if len(values) > 1]
    if any(sweep_trials.objective(r, objective) is not None for r in records):
        plots.append(plot_best_per_model(records, objective, os.path.join(plots_dir, 'best_per_model.png')))
    csv_path = os.path.join(workdir, 'results.csv')
    write_csv(records, csv_path, objective)
    summary = ', '.join(f'{n} {s}' for s, n in counts(records).items())
    text = [f'# Sweep report: {os.path.basename(os.path.abspath(workdir))}', '', header, '',
            f'{len(records)} trials: {summary}. Ranked by {LABELS.get(objective, objective)}.', '',
            markdown_table(records, objective), '', '## Plots', '']
    text += [f'![{os.path.basename(p)}](plots/{os.path.basename(p)})' for p in plots]
    md_path = os.path.join(workdir, 'report.md')
    with open(md_path, 'w', encoding='utf-8') as f:
        f.write('\n'.join(text) + '\n')
    return {'markdown': md_path, 'csv': csv_path, 'plots': plots}


# --------------------------------------------------------------------------- scaling

SCALING_COLUMNS = (
    ('study', 'study', '{}'), ('devices', 'devices', '{}'), ('tensor', 'TP', '{}'), ('pipeline', 'PP', '{}'),
    ('data', 'data', '{}'), ('fsdp', 'fsdp', '{}'), ('micro_batch', 'mb', '{}'), ('accum_steps', 'accum', '{}'),
    ('global_batch', 'GB', '{}'), ('status', 'status', '{}'), ('tokens_per_s', 'tokens/s', '{:,.0f}'),
    ('tokens_per_s_per_device', 'tokens/s/device', '{:,.0f}'), ('tflops_per_device', 'TFLOP/s/device', '{:.4g}'),
    ('speedup', 'speed-up', '{:.2f}'), ('efficiency', 'efficiency', '{:.1%}'), ('trial_id', 'trial', '{}'),
)


def plot_scaling(rows: Sequence[dict[str, Any]], path: str) -> str:
    """tokens/s against devices (with the ideal from the smallest run) and efficiency against devices."""
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 3.8))
    for study, color in (('weak', 'tab:blue'), ('strong', 'tab:orange')):
        pts = sorted((r['devices'], r['tokens_per_s'], r['efficiency']) for r in rows
                     if r['study'] == study and r.get('efficiency') is not None)
        if not pts:
            continue
        n, t, e = zip(*pts)
        ax_t.plot(n, t, marker='o', color=color, label=f'{study} scaling')
        ax_t.plot(n, [t[0] * k / n[0] for k in n], linestyle='--', color=color, alpha=0.5, label=f'{study} ideal')
        ax_e.plot(n, [100 * x for x in e], marker='o', color=color, label=f'{study} scaling')
    counts = sorted({r['devices'] for r in rows})
    for ax in (ax_t, ax_e):
        ax.set_xlabel('devices')
        ax.set_xscale('log', base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    ax_t.set_ylim(bottom=0)
    ax_t.set(ylabel='tokens/s', title='throughput against devices')
    ax_e.set(ylabel='scaling efficiency (%)', title='efficiency against devices')
    ax_e.axhline(100, color='grey', linewidth=0.8)
    ax_e.set_ylim(bottom=0)
    return save(fig, path)


def write_scaling_report(workdir: str, rows: Sequence[dict[str, Any]], header: str = '') -> dict[str, Any]:
    """`scaling.md`, `scaling.csv` and `scaling.png`; returns their paths."""
    md_path, csv_path, png = (os.path.join(workdir, f'scaling.{ext}') for ext in ('md', 'csv', 'png'))
    lines = ['| ' + ' | '.join(h for _, h, _ in SCALING_COLUMNS) + ' |', '|' + '---|' * len(SCALING_COLUMNS)]
    lines += ['| ' + ' | '.join(_fmt(r, f, fmt) for f, _, fmt in SCALING_COLUMNS) + ' |' for r in rows]
    failed = [f'- `{r["trial_id"]}` {r["study"]} {r["devices"]} devices, {r["status"]}: '
              f'{(r.get("error") or "").replace(chr(10), " / ")[:300]}' for r in rows if r['status'] != 'ok']
    with open(md_path, 'w', encoding='utf-8') as f:
        f.write('\n'.join([f'# Scaling report: {os.path.basename(os.path.abspath(workdir))}', '', header, '',
                           *lines, *([''] + failed if failed else []), '', '![scaling](scaling.png)']) + '\n')
    with open(csv_path, 'w', newline='', encoding='utf-8') as f:
        writer = csv.DictWriter(f, fieldnames=[c for c, _, _ in SCALING_COLUMNS] + ['error'], extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)
    plot_scaling(rows, png)
    return {'markdown': md_path, 'csv': csv_path, 'plots': [png]}
