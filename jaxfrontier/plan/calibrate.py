"""Fitting the planner's time model to measured step times (`python -m jaxfrontier.calibrate`).

The time model (planner.timing) has free parameters, all fields of `hardware.Hardware`:
GEMM efficiency (`matmul_efficiency`, and `gemm_half_flops`: how it falls for small
matmuls), memory bandwidth, `stash_passes` (what keeping residuals for the backward costs
beyond their traffic, when the trials run more than one remat policy), bandwidth and latency
per link level, `overlap`, fixed costs per step and per layer, and `bubble_scale`.
Simulated CPU devices sharing the host's cores is a fact of the description
(`shared_host_devices`), not fitted.

  1. Candidates: every parameter the measurements exercise (a link level no trial crosses
     has nothing to fit).
  2. Identifiability: the Jacobian of the log step times at the prior, one column per
     candidate, taken in the candidates' order of priority (GEMM efficiency, bandwidths,
     overlap, bubble, fixed costs, GEMM shape, latencies) through Gram-Schmidt: a column whose
     effect is ~zero (below 0.1 % RMS per unit), or whose part not explained by the columns
     already kept is under 10 % of it (collinear), stays at its prior; at most half as many
     parameters as measurements are fitted. The report says which stayed at its prior and why.
  3. Fit: robust least squares on the log of predicted / measured step time
     (`scipy.optimize.least_squares`, soft-L1 loss, scale 0.05: a trial more than ~5 % off
     counts linearly, so one noisy trial does not drag the rest), plus a weak pull of each
     parameter to its prior (PRIOR_WEIGHT), so what the data barely determine stays near it.
  4. Held out: leave-one-out, the whole procedure (1-3) rerun without each measurement and
     the left-out one predicted. The rank correlation (Spearman) of predicted and measured
     throughput is given for the held-out, fitted and uncalibrated predictions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from jaxfrontier import errors
from jaxfrontier import hardware as hw_lib
from jaxfrontier.plan import estimate
from jaxfrontier.plan import measured as measured_lib
from jaxfrontier.plan import planner

ZERO_EFFECT = 1e-3  # RMS change of log step time per unit of a parameter below which it has no effect
COLLINEAR = 0.1  # share of a column not explained by the kept ones below which it is collinear
LOSS, LOSS_SCALE = 'soft_l1', 0.05
PRIOR_WEIGHT = 0.02  # a pseudo-residual per parameter pulls it to its prior: one e-fold costs a 2 % misfit
INTERIOR = 0.01  # fits start this far inside a bound (an overhead of 1 % of the median step, overlap 0.99)
LOG_BOUND = 5.0  # multiplicative parameters move at most e^5 from their prior


@dataclasses.dataclass(frozen=True)
class Param:
    """One free parameter: how an unconstrained value x maps onto the hardware description."""

    name: str
    kind: str  # 'log': prior x e^x; 'linear': x * scale; 'share': x in [0, 1]
    scale: float = 1.0

    def x0(self, prior: hw_lib.Hardware, start: hw_lib.Hardware | None = None) -> float:
        value = get_value(start or prior, self.name)
        return math.log(value / get_value(prior, self.name)) if self.kind == 'log' else value / self.scale

    def bounds(self) -> tuple[float, float]:
        return {'log': (-LOG_BOUND, LOG_BOUND), 'linear': (0.0, np.inf), 'share': (0.0, 1.0)}[self.kind]

    def value(self, prior: hw_lib.Hardware, x: float) -> float:
        return get_value(prior, self.name) * math.exp(x) if self.kind == 'log' else x * self.scale


def get_value(hw: hw_lib.Hardware, name: str) -> float:
    field, _, level = name.partition('.')
    value = getattr(hw, field)
    return float(value[level] if level else value)


def with_values(hw: hw_lib.Hardware, values: dict[str, float]) -> hw_lib.Hardware:
    """`hw` with parameters replaced (`link_bytes_per_s.node` names one level of a dict field)."""
    changes: dict[str, Any] = {}
    for name, value in values.items():
        field, _, level = name.partition('.')
        if level:
            changes.setdefault(field, dict(getattr(hw, field)))[level] = value
        else:
            changes[field] = value
    return dataclasses.replace(hw, **changes)


def predict(ms: list[measured_lib.Measurement], hw: hw_lib.Hardware) -> np.ndarray:
    """Predicted seconds per step of each measurement on `hw`."""
    return np.array([planner.timing(m.work, hw)[1].step_s for m in ms])


def candidates(ms: list[measured_lib.Measurement], hw: hw_lib.Hardware) -> list[Param]:
    """Every parameter the measurements exercise, with scales from the data, in order of priority.

    The order is the order of fitting when the data cannot determine them all: GEMM efficiency
    first, then bandwidths, overlap and the bubble, then fixed costs, GEMM shape and latencies.
    """
    levels = sorted({t.level for m in ms for t in m.work.traffic if t.payload_bytes > 0 and t.group > 1},
                    key=hw_lib.LEVELS.index, reverse=True)
    median_s = float(np.median([m.measured_s for m in ms]))
    layer_units = float(np.median([m.work.compute.layers * m.work.layout.accum_steps for m in ms]))
    params = [Param('matmul_efficiency', 'log'), Param('memory_bytes_per_s', 'log')]
    if len({estimate.effective_remat(m.work.layout) for m in ms}) > 1:  # policies keeping different residuals
        params.append(Param('stash_passes', 'linear', 5.0))  # in units of the 4-5 passes compute_work counts
    params += [Param(f'link_bytes_per_s.{lv}', 'log') for lv in levels]
    if levels:
        params.append(Param('overlap', 'share'))
    if any(m.work.layout.pipeline > 1 for m in ms):
        params.append(Param('bubble_scale', 'share'))
    params += [Param('step_overhead_s', 'linear', median_s),
               Param('layer_overhead_s', 'linear', median_s / layer_units),
               Param('gemm_half_flops', 'linear', float(np.median([m.work.compute.layer_flops for m in ms])))]
    params += [Param(f'link_latency_s.{lv}', 'log') for lv in levels]
    return params


def _residual_fn(ms, prior: hw_lib.Hardware, params: list[Param],
                 prior_weight: float = 0.0) -> Callable[[np.ndarray], np.ndarray]:
    log_measured = np.log([m.measured_s for m in ms])
    x0 = np.array([p.x0(prior) for p in params])

    def residuals(x: np.ndarray) -> np.ndarray:
        hw = with_values(prior, {p.name: p.value(prior, xi) for p, xi in zip(params, x)})
        r = np.log(predict(ms, hw)) - log_measured
        return np.concatenate([r, prior_weight * (x - x0)]) if prior_weight else r

    return residuals


def jacobian(ms, prior: hw_lib.Hardware, params: list[Param], step: float = 1e-3) -> np.ndarray:
    """d log(predicted step time) / d x at the prior, one-sided into the feasible side."""
    fn = _residual_fn(ms, prior, params)
    x0 = np.array([p.x0(prior) for p in params])
    base = fn(x0)
    cols = []
    for i, p in enumerate(params):
        h = -step if x0[i] + step > p.bounds()[1] else step
        x = x0.copy()
        x[i] += h
        cols.append((fn(x) - base) / h)
    return np.stack(cols, axis=1) if cols else np.zeros((len(ms), 0))


def identifiable(jac: np.ndarray, params: list[Param], limit: int) -> tuple[list[int], dict[str, str]]:
    """Indices of the parameters to fit and why the others stay at their prior.

    Gram-Schmidt over the Jacobian's columns in the candidates' order of priority: a column with
    ~zero effect, or mostly explained by the columns already kept (collinear), is left out; at
    most `limit` are kept.
    """
    n = jac.shape[0]
    kept: list[int] = []
    basis: list[np.ndarray] = []
    left: dict[str, str] = {}
    for i, p in enumerate(params):
        col = jac[:, i]
        norm = float(np.linalg.norm(col))
        if not np.isfinite(norm) or norm / math.sqrt(n) < ZERO_EFFECT:
            left[p.name] = 'no effect on these measurements'
            continue
        resid = col - sum((b @ col) * b for b in basis)
        if np.linalg.norm(resid) < COLLINEAR * norm:
            left[p.name] = 'collinear with ' + ', '.join(params[k].name for k in kept)
        elif len(kept) >= limit:
            left[p.name] = f'too few measurements ({n}) for more than {limit} parameter(s)'
        else:
            kept.append(i)
            basis.append(resid / np.linalg.norm(resid))
    return kept, left


@dataclasses.dataclass(frozen=True)
class Fit:
    hardware: hw_lib.Hardware
    fitted: dict[str, dict[str, float]]  # name -> prior, value
    at_prior: dict[str, str]  # name -> why it was not fitted
    cost: float


def fit(ms: list[measured_lib.Measurement], prior: hw_lib.Hardware, names: list[str] | None = None,
        start: hw_lib.Hardware | None = None, prior_weight: float = PRIOR_WEIGHT) -> Fit:
    """Fits the identifiable parameters (or exactly `names`) of `prior` to `ms`, starting from `start`."""
    from scipy import optimize  # pylint: disable=g-import-not-at-top

    params = candidates(ms, prior)
    if names is not None:
        known = {p.name: p for p in params}
        params = [known[n] for n in names if n in known]
        kept, at_prior = list(range(len(params))), {}
    else:
        kept, at_prior = identifiable(jacobian(ms, prior, params), params, max(1, len(ms) // 2))
    chosen = [params[i] for i in kept]
    fn = _residual_fn(ms, prior, chosen, prior_weight)
    lo, hi = np.array([p.bounds()[0] for p in chosen]), np.array([p.bounds()[1] for p in chosen])
    # Start inside the bounds: trf's scaling takes only tiny steps from a point on a bound.
    x0 = np.clip(np.array([p.x0(prior, start) for p in chosen]), lo + INTERIOR, hi - INTERIOR)
    result = optimize.least_squares(fn, x0, bounds=(lo, hi), loss=LOSS, f_scale=LOSS_SCALE, x_scale=1.0)
    values = {p.name: p.value(prior, x) for p, x in zip(chosen, result.x)}
    fitted = {p.name: {'prior': get_value(prior, p.name), 'value': values[p.name]} for p in chosen}
    return Fit(with_values(prior, values), fitted, at_prior, float(result.cost))


def _abs_rel(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return np.abs(pred / meas - 1.0)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy import stats  # pylint: disable=g-import-not-at-top

    return math.nan if len(a) < 3 else float(stats.spearmanr(a, b).statistic)


def check_params(ms: list[measured_lib.Measurement], prior: hw_lib.Hardware, names: list[str] | None) -> None:
    """Bad requests: unknown parameters, or fewer measurements than parameters (+1 held out)."""
    if len(ms) < 3:
        raise errors.UserError(f'--results: {len(ms)} measured trial(s); calibration needs at least 3 (two to fit a '
                               'parameter, one held out). Fix: give the results of a larger sweep')
    if names is None:
        return
    known = [p.name for p in candidates(ms, prior)]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise errors.UserError(f'--params: {", ".join(unknown)} cannot be fitted to these measurements. Fix: choose '
                               f'from {", ".join(known)}')
    if len(names) > len(ms) - 1:
        raise errors.UserError(f'--params: {len(names)} parameters but only {len(ms)} measured trials (each fit '
                               f'holds one out). Fix: fit at most {len(ms) - 1} parameters, or give more trials')


def calibrate(ms: list[measured_lib.Measurement], prior: hw_lib.Hardware,
              names: list[str] | None = None) -> tuple[hw_lib.Hardware, dict[str, Any]]:
    """The calibrated description and the report (fit, leave-one-out, rank correlation)."""
    check_params(ms, prior, names)
    meas = np.array([m.measured_s for m in ms])
    tokens = np.array([m.tokens for m in ms])
    uncal = predict(ms, prior)
    full = fit(ms, prior, names)
    fitted = predict(ms, full.hardware)
    # Each fold selects and fits its own parameters from the prior: nothing of the left-out trial leaks in.
    held = np.array([predict([m], fit(ms[:i] + ms[i + 1:], prior, names).hardware)[0] for i, m in enumerate(ms)])
    report = {
        'trials': len(ms), 'hardware_prior': prior.name, 'holdout': 'leave-one-out',
        'holdout_median_abs_rel_error': float(np.median(_abs_rel(held, meas))),
        'uncalibrated_median_abs_rel_error': float(np.median(_abs_rel(uncal, meas))),
        'fit_median_abs_rel_error': float(np.median(_abs_rel(fitted, meas))),
        'holdout_max_abs_rel_error': float(np.max(_abs_rel(held, meas))),
        'spearman_holdout': spearman(tokens / held, tokens / meas),
        'spearman_fit': spearman(tokens / fitted, tokens / meas),
        'spearman_uncalibrated': spearman(tokens / uncal, tokens / meas),
        'fitted': full.fitted, 'at_prior': full.at_prior,
        'per_trial': [{'name': m.name, 'model': m.model, 'layout': m.work.layout.describe(),
                       'devices': m.work.layout.num_devices, 'measured_s': float(meas[i]),
                       'uncalibrated_s': float(uncal[i]), 'fitted_s': float(fitted[i]), 'holdout_s': float(held[i]),
                       'measured_tokens_per_s': float(tokens[i] / meas[i]),
                       'holdout_tokens_per_s': float(tokens[i] / held[i])} for i, m in enumerate(ms)],
        'sources': sorted({m.source for m in ms}), 'machine': ms[0].machine,
        **repeat_spread(ms),
    }
    summary = {k: report[k] for k in ('trials', 'holdout', 'holdout_median_abs_rel_error',
                                      'uncalibrated_median_abs_rel_error', 'fit_median_abs_rel_error',
                                      'spearman_holdout', 'machine', 'sources')}
    summary['fitted'] = sorted(full.fitted)
    hw = dataclasses.replace(full.hardware, name=f'{prior.name}-calibrated', calibration=summary,
                             description=f'{prior.description}; calibrated on {len(ms)} measured steps '
                             f'(held-out error {report["holdout_median_abs_rel_error"]:.1%} median)')
    return hw, report


def repeat_spread(ms: list[measured_lib.Measurement]) -> dict[str, Any]:
    """How far repeated measurements of one layout lie from their median: the noise floor of any fit."""
    spread = [abs(t / m.measured_s - 1.0) for m in ms for t in m.repeats]
    if not spread:
        return {}
    return {'repeated_layouts': sum(bool(m.repeats) for m in ms),
            'repeat_median_abs_rel_spread': float(np.median(spread))}


def format_report(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    lines = [f'calibrated on {report["trials"]} measured trials ({report["machine"]}):',
             f'  median |error| of step time: held out ({report["holdout"]}) '
             f'{report["holdout_median_abs_rel_error"]:.1%}, fitted {report["fit_median_abs_rel_error"]:.1%}, '
             f'uncalibrated {report["uncalibrated_median_abs_rel_error"]:.1%}',
             f'  rank correlation (Spearman) of throughput: held out {report["spearman_holdout"]:.2f}, fitted '
             f'{report["spearman_fit"]:.2f}, uncalibrated {report["spearman_uncalibrated"]:.2f}']
    if 'repeated_layouts' in report:
        lines.append(f'  {report["repeated_layouts"]} layouts measured more than once: repeats lie '
                     f'{report["repeat_median_abs_rel_spread"]:.1%} (median) from their median')
    lines.append('  fitted:')
    lines += [f'    {k:<26s} {v["prior"]:.4g} -> {v["value"]:.4g}' for k, v in report['fitted'].items()]
    lines += ['  at their prior:'] + [f'    {k:<26s} {why}' for k, why in report['at_prior'].items()]
    lines.append(f'  {"trial":<14s} {"measured s":>11s} {"uncal. s":>10s} {"held-out s":>11s}  layout')
    lines += [f'  {t["name"][:14]:<14s} {t["measured_s"]:>11.4g} {t["uncalibrated_s"]:>10.4g} {t["holdout_s"]:>11.4g}'
              f'  {t["layout"]}' for t in report['per_trial']]
    return '\n'.join(lines)
