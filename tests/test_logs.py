"""logs.process0: a module's own logger, silent on every process but 0."""

import logging

import jax

from jaxfrontier import logs


def test_process0_logger_writes_on_process_0_only(monkeypatch, caplog):
    logger = logs.process0('jaxfrontier.test_logs_probe')
    assert logs.process0('jaxfrontier.test_logs_probe') is logger and len(logger.filters) == 1  # idempotent
    with caplog.at_level(logging.INFO, logger='jaxfrontier.test_logs_probe'):
        logger.info('from process 0')
        monkeypatch.setattr(jax, 'process_index', lambda: 3)
        logger.info('from process 3')
    assert [(r.name, r.getMessage()) for r in caplog.records] == [('jaxfrontier.test_logs_probe', 'from process 0')]


def test_checkpoint_modules_log_under_their_own_names(caplog):
    from jaxfrontier.checkpoint import manager  # pylint: disable=g-import-not-at-top
    with caplog.at_level(logging.INFO, logger='jaxfrontier.checkpoint.manager'):
        manager.log('probe')
    assert [(r.name, r.getMessage()) for r in caplog.records] == [('jaxfrontier.checkpoint.manager', 'probe')]


def test_optax_schedule_info_is_dropped_and_absl_warnings_kept(monkeypatch, caplog):
    """--mode=verify's shrunk configs (no warmup) made optax log INFO lines about its schedules (issue 39)."""
    import optax  # pylint: disable=g-import-not-at-top
    absl_logger = logging.getLogger('absl')
    monkeypatch.setattr(absl_logger, 'filters', [])
    logs.quiet_library_logs()
    logs.quiet_library_logs()
    assert len(absl_logger.filters) == 1  # idempotent
    with caplog.at_level(logging.INFO, logger='absl'):
        optax.polynomial_schedule(1.0, 0.0, 1, transition_steps=0)
        absl_logger.info('ours')
        absl_logger.warning('a warning')
    assert [r.getMessage() for r in caplog.records] == ['ours', 'a warning']
