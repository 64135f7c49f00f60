"""Emulated WAN for the benchmarks: network namespaces, veth pairs, a bridge and ``tc tbf``.

Topology (everything lives in namespaces this process creates, named ``<prefix>-...``; the
root namespace gets no address and no route):

    <prefix>-hub:  bridge br0 10.123.0.1/24   (the lighthouse listens here)
       |-- veth h<i> (egress: tbf, the group's download) ---- wan0 in <prefix>-g<i>
    <prefix>-g<i>: wan0 10.123.0.<10+i>/24    (egress: tbf, the group's upload)

Each replica group thus has its own symmetric link of ``rate`` (e.g. 100 Mbit/s up and down)
to the others. The kernel here has ``tbf``/``htb`` but no ``netem``: no latency or loss can be
added, only a bandwidth limit (queueing delay up to ``latency`` only when the link is full).

``Wan`` is a context manager: the namespaces (and with them their veths and bridge) are deleted
on exit, also after an error. It needs root and the ``ip``/``tc`` commands; ``unavailable()``
says why it cannot run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.123.0"
HUB_IP = f"{SUBNET}.1"
GROUP_IFACE = "wan0"


def group_ip(index: int) -> str:
    return f"{SUBNET}.{10 + index}"


def unavailable() -> str | None:
    """Why namespaces cannot be built here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns / tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command is missing (apt-get install iproute2)"
    probe = f"ttwanprobe{os.getpid() % 100000}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"'ip netns add' is not permitted here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def tbf_args(rate_mbit: float) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``rate_mbit``: a bucket of 10 ms of traffic (at least
    64 KiB: more than a timer tick's worth at HZ=250) and a queue of up to 50 ms."""
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.010))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]


@dataclass
class Wan:
    groups: int
    rate_mbit: float | None  # None: no shaping (veth speed)
    prefix: str = field(default_factory=lambda: f"ttwan{os.getpid() % 100000}")
    created: list[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def group_ns(self, index: int) -> str:
        return f"{self.prefix}-g{index}"

    def __enter__(self) -> Wan:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._netns(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.groups):
            ns = self.group_ns(i)
            self._netns(ns)
            # Created inside the hub namespace (names there cannot clash with anyone's), the
            # group's end is then moved to the group's namespace and renamed.
            hub_end, far_end = f"h{i}", f"x{i}"
            _run("ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name",
                 far_end)  # fmt: skip
            _run("ip", "-n", self.hub, "link", "set", far_end, "netns", ns)
            _run("ip", "-n", ns, "link", "set", far_end, "name", GROUP_IFACE)
            _run("ip", "-n", ns, "addr", "add", f"{group_ip(i)}/24", "dev", GROUP_IFACE)
            _run("ip", "-n", ns, "link", "set", GROUP_IFACE, "up")
            _run("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", hub_end, "up")
            if self.rate_mbit is not None:
                shape = tbf_args(self.rate_mbit)
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", GROUP_IFACE,
                     "root", *shape)  # fmt: skip
                _run("ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", hub_end,
                     "root", *shape)  # fmt: skip

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def tx_bytes(self, index: int) -> int:
        """Bytes group ``index`` has sent on its link so far (IP packets, headers included)."""
        out = _run(*self.exec_prefix(self.group_ns(index)), "cat",
                   f"/sys/class/net/{GROUP_IFACE}/statistics/tx_bytes")  # fmt: skip
        return int(out.strip())

    def qdisc(self, index: int) -> str:
        return _run(*self.exec_prefix(self.group_ns(index)), "tc", "qdisc", "show", "dev",
                    GROUP_IFACE).strip()  # fmt: skip

    def close(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        self.created.clear()


def leftover_namespaces(prefix: str) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (a check that ``close`` cleaned up)."""
    root = Path("/var/run/netns")
    return (
        sorted(p.name for p in root.iterdir() if p.name.startswith(prefix)) if root.exists() else []
    )
