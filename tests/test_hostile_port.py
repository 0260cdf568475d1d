"""Two jobs given the same coordinator port (issue 28, weak case): process 0 refuses with one line.

gRPC binds the coordinator's port with SO_REUSEPORT, so two `launch/local.sh` jobs given the same
`JF_PORT` both bound it and their processes could meet the other job's coordinator, without an error.
"""

import socket

import pytest

from jaxfrontier import distributed


def listener(reuse_port: bool):
    s = socket.socket()
    if reuse_port:  # as gRPC binds
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(('127.0.0.1', 0))
    s.listen()
    return s


@pytest.mark.parametrize('reuse_port', [True, False])
def test_process_0_refuses_a_port_in_use(reuse_port):
    with listener(reuse_port) as busy:
        port = busy.getsockname()[1]
        settings = distributed.ProcessSettings('explicit', 2, 0, f'127.0.0.1:{port}')
        with pytest.raises(distributed.DistributedError, match=f'coordinator port {port} .* is already in use'):
            distributed.check_port_free(settings)
    distributed.check_port_free(settings)  # released: free again


def test_initialize_checks_the_port_before_jax(monkeypatch):
    with listener(True) as busy:
        settings = distributed.ProcessSettings('explicit', 2, 0, f'127.0.0.1:{busy.getsockname()[1]}')
        with pytest.raises(distributed.DistributedError, match='already in use'):
            distributed.initialize(settings, type('D', (), {'initialization_timeout_s': 1, 'heartbeat_timeout_s': 1,
                                                             'shutdown_timeout_s': 1})())
