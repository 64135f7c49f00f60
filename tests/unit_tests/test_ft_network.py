"""Where fault tolerance's own listeners bind: the address of ``fault_tolerance.hostname``
(127.0.0.1 by default), never every interface."""

from __future__ import annotations

import ipaddress
import os
from datetime import timedelta

import pytest

from torchtitan.components.ft import FaultToleranceError, bind_ip, listen_store
from torchtitan.components.ft.network import host_port
from torchtitan.components.ft.torchft_adapter import manager_server_bound_to
from torchtitan.tools.cluster import listening_sockets
from torchtitan.tools.loopback_torchrun import LoopbackTCPStore


def my_listeners(port: int) -> list[str]:
    return [addr for _, addr, p in listening_sockets([os.getpid()]) if p == port]


def test_bind_ip_resolves_names_and_keeps_addresses():
    assert bind_ip("127.0.0.1") == "127.0.0.1"
    assert bind_ip("[::1]") == "::1"
    assert ipaddress.ip_address(bind_ip("localhost")).is_loopback
    with pytest.raises(FaultToleranceError, match="fault_tolerance.hostname"):
        bind_ip("no-such-host.invalid")


def test_host_port_brackets_ipv6():
    assert host_port("127.0.0.1", 5) == "127.0.0.1:5"
    assert host_port("::1", 5) == "[::1]:5"


def test_local_store_listens_on_its_address_only():
    store = listen_store("127.0.0.1")
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert my_listeners(store.port) == ["127.0.0.1"]


def test_manager_server_is_bound_to_the_given_address(monkeypatch):
    monkeypatch.setenv("RUST_LOG", "warn")
    import torchft.manager as torchft_manager
    from torchft.coordination import LighthouseServer

    original = torchft_manager.ManagerServer
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        with manager_server_bound_to("127.0.0.1"):
            # What torchft's Manager does, with its hard-coded bind address.
            server = torchft_manager.ManagerServer(
                replica_id="unit",
                lighthouse_addr=lighthouse.address(),
                hostname="127.0.0.1",
                bind="[::]:0",
                store_addr="127.0.0.1:1",
                world_size=1,
                heartbeat_interval=timedelta(milliseconds=100),
                connect_timeout=timedelta(seconds=5),
                quorum_retries=0,
            )
        assert torchft_manager.ManagerServer is original
        port = int(server.address().rsplit(":", 1)[1])
        assert my_listeners(port) == ["127.0.0.1"]
        server.shutdown()
    finally:
        lighthouse.shutdown()


def test_loopback_torchrun_store_binds_loopback_only():
    store = LoopbackTCPStore("localhost", 0, 1, True, wait_for_workers=False)
    store.set("k", "v")
    listeners = my_listeners(store.port)
    assert listeners and all(ipaddress.ip_address(a).is_loopback for a in listeners)


def test_confine_to_host_for_a_one_process_group(monkeypatch):
    from torchtitan.components.ft import confine_to_host
    from torchtitan.config import JobConfig

    for name in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = JobConfig()
    config.fault_tolerance.enable = True
    confine_to_host(config)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert my_listeners(int(os.environ["MASTER_PORT"])) == ["127.0.0.1"]
    assert os.environ["GLOO_SOCKET_IFNAME"].startswith("lo")
    assert os.environ["NCCL_SOCKET_IFNAME"] == os.environ["GLOO_SOCKET_IFNAME"]


def test_every_process_group_rebuild_gets_fresh_rendezvous_keys():
    """Two members rebuilding twice under the same quorum id (a restarted lighthouse numbers
    its quorums from 1 again) meet on a new prefix each time, and agree on it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from torchtitan.components.ft import fresh_rendezvous_address

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}/torchft/1/0"
    timeout = timedelta(seconds=10)
    first = [fresh_rendezvous_address(address, 2, timeout) for _ in range(2)]
    second = [fresh_rendezvous_address(address, 2, timeout) for _ in range(2)]
    assert first == [f"{address}/rebuild_0"] * 2
    assert second == [f"{address}/rebuild_1"] * 2
