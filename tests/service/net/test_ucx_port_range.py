"""Issue 35: ``ucx_tcp_port_range`` pins the ports UCX's tcp transport listens on (``UCX_TCP_PORT_RANGE``),
so a NetworkPolicy can admit exactly the data plane. The option is validated, becomes the environment
variable before any NIXL agent exists, and real daemons then listen for UCX inside the range only."""

import psutil
import pytest

from kvxferd.errors import InvalidArgumentError
from kvxferd.service.base.config import load_config
from kvxferd.service.net.exposure import ucx_environment
from kvxferd.rig.daemons import DaemonCluster
from tests.service.helpers import GQA_GROUPS, two_block_request


@pytest.mark.parametrize("given, kept", [("40000-40099", "40000-40099"), (" 40000 - 40099 ", "40000-40099"),
                                         ("1024-1024", "1024-1024"), ("65535-65535", "65535-65535")])
def test_a_valid_range_is_kept(given, kept):
    assert load_config({"ucx_tcp_port_range": given}).ucx_tcp_port_range == kept


@pytest.mark.parametrize("given", ["40099-40000", "80-90", "1023-2000", "40000-65536", "40000", "40000-",
                                   "-40000", "a-b", "40000-40099-1", "", "4\uff10000-40099", "0x9c40-40099"])
def test_a_bad_range_is_refused_naming_the_option(given):
    with pytest.raises(InvalidArgumentError) as err:
        load_config({"ucx_tcp_port_range": given})
    assert err.value.field == "ucx_tcp_port_range"


def test_the_range_comes_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("KVXFERD_UCX_TCP_PORT_RANGE", "41000-41009")
    assert load_config().ucx_tcp_port_range == "41000-41009"


def test_the_daemon_sets_ucx_tcp_port_range_only_when_configured():
    assert ucx_environment(load_config({"ucx_tcp_port_range": "41000-41009"}), {}) == {
        "UCX_NET_DEVICES": "lo", "UCX_TCP_PORT_RANGE": "41000-41009", "UCX_TCP_TX_SEG_SIZE": "64k"}
    assert ucx_environment(load_config(), {}) == {"UCX_NET_DEVICES": "lo", "UCX_TCP_TX_SEG_SIZE": "64k"}


def test_an_operators_segment_size_stays():
    """Issue #58: 64 KiB send segments unless the operator's environment says otherwise."""
    assert ucx_environment(load_config(), {"UCX_TCP_TX_SEG_SIZE": "8k"}) == {"UCX_NET_DEVICES": "lo"}


LOW, HIGH = 40100, 40199


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_daemons_listen_for_ucx_inside_the_range_only(workdir, monkeypatch, pinned):
    """A read between two real daemons over UCX's tcp transport (as between pods without RDMA); then every
    TCP port a daemon listens on, apart from its peer, notify and metrics ports, is in the range. Unpinned,
    the same daemons listen on ports the OS picks (the test can tell)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when the daemons create their agents
    args = ("--ucx-tcp-port-range", f"{LOW}-{HIGH}") if pinned else ()
    with DaemonCluster(*GQA_GROUPS, 1, 1, workdir=workdir, name=f"ucx{int(pinned)}", daemon_args=args) as cluster:
        request = two_block_request("ucx", 0)
        assert all(c.ok for c in cluster.read(request))
        problems, wrong = cluster.verify(request)
        assert not problems and wrong == 0
        ucx_ports = set()
        for daemon in cluster.daemons:
            own = {int(port) for port in daemon.port_args()[1::2]}  # --peer-port N --notify-port N --metrics-port N
            listening = {c.laddr.port for c in psutil.Process(daemon.process.pid).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN}
            assert own <= listening and listening - own, (own, listening)  # UCX listens besides
            ucx_ports |= listening - own
    inside = {port for port in ucx_ports if LOW <= port <= HIGH}
    assert inside == ucx_ports if pinned else inside != ucx_ports, sorted(ucx_ports)
